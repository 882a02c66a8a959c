"""The sans-IO prefix router: index bounds, KV-event decoding, the policy."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence
from itertools import permutations, product
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from trio_dpcoord import EngineChooser, EngineLoad, PrefixRouting
from trio_dpcoord.protocol import KVEventError, decode_event_batch
from trio_dpcoord.routing import PrefixRouter, RankPrefixIndex, block_keys, vllm_score


def stored_event(
    hashes: list[int], parent: int | None, tokens: Sequence[int], block_size: int
) -> dict[str, object]:
    """A ``BlockStored`` as vLLM's msgspec encoder writes it (a map tagged by ``type``)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def batch(*events: object, ts: float = 1.0, rank: int | None = 0) -> bytes:
    payload: bytes = msgpack.packb([ts, list(events), rank])
    return payload


def test_block_keys_are_chained_and_full_blocks_only() -> None:
    a = block_keys(list(range(40)), 16)
    b = block_keys([99, *range(1, 40)], 16)
    assert len(a) == 2
    assert a[0] != b[0] and a[1] != b[1]  # a different first block changes every key after it
    assert block_keys(list(range(32)), 16) == a


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_block_keys_tell_reordered_blocks_apart(block_size: int) -> None:
    """Every sequence of the same few blocks, in every order and of every length up to
    six, has a key of its own (chained by a sum of the salted block hashes, the 4,096
    orders of six blocks drawn from four shared 590 keys), and a prompt's keys are its
    prefixes' keys."""
    rng = random.Random(block_size)
    blocks: list[tuple[int, ...]] = []
    while len(blocks) < 4:
        block = tuple(rng.randrange(4) for _ in range(block_size))
        if block not in blocks:
            blocks.append(block)
    prompts = [seq for depth in range(1, 7) for seq in product(blocks, repeat=depth)]
    keys = {block_keys([t for block in seq for t in block], block_size)[-1] for seq in prompts}
    assert len(keys) == len(prompts)
    for seq in permutations(blocks, 3):
        tokens = [t for block in seq for t in block]
        head = tokens[: 2 * block_size]
        assert block_keys(tokens, block_size)[:2] == block_keys(head, block_size)


def test_approximate_feed_routes_a_repeat_prompt_to_its_rank() -> None:
    router = PrefixRouter(4, PrefixRouting(imbalance_abs=10_000))
    prompt = list(range(256))
    first = router.choose(prompt, [0, 0, 0, 0], 0.0).engine_index
    assert router.cached_tokens(first, prompt, 1.0) == 256
    # Its rank is somewhat busier but the uncached prompt elsewhere would cost more.
    loads = [100.0] * 4
    loads[first] = 150.0
    assert router.choose(prompt + [7] * 16, loads, 1.0).engine_index == first


def test_a_request_stays_with_its_prefix_until_the_queue_there_costs_more() -> None:
    router = PrefixRouter(2, PrefixRouting(imbalance_abs=1e9))  # reuse_weight 1
    prompt = list(range(64))
    first = router.choose(prompt, [0, 0], 0.0).engine_index
    loads = [0.0, 0.0]
    # Elsewhere it would compute the 64 tokens again and throw away their affinity (64
    # more): it stays while its rank's queue is less than 128 tokens longer.
    loads[first] = 127.0
    assert router.choose(prompt, loads, 1.0).engine_index == first
    loads[first] = 129.0
    assert router.choose(prompt, loads, 1.0).engine_index == 1 - first
    # A new prompt has nothing to keep: the least loaded rank.
    loads[first] = 1.0
    assert router.choose([5] * 64, loads, 1.0).engine_index == 1 - first


def test_guard_falls_back_to_least_loaded_and_pinned_is_honoured() -> None:
    router = PrefixRouter(3, PrefixRouting(imbalance_abs=100, imbalance_rel=2))
    assert router.choose([1] * 32, [500, 10, 20], 0.0).engine_index == 1
    assert router.counters.guard_fallbacks == 1
    assert router.observe(2, [1] * 32, 0.0).engine_index == 2
    with pytest.raises(ValueError):
        router.observe(3, [1] * 32, 0.0)


def test_ties_rotate() -> None:
    router = PrefixRouter(3, PrefixRouting(feed="exact", provisional_age=0))
    chosen = {router.choose([i] * 16, [0, 0, 0], 0.0).engine_index for i in range(3)}
    assert chosen == {0, 1, 2}


def test_age_limit_forgets() -> None:
    router = PrefixRouter(2, PrefixRouting(max_age=10.0))
    prompt = list(range(32))
    rank = router.choose(prompt, [0, 0], 0.0).engine_index
    assert router.cached_tokens(rank, prompt, 5.0) == 32
    assert router.cached_tokens(rank, prompt, 20.0) == 0


