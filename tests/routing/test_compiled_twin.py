"""The compiled twins of the prefix policy's hot path against their pure-Python spec.

The prefix policy's keys (``routing/_keys.py``), index, walk, router and chooser take
some of their names from their compiled twins (``routing/*_kernel.pyx``) where they
were built. Here the pure modules run beside the package's own (loaded from source by
:func:`tests.routing.pure_twin.hot_path`): the same keys, the same errors, the same chunk
cache, the same pick over random groups, loads and settings, and routers and choosers
built on each give the same decisions, index contents, owners and counters over random
prompts, loads, evictions (small capacities, ages) and KV-event batches (some of them
fuzzed bytes). With ``TRIO_DPCOORD_PURE_PYTHON=1`` (or no
compiler at install) both sides are pure and this checks the loader and the switch; CI
runs it both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.pure_twin import PURE_PYTHON, REQUIRE_COMPILED, kernel_state, run_fresh
from tests.routing.pure_twin import PURE_TWIN_PACKAGE, hot_path
from trio_dpcoord import EngineLoad
from trio_dpcoord.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_event_batch,
)
from trio_dpcoord.routing import PrefixRouting

FAST = hot_path(pure=False)
PURE = hot_path(pure=True)


def outcome(call: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    """What a call gives: ``("ok", value)`` or ``("raised", type, message)``."""
    try:
        value = call(*args)
        if not isinstance(value, list):
            value = list(value)
        return ("ok", value)
    except Exception as exc:
        return ("raised", type(exc), str(exc))


def test_the_build_asked_for_runs() -> None:
    """Forced pure: the pure names; else the compiled ones wherever the twin was built
    (and CI's default install must have built it)."""
    for module in (
        "routing._keys",
        "routing._prefix_index",
        "routing._walk",
        "routing._prefix_router",
        "routing._chooser",
    ):
        built, in_use = kernel_state(module)
        if REQUIRE_COMPILED and not PURE_PYTHON:
            assert built, f"the compiled twin of {module} was not built"
        assert in_use == (built and not PURE_PYTHON)
    built, in_use = kernel_state("routing._keys")
    assert FAST.block_keys is not PURE.block_keys
    assert FAST.block_keys.__module__.endswith("_kernel") == in_use
    assert FAST.chunk_hashes.__module__.endswith("_kernel") == in_use
    assert PURE.block_keys.__module__.startswith(PURE_TWIN_PACKAGE)
    assert PURE.PrefixRouter.__module__.startswith(PURE_TWIN_PACKAGE)
    _, index_in_use = kernel_state("routing._prefix_index")
    store = FAST.RankPrefixIndex._store_chain
    assert store.__module__.endswith("_kernel") == index_in_use
    assert PURE.RankPrefixIndex._store_chain.__module__.startswith(PURE_TWIN_PACKAGE)
    _, router_in_use = kernel_state("routing._prefix_router")
    for method in ("_decide", "_walk", "_bisect", "_pick"):
        compiled = getattr(FAST.PrefixRouter, method).__module__.endswith("_kernel")
        assert compiled == router_in_use
        assert getattr(PURE.PrefixRouter, method).__module__.startswith(PURE_TWIN_PACKAGE)
    _, chooser_in_use = kernel_state("routing._chooser")
    for method in ("choose", "_choose_prefix", "_charge", "_rescore"):
        compiled = getattr(FAST.EngineChooser, method).__module__.endswith("_kernel")
        assert compiled == chooser_in_use
        assert getattr(PURE.EngineChooser, method).__module__.startswith(PURE_TWIN_PACKAGE)


ints = st.one_of(
    st.integers(0, 200),  # a small vocabulary: repeated blocks
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**80), 2**80),  # past 64 bits: hashed modulo, as Python does
    st.sampled_from([-1, -2, 2**61 - 1, 2**61, -(2**61) + 1]),  # hash(-1) == hash(-2)
)
tokens_lists = st.lists(ints, max_size=160)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens_lists,
    st.integers(-1, 20),
    st.one_of(st.just(0), st.integers(-(2**63), 2**63 - 1), st.integers(2**63, 2**70)),
    st.integers(-1, 70),
)
def test_block_keys_are_the_same(
    tokens: list[int], block_size: int, parent: int, depth: int
) -> None:
    assert outcome(FAST.block_keys, tokens, block_size, parent, depth) == outcome(
        PURE.block_keys, tokens, block_size, parent, depth
    )
    as_tuple = tuple(tokens)  # any sequence, not only lists
    assert outcome(FAST.block_keys, as_tuple, block_size, parent, depth) == outcome(
        PURE.block_keys, as_tuple, block_size, parent, depth
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens_lists, st.integers(-1, 40))
def test_chunk_hashes_are_the_same(tokens: list[int], span: int) -> None:
    assert outcome(FAST.chunk_hashes, tokens, span) == outcome(PURE.chunk_hashes, tokens, span)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(ints, st.text(max_size=3), st.none(), st.lists(st.integers(), max_size=1)),
        max_size=40,
    ),
    st.integers(1, 6),
)
def test_other_items_hash_or_fail_alike(items: list[Any], size: int) -> None:
    """Strings and None hash as in a tuple; an unhashable item fails the same way."""
    assert outcome(FAST.block_keys, items, size) == outcome(PURE.block_keys, items, size)
    assert outcome(FAST.chunk_hashes, items, size) == outcome(PURE.chunk_hashes, items, size)


