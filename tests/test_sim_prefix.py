"""The lock-step prefix model: deterministic, bounded caches, affinity beats round robin."""

import itertools

from trio_dpcoord.sim.prefix import RankCache, RankModel, run_fleet
from trio_dpcoord.sim.traces import Request, multi_turn_chat


def test_cache_never_exceeds_capacity_and_only_uncached_is_computed() -> None:
    rank = RankModel(RankCache(capacity_blocks=3))
    rank.admit(Request(0.0, tuple(range(40)), 1, 0), block_size=16)
    assert len(rank.cache.blocks) <= 3
    rank.admit(Request(0.0, (*range(40), 7), 1, 0), block_size=16)
    assert rank.computed_prompt_tokens == 40 + (41 - 32)
    rank.admit(Request(0.0, tuple(range(500, 600)), 1, 1), block_size=16)
    assert len(rank.cache.blocks) == 3


def test_deterministic_and_affinity_beats_round_robin() -> None:
    trace = multi_turn_chat(1, sessions=16, turns=4)
    counter = itertools.count()
    def round_robin(request: Request, fleet: list[RankModel]) -> int:
        return next(counter) % len(fleet)
    def affinity(request: Request, fleet: list[RankModel]) -> int:
        return request.session_id % len(fleet)
    first = run_fleet(trace, 4, affinity, capacity_blocks=200)
    assert first == run_fleet(trace, 4, affinity, capacity_blocks=200)
    scattered = run_fleet(trace, 4, round_robin, capacity_blocks=200)
    assert first.hit_rate > scattered.hit_rate