def test_exact_feed_from_vllm_events() -> None:
    router = PrefixRouter(2, PrefixRouting(feed="exact", block_size=4))
    tokens = list(range(12))
    stored = stored_event([11, 12], None, tokens[:8], 4)
    child = stored_event([13], 12, tokens[8:], 4)
    assert router.receive_kv_events(1, 0, batch(stored, child), now=0.0)
    assert router.cached_tokens(1, tokens, 0.0) == 12
    assert router.cached_tokens(0, tokens, 0.0) == 0
    assert router.choose(tokens, [0, 0], 0.0).engine_index == 1
    assert router.cached_tokens(0, tokens, 0.0) == 0  # exact feed learns only from events
    removed = {"type": "BlockRemoved", "block_hashes": [12], "medium": None}
    assert router.receive_kv_events(1, 1, batch(removed), now=0.0)
    assert router.cached_tokens(1, tokens, 0.0) == 4
    assert router.receive_kv_events(1, 2, batch({"type": "AllBlocksCleared"}), now=0.0)
    assert router.cached_tokens(1, tokens, 0.0) == 0


def test_exact_feed_believes_a_routed_prompt_until_its_events_are_due() -> None:
    """An engine stores a prompt's blocks only once it has computed them: until then the
    exact feed takes a routed prompt as cached there for ``provisional_age`` seconds, so
    the conversation's next turn follows it; unconfirmed, the belief ends; confirmed by
    the rank's events, it stays; ``provisional_age=0`` learns from events only."""
    tokens = list(range(12))
    router = PrefixRouter(2, PrefixRouting(feed="exact", block_size=4, provisional_age=5.0))
    rank = router.choose(tokens, [0, 0], 0.0).engine_index
    assert router.cached_tokens(rank, tokens, 1.0) == 12
    assert router.choose([*tokens, 99], [0, 0], 1.0).engine_index == rank  # the next turn follows
    router.choose([50] * 8, [0, 0], 6.0)  # later decisions expire what is due
    assert router.cached_tokens(rank, tokens, 6.0) == 0  # unconfirmed: forgotten

    router = PrefixRouter(2, PrefixRouting(feed="exact", block_size=4, provisional_age=5.0))
    rank = router.choose(tokens, [0, 0], 0.0).engine_index
    stored = stored_event([11, 12, 13], None, tokens, 4)
    assert router.receive_kv_events(rank, 0, batch(stored), now=2.0)  # confirmed
    router.choose([50] * 8, [0, 0], 6.0)
    assert router.cached_tokens(rank, tokens, 6.0) == 12

    router = PrefixRouter(2, PrefixRouting(feed="exact", block_size=4, provisional_age=0))
    rank = router.choose(tokens, [0, 0], 0.0).engine_index
    assert router.cached_tokens(rank, tokens, 0.0) == 0
    with pytest.raises(ValueError, match="provisional_age"):
        PrefixRouting(provisional_age=-1.0)


def test_lost_batch_forgets_the_rank() -> None:
    router = PrefixRouter(1, PrefixRouting(feed="exact", block_size=4))
    stored = stored_event([1], None, [1, 2, 3, 4], 4)
    assert router.receive_kv_events(0, 5, batch(stored), now=0.0)
    assert router.cached_tokens(0, [1, 2, 3, 4], 0.0) == 4
    assert router.receive_kv_events(0, 7, batch(), now=0.0)  # seq 6 lost
    assert router.counters.event_gaps == 1
    assert router.cached_tokens(0, [1, 2, 3, 4], 0.0) == 0


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        bytes(msgpack.packb({"ts": 1})),
        msgpack.packb([1.0, [{"type": "Nope"}], 0]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4]], 0]),  # array-like
        msgpack.packb([1.0, [stored_event([1], None, [1, 2], 4)], 0]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": "x"}], 0]),
        msgpack.packb([True, [], 0]),
    ],
)
def test_bad_event_batches_are_rejected_and_counted(payload: bytes) -> None:
    with pytest.raises(KVEventError):
        decode_event_batch(payload)
    router = PrefixRouter(1, PrefixRouting(feed="exact"))
    assert not router.receive_kv_events(0, 0, payload, now=0.0)
    assert router.counters.rejected_event_batches == 1
    assert not router.receive_kv_events(5, 0, batch(), now=0.0)


def test_a_flood_of_bad_event_batches_is_counted_whole_and_logged_by_the_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every refusal counts; the log gets a line per reason only every few seconds of
    the router's clock (a minute later surely), which says how many it held back."""
    router = PrefixRouter(2, PrefixRouting(feed="exact"))
    with caplog.at_level(logging.WARNING, logger="trio_dpcoord.routing"):
        for step in range(10):
            assert not router.receive_kv_events(0, step, b"\xc1", now=step * 0.1)
        assert not router.receive_kv_events(7, 0, batch(), now=1.0)
        assert not router.receive_kv_events(0, 11, b"\xc1", now=60.0)
    assert router.counters.rejected_event_batches == 12
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("rejected input [KV events]: batch from rank 0: ")
    assert lines[1].endswith("(10 more since last report)"), lines