def test_a_list_shrinking_under_the_chunk_iterator_stops_it() -> None:
    """The iterator reads the list in place: a shorter list ends it (never a stale read)."""
    tokens = list(range(100))
    fast, pure = FAST.chunk_hashes(tokens, 10), PURE.chunk_hashes(tokens[:], 10)
    assert next(fast) == next(pure)
    del tokens[15:]
    assert list(fast) == []


# --- the chunk cache: lookups, probes, extensions, what it learns ------------------------

DOCS = [[(doc * 7919 + i * 31) % 997 for i in range(400)] for doc in range(4)]


def prompts(block_size: int, *, odd_tokens: bool = False) -> st.SearchStrategy[list[int]]:
    """Prompts sharing documents' prefixes (so the cache finds chunks), with new tails;
    with ``odd_tokens``, now and then a token that is not an int of one digit (hashed
    apart: the compiled lookup hands such prompts to the pure one, wherever the token
    is; no engine sends one, and the KV events' wire format has no room for them)."""
    token = st.integers(0, 5000)
    if odd_tokens:
        token |= st.sampled_from([2**70, -(2**65), -1, 2**62])
    return st.builds(
        lambda doc, blocks, tail: DOCS[doc][: blocks * block_size] + tail,
        st.integers(0, len(DOCS) - 1),
        st.integers(0, 400 // block_size),
        st.lists(token, max_size=70 * block_size),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_the_chunk_cache_gives_and_learns_the_same(
    block_size: int, max_chunks: int, data: st.DataObject
) -> None:
    fast, pure = (
        FAST.ChunkKeys(block_size, max_chunks),
        PURE.ChunkKeys(block_size, max_chunks),
    )
    for _ in range(data.draw(st.integers(1, 12))):
        prompt = data.draw(prompts(block_size, odd_tokens=True))
        mine, theirs = fast.lookup(prompt), pure.lookup(prompt)
        assert mine.known == theirs.known and len(mine) == len(theirs)
        for step in data.draw(st.lists(st.sampled_from(["probe", "extend"]), max_size=4)):
            if step == "probe" and mine.known < len(mine):
                assert mine.probe() == theirs.probe()
            elif step == "extend":
                mine.extend()
                theirs.extend()
            assert mine.known == theirs.known
        assert list(mine.complete()) == list(theirs.complete())
        assert list(mine) == PURE.block_keys(prompt, block_size)
        assert fast._chunks == pure._chunks


# --- the walk: bisecting the owners map ------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 300),
    st.lists(st.integers(0, 300), min_size=1, max_size=12),
    st.integers(1, 20),
    st.booleans(),
    st.data(),
)
def test_the_walk_bisects_the_same(
    count: int, depths: list[int], span: int, closed: bool, data: st.DataObject
) -> None:
    """Ranks holding prefixes of ``depths`` blocks (prefix-closed, as the walk assumes),
    or any masks at all: the same groups from both builds."""
    keys = [hash(("key", number)) for number in range(count)]
    owners: dict[int, int] = {}
    for number, key in enumerate(keys):
        if closed:
            mask = sum(1 << rank for rank, depth in enumerate(depths) if depth > number)
        else:
            mask = data.draw(st.integers(0, 2 ** len(depths) - 1))
        if mask:
            owners[key] = mask
    chunks = [keys[at : at + span] for at in range(0, count, span)]
    first = owners.get(keys[0], 0)
    last = owners.get(keys[-1], 0) & first
    assert FAST.bisect_holders(owners, chunks, span, count, first, last) == (
        PURE.bisect_holders(owners, chunks, span, count, first, last)
    )


# --- one rank's chain-mode index: stores, evictions, expiry, removals ---------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 90), st.integers(1, 3), st.data())
def test_chain_mode_indexes_hold_the_same(capacity: int, ranks: int, data: st.DataObject) -> None:
    """Indexes of each build in chain mode (one owners map per build, shared by its
    ranks), fed the same chains (prefixes of a few documents' keys, some with new
    tails), expiry and removals: the same blocks in the same order, the same owners."""
    docs = [PURE.block_keys(doc, 2) for doc in DOCS]
    built = []
    for side in (FAST, PURE):
        owners: dict[int, int] = {}
        indexes = [
            side.RankPrefixIndex(capacity, 4.0, bit=1 << rank, owners=owners)
            for rank in range(ranks)
        ]
        for index in indexes:
            index._chain_mode()
        built.append((owners, indexes))
    now = 0.0
    for _ in range(data.draw(st.integers(1, 25))):
        rank = data.draw(st.integers(0, ranks - 1))
        step = data.draw(st.sampled_from(["store", "store", "store", "expire", "remove"]))
        now += data.draw(st.sampled_from([0.0, 0.5, 3.0]))
        doc = docs[data.draw(st.integers(0, len(docs) - 1))]
        chain = doc[: data.draw(st.integers(0, len(doc)))]
        chain += data.draw(st.lists(st.integers(0, 2**64), max_size=70))
        gone = data.draw(st.lists(st.sampled_from(doc), max_size=5))
        for _owners, indexes in built:
            if step == "store":
                indexes[rank].store(chain, now)
            elif step == "expire":
                indexes[rank].expire(now)
            else:
                indexes[rank].remove(gone)
        (fast_owners, fast), (pure_owners, pure) = built
        # the same order too (eviction's): the views as lists
        assert [list(index.blocks().items()) for index in fast] == [
            list(index.blocks().items()) for index in pure
        ]
        assert [len(index) for index in fast] == [len(index) for index in pure]
        assert fast_owners == pure_owners


# --- the pick over the ranks: random groups, loads and settings ---------------------------

queued_values = st.one_of(
    st.integers(0, 40),  # ties
    st.floats(0.0, 1e4),
    st.integers(-(2**62), 2**62),  # past 2**50: the pure method's own arithmetic
    st.sampled_from([0.0, -0.0, 1.0, 4096.0, 2**50, -(2**50), float("inf"), float("nan")]),
)


def decision_or_error(router: Any, *args: Any) -> tuple[Any, ...]:
    """A pick's decision and the router's state after it, or the error it raised."""
    try:
        decision = router._pick(*args)
    except Exception as exc:
        return ("raised", type(exc), str(exc))
    return ("ok", decision, router._rotation, router.counters.guard_fallbacks)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 140), st.data())
