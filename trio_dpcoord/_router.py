"""Sans-IO prefix-aware engine choice: a per-rank prefix index and the policy over it.

Plain objects, no I/O and no clock of their own: inputs are prompts' token ids, per-rank
queued work, vLLM KV-cache event batches and clock readings; the output is a rank.

The index keys every full block of ``block_size`` prompt tokens by our own hash chained on
its parent block's key, so no hash seed has to be shared with vLLM. Memory per rank is
bounded by ``capacity_blocks`` (least recently used go first) and by ``max_age`` (a block
not seen for that long is forgotten), so a lost event batch cannot leave blocks believed
cached for ever; a gap or a step back in a rank's event sequence also forgets that rank's
exact knowledge at once.

Not wired in yet: every front-end still chooses with :class:`~trio_dpcoord.EngineChooser`
(vLLM's score); this module is private until a policy option exposes it.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
_ROOT = b"trio_dpcoord.prefix.root"


def block_keys(token_ids: Sequence[int], block_size: int, parent: bytes = _ROOT) -> list[bytes]:
    """Chained keys of the full blocks of ``token_ids`` (a partial last block has none)."""
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(struct.pack(f"<{block_size}q", *block))
        parent = digest.digest()
        keys.append(parent)
    return keys


class RankPrefixIndex:
    """The blocks believed cached on one rank: LRU over ``capacity_blocks``, ``max_age``."""

    def __init__(self, capacity_blocks: int, max_age: float) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        if max_age <= 0:
            raise ValueError(f"max_age must be > 0, got {max_age}")
        self.capacity_blocks = capacity_blocks
        self.max_age = max_age
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, key: bytes) -> bool:
        return key in self._seen

    def store(self, keys: Iterable[bytes], now: float) -> None:
        for key in keys:
            self._seen[key] = now
            self._seen.move_to_end(key)
        while len(self._seen) > self.capacity_blocks:
            self._seen.popitem(last=False)

    def remove(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._seen.pop(key, None)

    def clear(self) -> None:
        self._seen.clear()

    def expire(self, now: float) -> None:
        """Forget blocks last seen more than ``max_age`` before ``now`` (oldest first)."""
        while self._seen:
            key, seen = next(iter(self._seen.items()))
            if now - seen <= self.max_age:
                break
            del self._seen[key]

    def matched_blocks(self, keys: Sequence[bytes], now: float) -> int:
        """How many leading blocks of ``keys`` are cached here (chained: stops at a miss)."""
        self.expire(now)
        matched = 0
        for key in keys:
            if key not in self._seen:
                break
            matched += 1
        return matched


class KVEventError(ValueError):
    """A KV-event batch that is not vLLM's ``EventBatch`` format."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[Any]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None


def _hash_ok(value: object) -> bool:
    return isinstance(value, (int, bytes)) and not isinstance(value, bool)


def decode_event_batch(payload: bytes) -> EventBatch:
    """Decode vLLM's msgpack ``EventBatch``; :class:`KVEventError` if it is not one.

    The layout is what vLLM's ``msgspec`` encoder writes (checked against the CPU build,
    0.32.0, ``vllm/distributed/kv_events.py``): the batch is array-like, ``[ts, events,
    data_parallel_rank]``, and each event a map tagged by ``"type"`` (``BlockStored`` with
    ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ...).
    """
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise KVEventError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KVEventError("EventBatch must be an array [ts, events, dp_rank?]")
    ts, raw_events = raw[0], raw[1]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise KVEventError("EventBatch ts must be a number")
    rank = raw[2] if len(raw) > 2 else None
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise KVEventError("EventBatch data_parallel_rank must be a non-negative int")
    events: list[KVEvent] = []
    for item in raw_events:
        # msgspec encodes the events (tagged, not array-like) as maps named by "type".
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise KVEventError("event must be a map with a 'type'")
        tag = item["type"]
        if tag == "BlockStored":
            hashes = item.get("block_hashes")
            parent = item.get("parent_block_hash")
            tokens, size = item.get("token_ids"), item.get("block_size")
            if not isinstance(hashes, list) or not all(_hash_ok(h) for h in hashes):
                raise KVEventError("BlockStored block_hashes must be ints or bytes")
            if parent is not None and not _hash_ok(parent):
                raise KVEventError("BlockStored parent_block_hash must be int, bytes or nil")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise KVEventError("BlockStored block_size must be a positive int")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens
            ):
                raise KVEventError("BlockStored token_ids must be ints")
            if len(tokens) != size * len(hashes):
                raise KVEventError("BlockStored token_ids must be block_size per block hash")
            events.append(BlockStored(hashes, parent, tokens, size))
        elif tag == "BlockRemoved":
            hashes = item.get("block_hashes")
            if not isinstance(hashes, list) or not all(_hash_ok(h) for h in hashes):
                raise KVEventError("BlockRemoved block_hashes must be ints or bytes")
            events.append(BlockRemoved(hashes))
        elif tag == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise KVEventError(f"unknown event type {tag!r}")
    return EventBatch(float(ts), events, rank)


@dataclass
class RouterCounters:
    decisions: int = 0
    guard_fallbacks: int = 0
    event_batches: int = 0
    rejected_event_batches: int = 0
    event_gaps: int = 0


@dataclass
class _ExactRank:
    last_seq: int | None = None
    vllm_to_ours: dict[Any, bytes] = field(default_factory=dict)