class IndexMachine(RuleBasedStateMachine):
    """The index never exceeds its capacity nor holds a block older than its age limit."""

    def __init__(self) -> None:
        super().__init__()
        self.index = RankPrefixIndex(capacity_blocks=8, max_age=5.0)
        self.now = 0.0
        self.last_seen: dict[int, float] = {}

    @rule(prefix=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def store(self, prefix: list[int]) -> None:
        keys = block_keys([t for t in prefix for _ in range(2)], 2)
        self.index.store(keys, self.now)
        for key in keys:
            self.last_seen[key] = self.now
        assert all(key in self.index for key in keys[-8:])

    @rule(step=st.floats(0, 4))
    def tick(self, step: float) -> None:
        self.now += step
        self.index.expire(self.now)

    @rule(prefix=st.lists(st.integers(0, 3), max_size=6))
    def match(self, prefix: list[int]) -> None:
        keys = block_keys([t for t in prefix for _ in range(2)], 2)
        matched = self.index.matched_blocks(keys, self.now)
        assert all(key in self.index for key in keys[:matched])

    @invariant()
    def bounded(self) -> None:
        assert len(self.index) <= 8
        for key, last in self.index.blocks().items():
            assert self.now - self.last_seen[key] <= 5.0
            assert last == self.last_seen[key]


TestIndexMachine = IndexMachine.TestCase


# --- the policy, against a brute-force reading of the rule ------------------------------

BLOCK = 4


def family_prompt(family: int, branch: int, blocks: int) -> list[int]:
    """Prompts of one family share their first two blocks; of one branch, all of them."""
    shared = [family * 1000 + i for i in range(2 * BLOCK)]
    own = [family * 1000 + branch * 100 + i for i in range(max(0, blocks - 2) * BLOCK)]
    return (shared + own)[: blocks * BLOCK]


prompts = st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 6))


def brute_force(
    router: PrefixRouter, prompt: list[int], queued: Sequence[float], start: int
) -> int:
    """The rule over every rank: a rank's queue, plus the prompt tokens it lacks, plus
    ``reuse_weight`` times the tokens of the deepest cached prefix it lacks; then the
    most cached tokens, then rotation from start."""
    ranks = len(queued)
    cached = [router.cached_tokens(rank, prompt, 0.0) for rank in range(ranks)]
    most = max(cached)
    weight = router.routing.reuse_weight

    def key(rank: int) -> tuple[float, int, int]:
        lacks = most - cached[rank]
        cost = queued[rank] + len(prompt) - cached[rank] + weight * lacks
        return (cost, -cached[rank], (rank - start) % ranks)

    return min(range(ranks), key=key)


@given(
    ranks=st.integers(1, 10),
    start=st.integers(0, 9),
    learnt=st.lists(st.tuples(prompts, st.integers(0, 9)), max_size=12),
    queued=st.lists(st.integers(0, 12).map(lambda n: float(n * BLOCK)), min_size=10, max_size=10),
    prompt=prompts,
    weight=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
)
def test_the_choice_is_the_rule_over_every_rank(
    ranks: int,
    start: int,
    learnt: list[tuple[tuple[int, int, int], int]],
    queued: list[float],
    prompt: tuple[int, int, int],
    weight: float,
) -> None:
    routing = PrefixRouting(block_size=BLOCK, imbalance_abs=1e12, reuse_weight=weight)
    router = PrefixRouter(ranks, routing, start=start)
    for (family, branch, blocks), rank in learnt:
        pinned = rank % ranks
        tokens = family_prompt(family, branch, blocks)
        assert router.observe(pinned, tokens, 0.0).engine_index == pinned
        assert router.cached_tokens(pinned, tokens, 0.0) == len(tokens)  # approximate feed
    tokens = family_prompt(*prompt)
    loads = queued[:ranks]
    expected = brute_force(router, tokens, loads, start % ranks)
    decision = router.choose(tokens, loads, 0.0)
    assert 0 <= decision.engine_index < ranks
    assert decision.engine_index == expected
    assert not decision.guarded
    assert decision.cached_tokens <= len(tokens)


@given(
    ranks=st.integers(1, 8),
    rounds=st.lists(
        st.lists(st.integers(0, 50).map(float), min_size=8, max_size=8), min_size=1, max_size=8
    ),
    prompt=prompts,
)
def test_with_nothing_cached_it_is_the_least_loaded_rank(
    ranks: int, rounds: list[list[float]], prompt: tuple[int, int, int]
) -> None:
    router = PrefixRouter(
        ranks,
        PrefixRouting(block_size=BLOCK, feed="exact", provisional_age=0, imbalance_abs=1e12),
    )
    tokens = family_prompt(*prompt)
    for turn, loads in enumerate(rounds):
        queued = loads[:ranks]
        low = min(queued)
        # the first least loaded rank at or after the rotating start
        expected = next(
            r for r in [*range(turn % ranks, ranks), *range(turn % ranks)] if queued[r] == low
        )
        assert router.choose(tokens, queued, 0.0).engine_index == expected


