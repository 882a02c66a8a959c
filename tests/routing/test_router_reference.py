"""The decision's fast paths against plain reference implementations of the same rules.

The prefix index keeps its recency order in a plain dict and stores and evicts with
C-level bulk calls; the walk bisects the prompt while the indexes are prefix-closed, and
otherwise counts a lone rank's run in its own index; a prompt's keys come from a cache
of its leading chunks; vLLM's score is kept per engine instead of recomputed per choice.
Each is checked here, on random operation sequences, against the straightforward
one-item-at-a-time reading of its rule (an ``OrderedDict`` LRU, a per-rank prefix count,
:func:`block_keys` itself, vLLM's rotated scan): same state, same answers, so the
optimisations change no routing decision.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from trio_dpcoord import EngineChooser, EngineLoad, PrefixRouting
from trio_dpcoord.routing import (
    CHUNK_BLOCKS,
    ChunkKeys,
    PrefixRouter,
    RankPrefixIndex,
    block_keys,
    vllm_score,
)

# --- white-box: the prefix policy's inside (private attributes, on purpose) -----------


def prefix_walks(
    router: PrefixRouter, keys: Sequence[int]
) -> tuple[list[tuple[int, int]] | None, list[tuple[int, int]]]:
    """The two ways ``router`` finds which ranks hold how much of ``keys``: its bisecting
    walk (None unless the indexes are prefix-closed, the approximate feed's case, when
    it is the one used) and the block-by-block walk. They must agree; read-only."""
    bisected = router._bisect(keys) if router._closed else None
    return bisected, router._walk_blocks(keys)


def prefix_walk_of_prompt(
    router: PrefixRouter, token_ids: Sequence[int]
) -> tuple[list[tuple[int, int]], int]:
    """The walk :meth:`PrefixRouter.route` makes for ``token_ids`` (with prefix-closed
    indexes, over the keys its chunk cache knows and the rest on demand), and how many
    of the prompt's blocks it keyed; read-only (a copy of the router's chunk cache)."""
    cache = copy.copy(router._keys)
    cache._chunks = dict(router._keys._chunks)
    keys = cache.lookup(token_ids) if router._closed else cache(token_ids)
    groups = router._walk(keys if router._closed else list(keys))
    return groups, keys.known


def use_chain_mode(index: RankPrefixIndex) -> None:
    """Switch ``index`` to the layout the approximate feed keeps it in (its LRU order in
    pieces of a chain): for tests that drive an index alone. Before its first store."""
    index._chain_mode()


def store_as_the_router(index: RankPrefixIndex, keys: Sequence[int], held: int, now: float) -> bool:
    """Store a prompt's ``keys`` as the router does after its walk found ``held`` of them
    cached (chain mode only; False, storing nothing, in the plain layout)."""
    if index._held is None:
        return False
    index._store_chain(keys, held, now)
    return True


# --- the index: an OrderedDict LRU, one key at a time ------------------------------------


class ReferenceIndex:
    """One rank's index as the rule reads: every stored key moves to the most recent end
    (deepest first), the least recent go first beyond ``capacity``, and a rank's bit is
    in ``owners`` exactly while the key is held; with the exact feed's beliefs, the
    reported blocks they push out wait aside and come back first in line."""

    def __init__(self, capacity: int, max_age: float, bit: int, owners: dict[int, int]) -> None:
        self.capacity, self.max_age, self.bit, self.owners = capacity, max_age, bit, owners
        self.seen: OrderedDict[int, float] = OrderedDict()
        self.provisional: dict[int, float] = {}
        self.displaced: OrderedDict[int, float] = OrderedDict()

    def _disown(self, key: int) -> None:
        mask = self.owners.get(key, 0) & ~self.bit
        if mask:
            self.owners[key] = mask
        else:
            self.owners.pop(key, None)

    def store(self, keys: Sequence[int], now: float) -> None:
        for key in keys:
            self.displaced.pop(key, None)
        for key in reversed(keys):
            if self.seen.pop(key, None) is None:
                self.owners[key] = self.owners.get(key, 0) | self.bit
            self.seen[key] = now
        if len(self.seen) <= self.capacity:
            return
        while len(self.seen) > self.capacity:
            key, last = self.seen.popitem(last=False)
            self._disown(key)
            if self.provisional.pop(key, None) is None and self.provisional:
                self.displaced[key] = last
        while len(self.displaced) > len(self.provisional):
            self.displaced.popitem(last=False)

    def remove(self, keys: Iterable[int]) -> None:
        for key in keys:
            if self.seen.pop(key, None) is not None:
                self.provisional.pop(key, None)
                self._disown(key)
            else:
                self.displaced.pop(key, None)
        while len(self.seen) < self.capacity and self.displaced:
            key, last = self.displaced.popitem()
            self.seen[key] = last
            self.seen.move_to_end(key, last=False)
            self.owners[key] = self.owners.get(key, 0) | self.bit

    def clear(self) -> None:
        for key in self.seen:
            self._disown(key)
        self.seen.clear()
        self.provisional.clear()
        self.displaced.clear()

    def store_provisionally(self, keys: Sequence[int], now: float, until: float) -> None:
        self.expire_provisional(now)
        for key in keys:
            if key in self.displaced:
                continue
            if key not in self.seen or key in self.provisional:
                self.provisional.pop(key, None)
                self.provisional[key] = until
        self.store(keys, now)

    def confirm(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.provisional.pop(key, None)

    def expire_provisional(self, now: float) -> None:
        due = []
        for key, until in self.provisional.items():
            if until > now:
                break
            due.append(key)
        for key in due:
            del self.provisional[key]
        self.remove(due)

    def expire(self, now: float) -> None:
        while self.displaced and now - next(iter(self.displaced.values())) > self.max_age:
            self.displaced.popitem(last=False)
        while self.seen:
            key, last = next(iter(self.seen.items()))
            if now - last <= self.max_age:
                break
            del self.seen[key]
            self.provisional.pop(key, None)
            self._disown(key)

    def matched_blocks(self, keys: Sequence[int], now: float) -> int:
        self.expire(now)
        matched = 0
        for key in keys:
            if key not in self.seen:
                break
            matched += 1
        return matched


RANKS = 3
keys_st = st.lists(st.integers(0, 23), max_size=10)
"""Keys from a small alphabet: prompts that share, extend, repeat and interleave."""


class IndexAgainstReference(RuleBasedStateMachine):
    """Three ranks' indexes sharing one owners map, beside their references."""

    def __init__(self) -> None:
        super().__init__()
        self.owners: dict[int, int] = {}
        self.ref_owners: dict[int, int] = {}
        self.indexes = [
            RankPrefixIndex(6, 5.0, bit=1 << r, owners=self.owners) for r in range(RANKS)
        ]
        self.refs = [ReferenceIndex(6, 5.0, 1 << r, self.ref_owners) for r in range(RANKS)]
        self.now = 0.0

    @rule(rank=st.integers(0, RANKS - 1), keys=keys_st)
    def store(self, rank: int, keys: list[int]) -> None:
        self.indexes[rank].store(keys, self.now)
        self.refs[rank].store(keys, self.now)

    @rule(rank=st.integers(0, RANKS - 1), keys=keys_st, age=st.floats(0, 8))
    def store_provisionally(self, rank: int, keys: list[int], age: float) -> None:
        self.indexes[rank].store_provisionally(keys, self.now, self.now + age)
        self.refs[rank].store_provisionally(keys, self.now, self.now + age)

    @rule(rank=st.integers(0, RANKS - 1), keys=keys_st)
    def confirm(self, rank: int, keys: list[int]) -> None:
        self.indexes[rank].confirm(keys)
        self.refs[rank].confirm(keys)

    @rule(rank=st.integers(0, RANKS - 1), keys=keys_st)
    def remove(self, rank: int, keys: list[int]) -> None:
        self.indexes[rank].remove(iter(keys))
        self.refs[rank].remove(iter(keys))

    @rule(rank=st.integers(0, RANKS - 1))
    def clear(self, rank: int) -> None:
        self.indexes[rank].clear()
        self.refs[rank].clear()

    @rule(rank=st.integers(0, RANKS - 1), keys=keys_st, step=st.floats(0, 3))
    def match(self, rank: int, keys: list[int], step: float) -> None:
        self.now += step
        ours = self.indexes[rank].matched_blocks(keys, self.now)
        assert ours == self.refs[rank].matched_blocks(keys, self.now)
        self.indexes[rank].expire_provisional(self.now)
        self.refs[rank].expire_provisional(self.now)

    @invariant()
    def same_state(self) -> None:
        assert self.owners == self.ref_owners
        for index, ref in zip(self.indexes, self.refs, strict=True):
            # the recency order included
            assert list(index.blocks().items()) == list(ref.seen.items())
            assert list(index.provisional_blocks().items()) == list(ref.provisional.items())
            assert list(index.displaced_blocks().items()) == list(ref.displaced.items())


