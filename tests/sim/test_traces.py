"""The routing traces are seeded and their reuse bound counts whole cached blocks."""

from trio_dpcoord.sim.traces import Request, multi_turn_chat, no_reuse, reuse_bound


def test_traces_are_deterministic_for_a_seed() -> None:
    assert multi_turn_chat(3, sessions=4, turns=3) == multi_turn_chat(3, sessions=4, turns=3)
    assert multi_turn_chat(3, sessions=4, turns=3) != multi_turn_chat(4, sessions=4, turns=3)


def test_reuse_bound_on_a_hand_made_trace() -> None:
    first = tuple(range(40))  # 2 whole blocks + 8 tokens
    second = first + tuple(range(100, 110))  # shares the 2 whole blocks
    trace = [Request(0.0, first, 1, 0), Request(1.0, second, 1, 0)]
    assert reuse_bound(trace, block_size=16) == 32 / (40 + 50)


def test_multi_turn_reuses_most_tokens_and_no_reuse_none() -> None:
    assert reuse_bound(multi_turn_chat(0)) > 0.7
    assert reuse_bound(no_reuse(0, requests=16)) == 0.0