@given(
    queued=st.lists(st.integers(0, 2000).map(float), min_size=2, max_size=8),
    absolute=st.integers(0, 1500).map(float),
    relative=st.sampled_from([1.0, 1.5, 2.0, 4.0]),
)
def test_the_guard_takes_the_least_loaded_past_both_thresholds(
    queued: list[float], absolute: float, relative: float
) -> None:
    ranks = len(queued)
    routing = PrefixRouting(block_size=BLOCK, imbalance_abs=absolute, imbalance_rel=relative)
    router = PrefixRouter(ranks, routing)
    tokens = family_prompt(0, 0, 4)
    busiest = queued.index(max(queued))
    router.observe(busiest, tokens, 0.0)  # affinity to the busiest
    low, high = min(queued), max(queued)
    imbalanced = high - low > absolute and high > relative * max(low, 1.0)
    decision = router.choose(tokens, queued, 0.0)
    assert decision.guarded == imbalanced
    assert router.counters.guard_fallbacks == int(imbalanced)
    if imbalanced:  # the first least loaded from the rotation's start (0: first decision)
        assert decision.engine_index == queued.index(low)


def test_affinity_yields_when_the_queue_costs_more_than_the_prefix() -> None:
    router = PrefixRouter(3, PrefixRouting(block_size=BLOCK, imbalance_abs=1e9, reuse_weight=2))
    history = family_prompt(1, 1, 6)  # 24 tokens
    assert router.observe(2, history, 0.0).engine_index == 2
    turn = [*history, *range(16)]  # 40 tokens, 24 of them cached on rank 2
    # On rank 2: 80 + 16 = 96; elsewhere 10 + 40 + 2 x 24 thrown away = 98: affinity.
    assert router.choose(turn, [10.0, 10.0, 80.0], 0.0).engine_index == 2
    # Equal costs go to the rank with more cached: 82 + 16 = 98 against 98.
    assert router.choose([*history, *range(200, 216)], [10.0, 10.0, 82.0], 0.0).engine_index == 2
    # With 84 queued there, 100 > 98: it goes to the least loaded other rank.
    assert router.choose([*history, *range(100, 116)], [10.0, 12.0, 84.0], 0.0).engine_index == 0


def test_front_ends_with_their_own_indexes_agree_on_a_conversations_rank() -> None:
    """Two API servers, each learning only its own choices (approximate feed): with
    ``rendezvous_slack`` a conversation's turns meet on one rank whichever server takes
    them; without it the second server, blind to the first turn, takes the least loaded
    rank by rotation."""
    system = list(range(8 * BLOCK))

    def conversation(number: int, turns: int) -> list[list[int]]:
        history, prompts = list(system), []
        for turn in range(turns):
            history += [10_000 + 100 * number + 10 * turn + i for i in range(2 * BLOCK)]
            prompts.append(list(history))
        return prompts

    for slack, agree in ((2.0, True), (0.0, False)):
        routing = PrefixRouting(block_size=BLOCK, rendezvous_slack=slack)
        servers = [PrefixRouter(4, routing), PrefixRouter(4, routing, start=2)]
        for server in servers:  # both have seen the system prompt on every rank
            for rank in range(4):
                server.observe(rank, system, 0.0)
        split = 0
        for number in range(8):
            ranks = [
                servers[turn % 2].choose(prompt, [0.0] * 4, 0.0).engine_index
                for turn, prompt in enumerate(conversation(number, 4))
            ]
            split += len(set(ranks)) > 1
        assert (split == 0) == agree


def test_with_rendezvous_home_front_ends_agree_after_one_moved_a_conversation() -> None:
    """``rendezvous_home``: every choice within the slack is the home that rendezvous
    hashing of the block past the last branch point (here the end of the shared system
    prompt) ranks first. A server that moved a conversation off its busy home takes it
    back there once the loads allow, where the other server, blind to the move, sends it
    too; without it the mover follows the deeper copy it made, and the two split."""
    system = list(range(8 * BLOCK))

    def turns(number: int) -> list[list[int]]:
        history, prompts = list(system), []
        for turn in range(4):
            history += [10_000 + 100 * number + 10 * turn + i for i in range(2 * BLOCK)]
            prompts.append(list(history))
        return prompts

    for home, agree in ((True, True), (False, False)):
        routing = PrefixRouting(block_size=BLOCK, rendezvous_slack=1.0, rendezvous_home=home)
        mover, other = PrefixRouter(4, routing), PrefixRouter(4, routing, start=2)
        for server in (mover, other):  # both saw other conversations after the system prompt
            for number in range(4):
                server.observe(number, turns(100 + number)[0], 0.0)
        prompts = turns(7)
        first = mover.choose(prompts[0], [0.0] * 4, 0.0).engine_index
        busy = [0.0] * 4
        busy[first] = 10_000.0  # far beyond the slack: the second turn moves
        moved = mover.choose(prompts[1], busy, 0.0).engine_index
        assert moved != first
        later = [
            other.choose(prompts[2], [0.0] * 4, 0.0).engine_index,
            mover.choose(prompts[3], [0.0] * 4, 0.0).engine_index,
        ]
        assert (later == [first, first]) == agree
        if home:
            assert other.choose(prompts[0], [0.0] * 4, 0.0).engine_index == first  # the same home