TestIndexAgainstReference = IndexAgainstReference.TestCase


CHAINS = [[(base * 5 + i * (base + 2)) % 4 for i in range(2 * 64 + 9)] for base in (0, 1, 2)]
"""Token streams (block size 1): a prompt is a stream's prefix and a tail of its own, so
prompts share whole pieces (of 64 blocks), parts of pieces, or nothing."""
chain_st = st.builds(
    lambda base, cut, tail: block_keys(CHAINS[base][:cut] + tail, 1),
    st.integers(0, 2),
    st.integers(0, len(CHAINS[0])),
    st.lists(st.integers(0, 3), max_size=20),
)


class ChainIndexAgainstReference(RuleBasedStateMachine):
    """Indexes in chain mode (the order kept in pieces) beside the plain reference, fed
    prompts' chains: the same keys, order, times and owners; and the same after an
    index leaves chain mode (:meth:`RankPrefixIndex._materialize`) and goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.owners: dict[int, int] = {}
        self.ref_owners: dict[int, int] = {}
        self.indexes = [
            RankPrefixIndex(150, 5.0, bit=1 << r, owners=self.owners) for r in range(RANKS)
        ]
        for index in self.indexes:
            use_chain_mode(index)
        self.refs = [ReferenceIndex(150, 5.0, 1 << r, self.ref_owners) for r in range(RANKS)]
        self.now = 0.0

    @rule(rank=st.integers(0, RANKS - 1), keys=chain_st, step=st.floats(0, 2), public=st.booleans())
    def store(self, rank: int, keys: list[int], step: float, public: bool) -> None:
        self.now += step
        index = self.indexes[rank]
        held = index.matched_blocks(keys, self.now)  # expires, as the router's sweep
        # as the router stores what its walk found, or as the vLLM plugin stores a pinned
        # request's prompt
        if public or not store_as_the_router(index, keys, held, self.now):
            index.store(keys, self.now)
        self.refs[rank].expire(self.now)
        self.refs[rank].store(keys, self.now)

    @rule(rank=st.integers(0, RANKS - 1), keys=chain_st, step=st.floats(0, 3))
    def match(self, rank: int, keys: list[int], step: float) -> None:
        self.now += step
        ours = self.indexes[rank].matched_blocks(keys, self.now)
        assert ours == self.refs[rank].matched_blocks(keys, self.now)

    @rule(rank=st.integers(0, RANKS - 1))
    def clear(self, rank: int) -> None:
        self.indexes[rank].clear()
        self.refs[rank].clear()

    @rule(rank=st.integers(0, RANKS - 1), keys=chain_st)
    def leave_chain_mode(self, rank: int, keys: list[int]) -> None:
        gone = keys[-1:] or [0]
        self.indexes[rank].remove(gone)  # not a chain: the plain order from here
        self.refs[rank].remove(gone)
        assert self.indexes[rank]._held is None

    @invariant()
    def same_state(self) -> None:
        assert self.owners == self.ref_owners
        for index, ref in zip(self.indexes, self.refs, strict=True):
            in_order = list(index.blocks().items())
            assert in_order == list(ref.seen.items())
            assert len(index) == len(ref.seen)


TestChainIndexAgainstReference = ChainIndexAgainstReference.TestCase
TestChainIndexAgainstReference.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)


# --- the walk: every rank's matched prefix, grouped by depth -----------------------------


def reference_walk(router: PrefixRouter, keys: Sequence[int]) -> list[tuple[int, int]]:
    """(depth, mask of the ranks matching exactly that many leading keys), depth > 0,
    ascending: each rank's own prefix count, one rank at a time."""
    masks: dict[int, int] = {}
    for rank, index in enumerate(router.indexes):
        depth = 0
        for key in keys:
            if key not in index:
                break
            depth += 1
        if depth:
            masks[depth] = masks.get(depth, 0) | 1 << rank
    return sorted(masks.items())