class PrefixRouter:
    """Chooses the rank that keeps the busiest rank's work lowest.

    A rank's work is its queued work (loads passed in, in tokens) plus, for the rank that
    would take the request, the request's uncached prompt tokens there. Ties go to the most
    cached tokens, then to rotation. When the ranks' queued work is imbalanced beyond both
    ``imbalance_abs`` and ``imbalance_rel`` (max - min > abs and max > rel x min), the
    guard chooses the least loaded rank. A pinned rank is returned as is.
    ``feed="approximate"`` takes a routed prompt as cached on the chosen rank;
    ``feed="exact"`` learns only from vLLM's KV events (:meth:`receive_kv_events`).
    """

    def __init__(
        self,
        ranks: int,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        capacity_blocks: int = 65536,
        max_age: float = 600.0,
        imbalance_abs: float = 32768.0,
        imbalance_rel: float = 4.0,
        feed: str = "approximate",
    ) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if feed not in ("approximate", "exact"):
            raise ValueError(f"feed must be 'approximate' or 'exact', got {feed!r}")
        self.ranks = ranks
        self.block_size = block_size
        self.feed = feed
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self.indexes = [RankPrefixIndex(capacity_blocks, max_age) for _ in range(ranks)]
        self._exact = [_ExactRank() for _ in range(ranks)]
        self._rotation = 0
        self.counters = RouterCounters()

    def cached_tokens(self, rank: int, token_ids: Sequence[int], now: float) -> int:
        keys = block_keys(token_ids, self.block_size)
        return self.indexes[rank].matched_blocks(keys, now) * self.block_size

    def choose(
        self,
        token_ids: Sequence[int],
        queued_work: Sequence[float],
        now: float,
        pinned_rank: int | None = None,
    ) -> int:
        """The rank for a prompt of ``token_ids`` given each rank's queued work (tokens)."""
        if len(queued_work) != self.ranks:
            raise ValueError(f"queued_work has {len(queued_work)} ranks, expected {self.ranks}")
        self.counters.decisions += 1
        keys = block_keys(token_ids, self.block_size)
        if pinned_rank is not None:
            if not 0 <= pinned_rank < self.ranks:
                raise ValueError(f"pinned rank {pinned_rank} out of range 0..{self.ranks - 1}")
            chosen = pinned_rank
        else:
            chosen = self._pick(keys, len(token_ids), queued_work, now)
        if self.feed == "approximate":
            self.indexes[chosen].store(keys, now)
        return chosen

    def _pick(
        self, keys: list[bytes], prompt_len: int, queued: Sequence[float], now: float
    ) -> int:
        start = self._rotation
        self._rotation = (self._rotation + 1) % self.ranks
        low, high = min(queued), max(queued)
        if high - low > self.imbalance_abs and high > self.imbalance_rel * max(low, 1.0):
            self.counters.guard_fallbacks += 1
            return min(range(self.ranks), key=lambda r: (queued[r], (r - start) % self.ranks))
        # The busiest rank after placing on r is max(top other, queued[r] + uncached[r]).
        order = sorted(range(self.ranks), key=lambda r: queued[r], reverse=True)
        first, second = order[0], (order[1] if self.ranks > 1 else order[0])
        best: tuple[float, int, int] | None = None
        chosen = start
        for offset in range(self.ranks):
            rank = (start + offset) % self.ranks
            cached = self.indexes[rank].matched_blocks(keys, now) * self.block_size
            others = queued[second] if rank == first else queued[first]
            if self.ranks == 1:
                others = 0.0
            busiest = max(others, queued[rank] + prompt_len - cached)
            candidate = (busiest, -cached, offset)
            if best is None or candidate < best:
                best, chosen = candidate, rank
        return chosen

    def receive_kv_events(self, rank: int, seq: int, payload: bytes, now: float) -> bool:
        """Apply one engine's KV-event batch (``seq`` from the PUB frame); False if rejected.

        A sequence gap or step back means lost or reordered batches: the rank's exact
        knowledge is forgotten, since what it would now claim could be stale.
        """
        if not 0 <= rank < self.ranks:
            self.counters.rejected_event_batches += 1
            logger.warning("KV events from unknown rank %d rejected", rank)
            return False
        try:
            batch = decode_event_batch(payload)
        except KVEventError as exc:
            self.counters.rejected_event_batches += 1
            logger.warning("KV event batch from rank %d rejected: %s", rank, exc)
            return False
        state = self._exact[rank]
        index = self.indexes[rank]
        if state.last_seq is not None and seq != state.last_seq + 1:
            self.counters.event_gaps += 1
            logger.warning(
                "KV events of rank %d: seq %d after %d, forgetting", rank, seq, state.last_seq
            )
            index.clear()
            state.vllm_to_ours.clear()
        state.last_seq = seq
        self.counters.event_batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = _ROOT
                if event.parent_block_hash is not None:
                    known = state.vllm_to_ours.get(event.parent_block_hash)
                    if known is None or known not in index:
                        continue  # parent unknown: the chain cannot be matched anyway
                    parent = known
                ours = block_keys(event.token_ids, event.block_size, parent)
                if event.block_size != self.block_size:
                    continue  # keys of another block size never match our prompts'
                for theirs, key in zip(event.block_hashes, ours, strict=True):
                    state.vllm_to_ours[theirs] = key
                index.store(ours, now)
            elif isinstance(event, BlockRemoved):
                index.remove(
                    k for h in event.block_hashes if (k := state.vllm_to_ours.pop(h, None))
                )
            else:
                index.clear()
                state.vllm_to_ours.clear()
        if len(state.vllm_to_ours) > 2 * index.capacity_blocks:
            state.vllm_to_ours = {h: k for h, k in state.vllm_to_ours.items() if k in index}
        return True