def test_pinned_and_out_of_range_ranks() -> None:
    router = PrefixRouter(3, PrefixRouting(block_size=BLOCK))
    with pytest.raises(ValueError, match="out of range"):
        router.observe(-1, [1] * 8, 0.0)
    with pytest.raises(ValueError, match="expected 3"):
        router.choose([1] * 8, [0, 0], 0.0)
    assert router.counters.decisions == 0


def test_resize_forgets_the_ranks_beyond() -> None:
    router = PrefixRouter(3, PrefixRouting(block_size=BLOCK))
    tokens = family_prompt(0, 0, 3)
    router.observe(2, tokens, 0.0)
    router.resize(2)
    assert router.stored_blocks == 0
    router.resize(4)
    assert router.choose(tokens, [5, 5, 5, 0], 0.0).engine_index == 3


@given(seqs=st.lists(st.integers(0, 8), max_size=8))
def test_a_lost_or_reordered_batch_forgets_exact_knowledge(seqs: list[int]) -> None:
    router = PrefixRouter(2, PrefixRouting(feed="exact", block_size=BLOCK))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    stored = stored_event([101, 102], None, tokens, BLOCK)
    assert router.receive_kv_events(0, 0, batch(stored), now=0.0)
    assert router.receive_kv_events(1, 0, batch(stored), now=0.0)
    in_order = True
    for position, seq in enumerate(seqs, start=1):
        in_order = in_order and seq == position
        assert router.receive_kv_events(0, seq, batch(), now=0.0)
        assert router.cached_tokens(0, tokens, 0.0) == (8 if in_order else 0)
    assert router.cached_tokens(1, tokens, 0.0) == 8  # the other rank keeps its knowledge
    assert router.counters.event_gaps == sum(
        1 for i, seq in enumerate(seqs) if seq != ([0, *seqs][i] + 1)
    )


def test_exact_feed_chains_a_child_block_on_its_parent_at_its_depth() -> None:
    router = PrefixRouter(1, PrefixRouting(feed="exact", block_size=BLOCK))
    tokens = list(range(16))
    first = stored_event([1, 2], None, tokens[:8], BLOCK)
    child = stored_event([3, 4], 2, tokens[8:], BLOCK)
    orphan = stored_event([9], 77, [9, 9, 9, 9], BLOCK)  # parent never seen: ignored
    assert router.receive_kv_events(0, 0, batch(first, child, orphan), now=0.0)
    assert router.cached_tokens(0, tokens, 0.0) == 16
    assert block_keys(tokens, BLOCK)[2:] == block_keys(tokens[8:], BLOCK, *_parent(tokens))
    assert len(router.indexes[0]) == 4


def _parent(tokens: list[int]) -> tuple[int, int]:
    return block_keys(tokens[:8], BLOCK)[-1], 2


class RouterMachine(RuleBasedStateMachine):
    """The router's memory stays bounded and its block -> ranks map true, whatever
    prompts, loads, pins, KV events (in order or not) and clock readings come."""

    RANKS = 3
    CAPACITY = 6

    def __init__(self) -> None:
        super().__init__()
        routing = PrefixRouting(block_size=BLOCK, capacity_blocks=self.CAPACITY, max_age=5.0)
        self.router = PrefixRouter(self.RANKS, routing)
        self.now = 0.0
        self.seq = [0] * self.RANKS

    @rule(
        prompt=prompts,
        loads=st.lists(st.integers(0, 30).map(float), min_size=3, max_size=3),
        pin=st.none() | st.integers(0, 2),
    )
    def route(self, prompt: tuple[int, int, int], loads: list[float], pin: int | None) -> None:
        if pin is None:
            decision = self.router.choose(family_prompt(*prompt), loads, self.now)
        else:
            decision = self.router.observe(pin, family_prompt(*prompt), self.now)
        rank = decision.engine_index
        assert 0 <= rank < self.RANKS and (pin is None or rank == pin)

    @rule(
        rank=st.integers(0, 2),
        skip=st.integers(-1, 2),
        hashes=st.lists(st.integers(0, 20), min_size=1, max_size=3),
        removed=st.lists(st.integers(0, 20), max_size=3),
        clear=st.booleans(),
    )
    def events(
        self, rank: int, skip: int, hashes: list[int], removed: list[int], clear: bool
    ) -> None:
        self.seq[rank] += 1 + skip
        tokens = [h for h in hashes for _ in range(BLOCK)]
        found: list[object] = [stored_event(hashes, None, tokens, BLOCK)]
        found.append({"type": "BlockRemoved", "block_hashes": removed, "medium": None})
        if clear:
            found.append({"type": "AllBlocksCleared"})
        assert self.router.receive_kv_events(rank, self.seq[rank], batch(*found), self.now)

    @rule(step=st.floats(0, 3))
    def tick(self, step: float) -> None:
        self.now += step

    @rule(prompt=prompts)
    def walk(self, prompt: tuple[int, int, int]) -> None:
        """The walk is every rank's own prefix count, bisecting (own decisions only) or
        block by block (once KV events came)."""
        keys = block_keys(family_prompt(*prompt), BLOCK)
        held: dict[int, int] = {}
        for rank, index in enumerate(self.router.indexes):
            depth = next((i for i, key in enumerate(keys) if key not in index), len(keys))
            if depth:
                held[depth] = held.get(depth, 0) | 1 << rank
        assert self.router.prefix_groups(keys) == sorted(held.items())

    @invariant()
    def bounded_and_consistent(self) -> None:
        router = self.router
        assert all(len(index) <= self.CAPACITY for index in router.indexes)
        assert router.stored_blocks <= self.RANKS * self.CAPACITY
        owners = router.block_owners()
        for key, mask in owners.items():
            holders = {r for r, index in enumerate(router.indexes) if key in index}
            assert mask and holders == {r for r in range(self.RANKS) if mask >> r & 1}
        for index in router.indexes:
            assert all(key in owners for key in index.blocks())