BLOCK = 2
families = st.lists(st.integers(0, 3), min_size=1, max_size=8)


@settings(max_examples=200)
@given(
    ranks=st.integers(1, 12),
    learnt=st.lists(st.tuples(families, st.integers(0, 11)), max_size=16),
    prompt=families,
    capacity=st.integers(1, 8),
)
def test_the_walk_is_every_ranks_prefix(
    ranks: int, learnt: list[tuple[list[int], int]], prompt: list[int], capacity: int
) -> None:
    routing = PrefixRouting(block_size=BLOCK, capacity_blocks=capacity, imbalance_abs=1e12)
    router = PrefixRouter(ranks, routing)
    for tokens, rank in learnt:
        router.observe(rank % ranks, [t for t in tokens for _ in range(BLOCK)], 0.0)
    keys = block_keys([t for t in prompt for _ in range(BLOCK)], BLOCK)
    assert router.prefix_groups(keys) == reference_walk(router, keys)


BASES = [
    [(base * 7 + i * (base + 1)) % 5 for i in range(3 * CHUNK_BLOCKS + 9)] for base in (0, 1, 2)
]
"""Three token streams: prompts are a stream's prefix and a tail of their own, so they
share leading chunks, blocks and partial blocks in every way."""
long_prompts = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, 2),
    st.integers(0, len(BASES[0])),
    st.lists(st.integers(0, 4), max_size=2 * CHUNK_BLOCKS),
)