def test_the_pick_chooses_the_same(ranks: int, data: st.DataObject) -> None:
    """``PrefixRouter._pick`` on each build, over groups as the walk gives them (depths
    ascending, disjoint masks) of up to 140 ranks, loads with ties, infinities, NaNs and
    ints past 2**50, every setting it weighs, unshared choices and rotations: the same
    decisions, rotation and guard counts (or the same error)."""
    held = data.draw(st.lists(st.integers(0, ranks - 1), unique=True, max_size=12))
    by_depth: dict[int, int] = {}
    for rank in held:
        depth = data.draw(st.integers(1, 40))
        by_depth[depth] = by_depth.get(depth, 0) | 1 << rank
    groups = sorted(by_depth.items())
    deepest = groups[-1][0] if groups else 0
    keys = data.draw(st.sampled_from([[], list(range(7, 7 + deepest + 3))]))
    routing = PrefixRouting(
        reuse_weight=data.draw(st.floats(0.0, 10.0) | st.sampled_from([1, 3, float("inf")])),
        imbalance_abs=data.draw(st.floats(0.0, 1e4) | st.sampled_from([4096.0, 0, 10])),
        imbalance_rel=data.draw(st.floats(1.0, 10.0) | st.sampled_from([3.0, 1, 2])),
        rendezvous_slack=data.draw(st.sampled_from([0.0, 0.0, 0.0, 0.5])),
        rendezvous_home=data.draw(st.booleans()),
    )
    start = data.draw(st.integers(0, ranks - 1))
    fast = FAST.PrefixRouter(ranks, routing, start=start)
    pure = PURE.PrefixRouter(ranks, routing, start=start)
    for _ in range(data.draw(st.integers(1, 3))):
        queued: Sequence[float] = data.draw(st.lists(queued_values, min_size=ranks, max_size=ranks))
        if data.draw(st.booleans()):
            queued = tuple(queued)
        prompt_len = data.draw(st.integers(0, 5000) | st.just(2**60))
        unshared: Any = data.draw(st.none() | st.integers(-1, ranks))
        if unshared is not None and data.draw(st.booleans()):
            unshared = partial(int, unshared)  # a callable choice
        mine = decision_or_error(fast, groups, keys, prompt_len, queued, unshared)
        theirs = decision_or_error(pure, groups, keys, prompt_len, queued, unshared)
        assert repr(mine) == repr(theirs)  # (repr: a NaN cost's message compares too)