TestRouterMachine = RouterMachine.TestCase


class ExactRouterMachine(RouterMachine):
    """The same with the exact feed's provisional beliefs: they count against the
    capacity, the reported blocks they push out are kept aside unbelieved (never more
    than the beliefs), and nothing is both."""

    def __init__(self) -> None:
        super().__init__()
        routing = PrefixRouting(
            block_size=BLOCK, capacity_blocks=self.CAPACITY, max_age=5.0, feed="exact"
        )
        self.router = PrefixRouter(self.RANKS, routing)

    @invariant()
    def beliefs_and_displaced_blocks_apart(self) -> None:
        owners = self.router.block_owners()
        for rank, index in enumerate(self.router.indexes):
            seen, provisional = index.blocks(), index.provisional_blocks()
            displaced = index.displaced_blocks()
            assert set(provisional) <= set(seen)
            assert len(displaced) <= len(provisional)
            assert not set(displaced) & set(seen)
            assert all(not owners.get(key, 0) >> rank & 1 for key in displaced)


TestExactRouterMachine = ExactRouterMachine.TestCase


def test_exact_feed_beliefs_push_out_reported_blocks_until_the_events_tell_which_went() -> None:
    """A rank full of reported blocks takes a routed prompt: the prompt is believed and
    the least recently used reported blocks are no longer (the engine must evict to
    cache it). The events then tell: what the engine evicted is forgotten; and if the
    belief ends unconfirmed (the engine never cached the prompt), what it pushed out is
    believed again."""
    old = list(range(100, 116))  # 4 blocks: the rank is full
    new = list(range(200, 208))  # 2 blocks, routed to rank 0 (pinned)

    def full_rank_takes_the_new_prompt() -> PrefixRouter:
        routing = PrefixRouting(feed="exact", block_size=4, capacity_blocks=4, provisional_age=5)
        router = PrefixRouter(2, routing)
        stored = batch(stored_event([1, 2, 3, 4], None, old, 4))
        assert router.receive_kv_events(0, 0, stored, 0.0)
        assert router.cached_tokens(0, old, 0.0) == 16
        router.observe(0, new, 1.0)
        assert router.cached_tokens(0, new, 1.0) == 8
        assert len(router.indexes[0]) == 4  # never more than the capacity
        assert router.cached_tokens(0, old, 1.0) == 8  # its last 2 blocks pushed out
        return router

    router = full_rank_takes_the_new_prompt()
    events = [
        {"type": "BlockRemoved", "block_hashes": [3, 4], "medium": None},
        stored_event([5, 6], None, new, 4),
    ]
    assert router.receive_kv_events(0, 1, batch(*events), 2.0)
    assert router.cached_tokens(0, new, 2.0) == 8
    assert router.cached_tokens(0, old, 2.0) == 8
    assert len(router.indexes[0].displaced_blocks()) == 0  # nothing left aside

    router = full_rank_takes_the_new_prompt()
    router.observe(1, [7] * 4, 7.0)  # a later decision: the belief is due
    assert router.cached_tokens(0, new, 7.0) == 0
    assert router.cached_tokens(0, old, 7.0) == 16  # pushed out, never evicted: back


# --- the wired chooser -------------------------------------------------------------------


def idle(ranks: int) -> tuple[EngineLoad, ...]:
    return (EngineLoad(0, 0, 0.0),) * ranks