@settings(max_examples=150, deadline=None)
@given(
    ranks=st.integers(1, 9),
    block=st.sampled_from([1, 2, 3]),
    capacity=st.integers(1, 3 * CHUNK_BLOCKS),
    steps=st.lists(
        st.tuples(long_prompts, st.none() | st.integers(0, 8), st.floats(0, 1.0)), max_size=20
    ),
    probes=st.lists(long_prompts, min_size=1, max_size=3),
)
def test_the_bisecting_walk_is_the_block_walk(
    ranks: int,
    block: int,
    capacity: int,
    steps: list[tuple[list[int], int | None, float]],
    probes: list[list[int]],
) -> None:
    """With the approximate feed the indexes stay prefix-closed, whatever prompts, pins,
    capacities (evictions) and clock readings (expiry) come, so the walk bisects; it
    finds what the block-by-block walk and every rank's own prefix count find."""
    routing = PrefixRouting(block_size=block, capacity_blocks=capacity, max_age=2.0)
    router = PrefixRouter(ranks, routing)
    now = 0.0
    for tokens, pin, step in steps:
        now += step
        queued = [float((len(tokens) * (rank + 3)) % 11) * 50 for rank in range(ranks)]
        if pin is None:
            router.choose(tokens, queued, now)
        else:
            router.observe(pin % ranks, tokens, now)
        for probe in probes:
            keys = block_keys(probe, block)
            bisected, walk = prefix_walks(router, keys)
            assert bisected is not None  # the approximate feed keeps the indexes closed
            assert bisected == walk == reference_walk(router, keys)
            # the walk a decision makes: the keys its chunk cache knows, the rest on demand
            lazy, keyed = prefix_walk_of_prompt(router, probe)
            assert lazy == walk
            assert keyed <= len(keys)