# --- routers on each build: decisions, indexes, owners, counters --------------------------


class TwinRouters(RuleBasedStateMachine):
    """The package's router and the pure twin's, fed the same inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fast: Any = None
        self.pure: Any = None
        self.now = 0.0
        self.block_size = 4
        self.feed = "approximate"
        self.seq: list[int] = []
        self.engine_hashes: list[list[int]] = []

    @initialize(
        ranks=st.integers(1, 6),
        capacity=st.integers(4, 80),
        feed=st.sampled_from(["approximate", "exact"]),
        defer=st.booleans(),
        block_size=st.sampled_from([2, 4]),
        weighing=st.fixed_dictionaries(
            {},
            optional={
                "reuse_weight": st.sampled_from([0.0, 2.5, 1]),
                "imbalance_abs": st.sampled_from([0.0, 50.0, 100]),
                "imbalance_rel": st.sampled_from([1.0, 1.5]),
                "rendezvous_slack": st.sampled_from([0.5, 2.0]),
                "rendezvous_home": st.booleans(),
            },
        ),
    )
    def start(
        self,
        ranks: int,
        capacity: int,
        feed: Any,
        defer: bool,
        block_size: int,
        weighing: dict[str, Any],
    ) -> None:
        routing = PrefixRouting(
            block_size=block_size, capacity_blocks=capacity, max_age=5.0, feed=feed, **weighing
        )
        self.block_size = block_size
        self.feed = feed
        self.fast = FAST.PrefixRouter(ranks, routing)
        self.pure = PURE.PrefixRouter(ranks, routing)
        self.fast.defer_store = self.pure.defer_store = defer
        self.seq = [0] * ranks
        self.engine_hashes = [[] for _ in range(ranks)]

    @rule(data=st.data())
    def route(self, data: st.DataObject) -> None:
        prompt = data.draw(prompts(self.block_size))
        ranks = len(self.seq)
        work = st.integers(0, 600) | st.floats(0.0, 600.0)
        queued = data.draw(st.lists(work, min_size=ranks, max_size=ranks))
        pinned = data.draw(st.none() | st.integers(0, ranks - 1))
        if pinned is None:
            mine = self.fast.choose(prompt, queued, self.now)
            theirs = self.pure.choose(prompt, queued, self.now)
        else:  # a pinned request: the engine is given, the router learns it
            mine = self.fast.observe(pinned, prompt, self.now)
            theirs = self.pure.observe(pinned, prompt, self.now)
        assert mine == theirs

    @rule(seconds=st.floats(0.0, 3.0))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    @precondition(lambda self: self.feed == "exact")
    @rule(data=st.data())
    def kv_events(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, len(self.seq) - 1))
        kind = data.draw(st.sampled_from(["stored", "removed", "cleared", "fuzz"]))
        if kind == "fuzz":
            payload = data.draw(st.binary(max_size=40))
        else:
            events: list[Any]
            if kind == "stored":
                prompt = data.draw(prompts(self.block_size))
                blocks = len(prompt) // self.block_size
                first = len(self.engine_hashes[rank]) + 1000 * rank
                hashes = list(range(first, first + blocks))
                self.engine_hashes[rank].extend(hashes)
                stored = prompt[: blocks * self.block_size]
                events = [BlockStored(hashes, None, stored, self.block_size)]
            elif kind == "removed":
                held = self.engine_hashes[rank]
                events = [BlockRemoved(data.draw(st.lists(st.sampled_from(held or [0]))))]
            else:
                events = [AllBlocksCleared()]
            payload = encode_event_batch(EventBatch(self.now, events, rank))
        self.seq[rank] += data.draw(st.sampled_from([1, 1, 1, 2]))  # now and then a gap
        seq = self.seq[rank]
        assert self.fast.receive_kv_events(rank, seq, payload, self.now) == (
            self.pure.receive_kv_events(rank, seq, payload, self.now)
        )

    @invariant()
    def same_state(self) -> None:
        if self.fast is None:
            return
        fast_indexes, pure_indexes = self.fast.indexes, self.pure.indexes
        assert [list(index.blocks().items()) for index in fast_indexes] == [
            list(index.blocks().items()) for index in pure_indexes
        ]
        assert [index.provisional_blocks() for index in fast_indexes] == [
            index.provisional_blocks() for index in pure_indexes
        ]
        assert self.fast.block_owners() == self.pure.block_owners()
        assert self.fast.counters == self.pure.counters


TestTwinRouters = TwinRouters.TestCase
TestTwinRouters.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 8),
    st.sampled_from(["prefix", "vllm"]),
    st.lists(prompts(16), min_size=1, max_size=8),
    st.data(),
)
def test_choosers_choose_the_same(
    ranks: int, routing: Any, prompt_list: Sequence[list[int]], data: st.DataObject
) -> None:
    """``EngineChooser`` on each build: the same engines, the same in-flight counts,
    scores and queued work, through new and repeated load tables (the same objects
    again, or equal ones), finished requests and pinned ones."""
    fast = FAST.EngineChooser(ranks, routing=routing, client_count=2)
    pure = PURE.EngineChooser(ranks, routing=routing, client_count=2)
    loads: list[EngineLoad] = []
    for number, prompt in enumerate(prompt_list):
        step = data.draw(st.sampled_from(["new", "same", "equal", "finish", "pin"]))
        if step == "new" or not loads:
            loads = [
                EngineLoad(
                    waiting=data.draw(st.integers(0, 4)),
                    running=data.draw(st.integers(0, 8)),
                    kv_cache_usage=data.draw(
                        st.sampled_from([0.3, 0.5, 0.9, 1, float("inf"), float("nan")])
                    ),
                )
                for _ in range(ranks)
            ]
        elif step == "equal":
            loads = [EngineLoad(*load) for load in loads]
        now = float(number)
        rank = data.draw(st.integers(0, ranks - 1))
        if step == "finish":
            fast.finished(rank)
            pure.finished(rank)
        elif step == "pin":
            assert fast.observe(rank, prompt, now=now) == pure.observe(rank, prompt, now=now)
        tokens = prompt if data.draw(st.booleans()) else None
        table: Sequence[EngineLoad] = tuple(loads) if data.draw(st.booleans()) else loads
        assert fast.choose(table, tokens, now=now) == pure.choose(table, tokens, now=now)
        mine, theirs = fast.statistics(), pure.statistics()  # (each build's own class)
        assert (mine.inflight, mine.router) == (theirs.inflight, theirs.router)
        assert (fast._scores, fast._queued, fast._local) == (
            pure._scores,
            pure._queued,
            pure._local,
        )


@pytest.mark.parametrize("forced_pure", [False, True])
def test_the_build_a_process_names_is_the_one_it_runs(forced_pure: bool) -> None:
    """``hot_path_build()`` (what benchmark records call their build) says "pure" where
    TRIO_DPCOORD_PURE_PYTHON is set, and otherwise "compiled" exactly where every
    kernel took over: a fresh process, so the environment decides as at start-up."""
    script = (
        "import json, trio_dpcoord\n"
        "from trio_dpcoord._compiled import kernels_in_use\n"
        "from trio_dpcoord.routing import block_keys\n"
        "print(json.dumps([trio_dpcoord.hot_path_build(),"
        " type(block_keys).__name__, all(kernels_in_use().values())]))"
    )
    build, keys_type, every_kernel = run_fresh(script, forced_pure=forced_pure)
    # the compiled block_keys is a Cython function, the pure one a Python function
    assert build == ("compiled" if every_kernel else "pure")
    if every_kernel:
        assert keys_type == "cython_function_or_method"
    if forced_pure:
        assert build == "pure"
    elif REQUIRE_COMPILED:
        assert build == "compiled"