def test_vllm_routing_ignores_prompts_and_stays_the_default() -> None:
    plain, given_tokens = EngineChooser(3), EngineChooser(3, routing="vllm")
    assert plain.routing == "vllm" and plain.router is None
    tables = [idle(3), (EngineLoad(2, 1, 0.9), EngineLoad(0, 0, 0.0), EngineLoad(1, 0, 0.0))]
    for table in tables:
        for n in range(4):
            assert plain.choose(table) == given_tokens.choose(table, [n] * 64, now=1.0)
    given_tokens.observe(0, [1] * 64)  # no-op
    assert plain.statistics().inflight == given_tokens.statistics().inflight
    assert given_tokens.statistics().router is None
    assert not given_tokens.receive_kv_events(0, 0, batch())
    with pytest.raises(ValueError, match="routing must be one of"):
        EngineChooser(2, routing="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix_routing settings need"):
        EngineChooser(2, prefix_routing=PrefixRouting())


class VllmChoice:
    """vLLM 0.33.0's ``get_core_engine_for_request`` written out from :func:`vllm_score`:
    the engines in rotated order from a start that advances one a choice (the client's
    first at ``n x client_index // client_count``), the first strictly lowest score, the
    chosen one then counting ``client_count`` more waiting until a new table replaces
    the local one, and one more of this client's requests in flight until it finishes."""

    def __init__(self, engines: int, client_index: int, client_count: int) -> None:
        self.clients = client_count
        self.start = engines * client_index // client_count
        self.table: tuple[EngineLoad, ...] = ()
        self.local: list[list[float]] = [[0, 0, 0.0] for _ in range(engines)]
        self.inflight = [0] * engines

    def choose(self, loads: tuple[EngineLoad, ...]) -> int:
        if loads != self.table:
            self.table = loads
            self.local = [[load.waiting, load.running, load.kv_cache_usage] for load in loads]
        engines = len(self.local)
        best, best_score = -1, float("inf")
        for offset in range(engines):
            index = (self.start + offset) % engines
            waiting, running, usage = self.local[index]
            score = vllm_score(waiting, running, usage, self.inflight[index], self.clients)
            if score < best_score:
                best, best_score = index, score
        self.local[best][0] += self.clients
        self.start = (self.start + 1) % engines
        self.inflight[best] += 1
        return best


@given(
    engines=st.integers(1, 6),
    clients=st.integers(1, 3).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))),
    feed=st.sampled_from(["approximate", "exact"]),
    steps=st.lists(
        st.one_of(
            st.tuples(
                st.just("report"),
                st.lists(
                    st.tuples(st.integers(0, 6), st.integers(0, 6), st.sampled_from([0, 0.4, 0.9])),
                    min_size=6,
                    max_size=6,
                ),
            ),
            st.tuples(st.just("choose"), st.integers(-1, 40)),
            st.tuples(st.just("finish"), st.integers(0, 5)),
        ),
        max_size=40,
    ),
)
def test_with_nothing_cached_the_prefix_chooser_makes_vllms_choice(
    engines: int, clients: tuple[int, int], feed: str, steps: list[tuple[str, Any]]
) -> None:
    """No prompt shares a block with any other (each starts with its own token), so
    nothing is cached anywhere: whatever the loads, the prompts' lengths (none, shorter
    than a block, long) and the requests finished, the prefix policy takes the engine
    vLLM's score takes, as vLLM keeps it and as ``routing="vllm"`` does."""
    count, index = clients
    routing = PrefixRouting(block_size=BLOCK, feed=feed)  # type: ignore[arg-type]
    prefix = EngineChooser(
        engines, client_index=index, client_count=count, routing="prefix", prefix_routing=routing
    )
    plain = EngineChooser(engines, client_index=index, client_count=count)
    reference = VllmChoice(engines, index, count)
    loads = idle(engines)
    unfinished: list[int] = []
    rng = random.Random(engines * 7 + count)
    for number, (kind, value) in enumerate(steps):
        if kind == "report":
            loads = tuple(EngineLoad(w, r, u) for w, r, u in value[:engines])
        elif kind == "choose":
            prompt = None
            if value >= 0:
                prompt = [100_000 + number, *(rng.randrange(50) for _ in range(value))]
            expected = reference.choose(loads)
            assert prefix.choose(loads, prompt, now=float(number)) == expected
            assert plain.choose(loads) == expected
            unfinished.append(expected)
        elif unfinished:
            engine = unfinished.pop(value % len(unfinished))
            reference.inflight[engine] -= 1
            prefix.finished(engine)
            plain.finished(engine)
    statistics = prefix.statistics()
    assert statistics.inflight == tuple(reference.inflight)
    assert statistics.router is not None and statistics.router.cached_tokens == 0


def test_the_unshared_choice_is_taken_only_where_nothing_is_cached() -> None:
    router = PrefixRouter(3, PrefixRouting(block_size=BLOCK))
    held = family_prompt(0, 0, 4)
    assert router.observe(2, held, 0.0).engine_index == 2
    # Nothing of this prompt anywhere: the caller's choice, though rank 0 is idle.
    assert (
        router.choose(
            family_prompt(1, 0, 4), [0.0, 50.0, 50.0], 0.0, unshared_choice=1
        ).engine_index
        == 1
    )
    # A prefix on rank 2: the cost rule, whatever the caller's choice.
    decision = router.choose([*held, 1, 2, 3, 4], [0.0, 0.0, 0.0], 0.0, unshared_choice=0)
    assert decision.engine_index == 2 and decision.cached_tokens == len(held)


