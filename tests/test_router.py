"""The sans-IO prefix router: index bounds, KV-event decoding, the policy."""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

# private import (documented exception): the unit test of the private module itself
from trio_dpcoord._router import (
    KVEventError,
    PrefixRouter,
    PrefixRouting,
    RankPrefixIndex,
    block_keys,
    decode_event_batch,
)


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


def test_approximate_feed_routes_a_repeat_prompt_to_its_rank() -> None:
    router = PrefixRouter(4, PrefixRouting(imbalance_abs=10_000))
    prompt = list(range(256))
    first = router.choose(prompt, [0, 0, 0, 0], now=0.0)
    assert router.cached_tokens(first, prompt, 1.0) == 256
    # Its rank is somewhat busier but the uncached prompt elsewhere would cost more.
    loads = [100.0] * 4
    loads[first] = 150.0
    assert router.choose(prompt + [7] * 16, loads, now=1.0) == first


def test_busiest_rank_wins_over_affinity() -> None:
    router = PrefixRouter(2, PrefixRouting(imbalance_abs=1e9))
    prompt = list(range(64))
    first = router.choose(prompt, [0, 0], now=0.0)
    loads = [0.0, 0.0]
    loads[first] = 1000.0
    # Cached there or not, the busiest rank stays at 1000: affinity breaks the tie.
    assert router.choose(prompt, loads, now=1.0) == first
    # A new prompt would make the loaded rank busier still: it goes to the idle one.
    assert router.choose([5] * 64, loads, now=1.0) == 1 - first


def test_guard_falls_back_to_least_loaded_and_pinned_is_honoured() -> None:
    router = PrefixRouter(3, PrefixRouting(imbalance_abs=100, imbalance_rel=2))
    assert router.choose([1] * 32, [500, 10, 20], now=0.0) == 1
    assert router.counters.guard_fallbacks == 1
    assert router.choose([1] * 32, [0, 0, 0], now=0.0, pinned_rank=2) == 2
    with pytest.raises(ValueError):
        router.choose([1] * 32, [0, 0, 0], now=0.0, pinned_rank=3)


def test_ties_rotate() -> None:
    router = PrefixRouter(3, PrefixRouting(feed="exact"))
    chosen = {router.choose([i] * 16, [0, 0, 0], now=0.0) for i in range(3)}
    assert chosen == {0, 1, 2}


def test_age_limit_forgets() -> None:
    router = PrefixRouter(2, PrefixRouting(max_age=10.0))
    prompt = list(range(32))
    rank = router.choose(prompt, [0, 0], now=0.0)
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
    assert router.choose(tokens, [0, 0], now=0.0) == 1
    assert router.cached_tokens(0, tokens, 0.0) == 0  # exact feed learns only from events
    removed = {"type": "BlockRemoved", "block_hashes": [12], "medium": None}
    assert router.receive_kv_events(1, 1, batch(removed), now=0.0)
    assert router.cached_tokens(1, tokens, 0.0) == 4
    assert router.receive_kv_events(1, 2, batch({"type": "AllBlocksCleared"}), now=0.0)
    assert router.cached_tokens(1, tokens, 0.0) == 0


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
        for key in self.index._seen:
            assert self.now - self.last_seen[key] <= 5.0
            assert self.index._seen[key] == self.last_seen[key]


TestIndexMachine = IndexMachine.TestCase