def test_the_walk_keys_a_prompt_only_as_far_as_ranks_hold_it() -> None:
    """A decision keys the chunks its cache knows, then a chunk more while some rank
    holds the block past them: here a document learnt whole on rank 1 (the cache knows
    its first chunk only), read again up to various cuts; the walk is every rank's own
    prefix count and stops keying at the chunk where rank 1 stops holding."""
    router = PrefixRouter(3, PrefixRouting(block_size=1, capacity_blocks=1000))
    document = list(range(5 * CHUNK_BLOCKS + 3))
    router.observe(1, document, 0.0)
    for cut in (0, 1, CHUNK_BLOCKS - 1, CHUNK_BLOCKS, 2 * CHUNK_BLOCKS + 5, len(document)):
        prompt = document[:cut] + [10**6] * 40
        groups, keyed = prefix_walk_of_prompt(router, prompt)
        assert groups == reference_walk(router, block_keys(prompt, 1))
        assert groups == ([(cut, 0b10)] if cut else [])
        # (no rank holds the first block of a prompt of no known chunk: none keyed but it)
        chunks_to_cut = -(-cut // CHUNK_BLOCKS)  # the chunks holding the cut's blocks
        assert keyed == (min(len(prompt), max(1, chunks_to_cut) * CHUNK_BLOCKS) if cut else 0)


@settings(max_examples=150, deadline=None)
@given(
    block=st.sampled_from([1, 2, 3]),
    max_chunks=st.integers(1, 8),
    prompts=st.lists(long_prompts, max_size=30),
)
def test_the_chunk_cache_gives_the_block_keys(
    block: int, max_chunks: int, prompts: list[list[int]]
) -> None:
    """Remembered chunks, new ones, partial last chunks and blocks, evictions from the
    cache: the keys are :func:`block_keys`' every time, and the cache stays bounded."""
    keys = ChunkKeys(block, max_chunks)
    lazy = ChunkKeys(block, max_chunks)  # the same prompts, as a decision keys them
    for number, tokens in enumerate(prompts):
        got, want = keys(tokens), block_keys(tokens, block)
        assert list(got) == want == [got[i] for i in range(len(got))]
        assert all(len(chunk) <= CHUNK_BLOCKS for chunk in got.chunks)
        cuts = {0, 1, CHUNK_BLOCKS - 1, CHUNK_BLOCKS, len(want) - 1, len(want), len(want) + 1}
        for start in cuts:
            for stop in (*cuts, None):
                assert got[start:stop] == want[start:stop]
        assert len(keys) <= max_chunks
        # Looked up: the known chunks' keys, the next block's alone, then the rest; the
        # cache learns what the eager one learns (the next lookups find the same).
        partial = lazy.lookup(tokens)
        assert len(partial) == len(want)
        assert partial.known % CHUNK_BLOCKS == 0 or partial.known == len(want)
        assert [key for chunk in partial.chunks for key in chunk] == want[: partial.known]
        if partial.known < len(want) and number % 2:
            assert partial.probe() == want[partial.known]
        assert list(partial.complete()) == want
        assert partial.known == len(want)
        assert len(lazy) == len(keys)
        assert [lazy.lookup(t).known for t in BASES] == [keys.lookup(t).known for t in BASES]


def test_the_chunk_cache_keeps_what_comes_back() -> None:
    """The cache forgets the least recently *used* chunks: a document read again and
    again stays known while one-off prompts' chunks pass through it."""
    block = 2
    span = CHUNK_BLOCKS * block
    document = [(7 * i) % 5 for i in range(3 * span)]
    keys = ChunkKeys(block, max_chunks=6)
    keys(document)
    keys(document)  # first chunk known: all three learnt
    assert keys.lookup(document).known == 3 * CHUNK_BLOCKS
    for one_off in range(20):
        keys([one_off, *document[1:span], 9, 9, 9, 9] + [one_off] * span)
        assert keys.lookup(document).known == 3 * CHUNK_BLOCKS
        assert len(keys) <= 6


@settings(max_examples=100, deadline=None)
@given(
    ranks=st.integers(1, 6),
    block=st.sampled_from([1, 2]),
    capacity=st.integers(1, 3 * CHUNK_BLOCKS),
    steps=st.lists(
        st.tuples(long_prompts, st.none() | st.integers(0, 5), st.floats(0, 1.0), st.booleans()),
        max_size=20,
    ),
)
def test_a_deferred_store_changes_no_choice(
    ranks: int,
    block: int,
    capacity: int,
    steps: list[tuple[list[int], int | None, float, bool]],
) -> None:
    """``defer_store``: each routed prompt is stored by ``settle()``, or by whatever
    reads or changes the indexes next; the decisions, the counters and the indexes
    (recency order included) are those of a router that stores at once."""
    routing = PrefixRouting(block_size=block, capacity_blocks=capacity, max_age=2.0)
    at_once, deferred = PrefixRouter(ranks, routing), PrefixRouter(ranks, routing)
    deferred.defer_store = True
    now = 0.0
    for tokens, pin, step, settle in steps:
        now += step
        queued = [float((len(tokens) * (rank + 3)) % 11) * 50 for rank in range(ranks)]
        pinned = None if pin is None else pin % ranks
        assert (
            deferred.choose(tokens, queued, now)
            if pinned is None
            else deferred.observe(pinned, tokens, now)
        ) == (
            at_once.choose(tokens, queued, now)
            if pinned is None
            else at_once.observe(pinned, tokens, now)
        )
        if settle:
            deferred.settle()
            assert deferred.block_owners() == at_once.block_owners()
    assert deferred.counters == at_once.counters
    assert deferred.block_owners() == at_once.block_owners()
    for ours, theirs in zip(deferred.indexes, at_once.indexes, strict=True):
        assert list(ours.blocks().items()) == list(theirs.blocks().items())


# --- vLLM's score: the rotated scan, recomputed per choice -------------------------------


class ReferenceVllmChooser:
    """vLLM 0.33.0's ``get_core_engine_for_request`` as it reads: every engine's score
    computed per choice, scanned in rotated order, the first strictly lowest wins."""

    def __init__(self, count: int, client_index: int, client_count: int) -> None:
        self.client_count = client_count
        self.inflight = [0] * count
        self.start = (count * client_index) // client_count
        self.table: tuple[EngineLoad, ...] = ()
        self.local: list[EngineLoad] = []

    def choose(self, loads: Sequence[EngineLoad]) -> int:
        count = len(loads)
        if count != len(self.inflight):
            extra = count - len(self.inflight)
            if extra > 0:
                self.inflight.extend([0] * extra)
            else:
                del self.inflight[count:]
            self.start %= count
        if tuple(loads) != self.table:
            self.table = tuple(loads)
            self.local = list(loads)
        best, best_score = -1, math.inf
        for offset in range(count):
            index = (self.start + offset) % count
            local = self.local[index]
            score = vllm_score(
                local.waiting,
                local.running,
                local.kv_cache_usage,
                self.inflight[index],
                self.client_count,
            )
            if score < best_score:
                best, best_score = index, score
        chosen = self.local[best]
        self.local[best] = chosen._replace(waiting=chosen.waiting + self.client_count)
        self.inflight[best] += 1
        self.start = (self.start + 1) % count
        return best

    def finished(self, index: int) -> None:
        if 0 <= index < len(self.inflight) and self.inflight[index] > 0:
            self.inflight[index] -= 1


usages = st.sampled_from([0.0, 0.3, 0.6, 1.0, math.inf, math.nan])
load_st = st.builds(EngineLoad, st.integers(0, 3), st.integers(0, 3), usages)
step_st = st.one_of(
    st.tuples(st.just("choose"), st.integers(0, 2)),  # which table (0: the previous one)
    st.tuples(st.just("finished"), st.integers(-1, 7)),
)


@settings(max_examples=300)
@given(
    tables=st.lists(st.lists(load_st, min_size=1, max_size=6), min_size=1, max_size=3),
    clients=st.integers(1, 3).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n))),
    steps=st.lists(step_st, max_size=40),
)
def test_the_vllm_choice_is_the_rotated_scan(
    tables: list[list[EngineLoad]], clients: tuple[int, int], steps: list[tuple[str, int]]
) -> None:
    client_index, client_count = clients
    count = len(tables[0])
    ours = EngineChooser(count, client_index=client_index, client_count=client_count)
    ref = ReferenceVllmChooser(count, client_index, client_count)
    table = tables[0]
    for op, arg in steps:
        if op == "choose":
            if arg:
                table = list(tables[arg % len(tables)])  # a new report (maybe a resize)
            assert ours.choose(table) == ref.choose(table)
        else:
            ours.finished(arg)
            ref.finished(arg)
        assert list(ours.statistics().inflight) == ref.inflight