def test_the_wired_chooser_learns_its_own_choices_and_pinned_requests() -> None:
    chooser = EngineChooser(4, routing="prefix", prefix_routing=PrefixRouting(block_size=BLOCK))
    history = family_prompt(2, 1, 10)  # 40 tokens
    first = chooser.choose(idle(4), history, now=0.0)
    # The next report: the first request waits on its rank.
    loads = [EngineLoad(0, 0, 0.0)] * 4
    loads[first] = EngineLoad(1, 0, 0.0)
    turn = [*history, *range(8)]
    assert chooser.choose(loads, turn, now=1.0) == first  # same prefix, loads allow
    # A different conversation goes where nothing waits.
    other = chooser.choose(loads, family_prompt(0, 0, 10), now=1.0)
    assert other != first
    # A pinned request is learnt on its rank: its next turn follows it there.
    pinned = next(r for r in range(4) if r not in (first, other))
    session = family_prompt(1, 2, 10)
    assert chooser.observe(pinned, session, now=1.0)  # counted in flight there
    assert chooser.choose(loads, [*session, *range(4)], now=2.0) == pinned
    # Without token ids: nothing cached anywhere, vLLM's choice (the least loaded rank).
    assert chooser.choose(loads, now=2.0) not in (first, other, pinned)
    counters = chooser.statistics().router
    assert counters is not None and counters.decisions == 6
    assert 0 < counters.cached_tokens < counters.prompt_tokens
    assert chooser.statistics().inflight[first] == 2
    assert sum(chooser.statistics().inflight) == 6  # 5 chosen, 1 pinned


def test_statistics_is_a_frozen_copy_that_later_choices_leave_alone() -> None:
    chooser = EngineChooser(2, routing="prefix", prefix_routing=PrefixRouting(block_size=BLOCK))
    assert chooser.engine_count == 2 and chooser.routing == "prefix"
    rank = chooser.choose(idle(2), family_prompt(0, 0, 4), now=0.0)
    before = chooser.statistics()
    chooser.choose(idle(2), family_prompt(1, 0, 4), now=1.0)
    chooser.finished(rank)
    assert before.inflight[rank] == 1 and sum(before.inflight) == 1
    assert before.router is not None and before.router.decisions == 1
    after = chooser.statistics()
    assert after.router is not None and after.router.decisions == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.inflight = ()  # type: ignore[misc]


def test_only_a_counted_pinned_request_is_released_by_finished() -> None:
    """vLLM's routing does not count a pinned request (as vLLM): ``observe`` says so, and
    the caller must not call ``finished`` for it, or a chosen request's count on that
    rank would be released while it still runs. The prefix policy counts it."""
    vllm = EngineChooser(2)
    chosen = vllm.choose(idle(2))
    assert vllm.observe(chosen, [1, 2, 3]) is False
    assert vllm.statistics().inflight[chosen] == 1
    prefix = EngineChooser(2, routing="prefix", prefix_routing=PrefixRouting(block_size=BLOCK))
    chosen = prefix.choose(idle(2), family_prompt(0, 0, 4), now=0.0)
    assert prefix.observe(chosen, family_prompt(1, 0, 4), now=0.0) is True
    assert prefix.statistics().inflight[chosen] == 2
    prefix.finished(chosen)
    prefix.finished(chosen)
    assert prefix.statistics().inflight[chosen] == 0


def test_the_wired_chooser_counts_its_own_work_until_the_next_report() -> None:
    chooser = EngineChooser(2, routing="prefix", prefix_routing=PrefixRouting(block_size=BLOCK))
    # No report ever arrives: the work this chooser sent spreads the next requests.
    ranks = [chooser.choose(idle(2), family_prompt(n, 0, 8), now=0.0) for n in range(4)]
    assert sorted(ranks) == [0, 0, 1, 1]
    for rank in ranks:
        chooser.finished(rank)
    assert chooser.statistics().inflight == (0, 0)
    # Finished, they weigh nothing: a repeat of the first goes back to its rank.
    assert chooser.choose(idle(2), family_prompt(0, 0, 8), now=0.0) == ranks[0]


def test_the_wired_chooser_feeds_exact_events_and_follows_a_resize() -> None:
    routing = PrefixRouting(block_size=BLOCK, feed="exact")
    chooser = EngineChooser(2, routing="prefix", prefix_routing=routing)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    assert chooser.receive_kv_events(1, 0, batch(stored_event([1, 2], None, tokens, BLOCK)))
    assert not chooser.receive_kv_events(1, 1, b"\xc1")
    assert chooser.choose(idle(2), tokens, now=0.0) == 1
    assert chooser.choose(idle(3), tokens, now=0.0) == 1  # a third rank joined
    assert chooser.router is not None and chooser.router.engine_count == 3
