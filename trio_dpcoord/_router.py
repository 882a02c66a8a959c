"""Sans-IO prefix-aware engine choice: a per-rank prefix index and the policy over it.

Plain objects, no I/O and no clock of their own: inputs are prompts' token ids, per-rank
queued work, vLLM KV-cache event batches and clock readings; the output is a rank.
:class:`~trio_dpcoord.EngineChooser` with ``routing="prefix"`` is how front-ends use it.

The index keys every full block of ``block_size`` prompt tokens by our own hash chained on
its parent block's key, so no hash seed has to be shared with vLLM. Memory per rank is
bounded by ``capacity_blocks`` (least recently used go first, the deepest block of a
prompt before its parents) and by ``max_age`` (a block not seen for that long is
forgotten), so a lost event batch cannot leave blocks believed cached for ever; a gap or
a step back in a rank's event sequence also forgets that rank's exact knowledge at once.

One decision hashes the prompt's blocks once and walks a block -> ranks map from the
first block, stopping at the first block no rank holds: its cost grows with the prompt
and the matched depth, not with the number of ranks times the prompt.
"""

from __future__ import annotations

import logging
import random
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, islice, repeat, takewhile
from operator import add, and_, is_, or_
from typing import Any, Literal

import msgpack

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "KVEventError",
    "PrefixRouter",
    "PrefixRouting",
    "RankPrefixIndex",
    "RouteDecision",
    "RouterCounters",
    "block_keys",
    "decode_event_batch",
    "decode_kv_event_frames",
]

DEFAULT_BLOCK_SIZE = 16
"""vLLM's default KV-cache block size."""

Feed = Literal["approximate", "exact"]

_ROOT = 0
"""The chain's start: the key "before" a prompt's first block."""

_POSITION_SALTS: list[int] = []
"""Per block position, a fixed random 61-bit salt (one seeded stream, extended on
demand): a block's contribution depends on where it sits, so reordered blocks differ."""
_SALT_STREAM = random.Random(0x7472696F)


def _salts(upto: int) -> list[int]:
    if len(_POSITION_SALTS) < upto:
        more = max(upto, 2 * len(_POSITION_SALTS), 4096) - len(_POSITION_SALTS)
        _POSITION_SALTS.extend(_SALT_STREAM.getrandbits(61) for _ in range(more))
    return _POSITION_SALTS


def block_keys(
    token_ids: Sequence[int], block_size: int, parent: int = _ROOT, depth: int = 0
) -> list[int]:
    """Chained keys of the full blocks of ``token_ids`` (a partial last block has none).

    Key ``i`` is ``parent`` plus the sum, over blocks ``j <= i``, of the hash of block
    ``j``'s tokens together with the salt of its position ``depth + j``: a running sum,
    so that hashing and chaining a prompt take one C-level pass each (Python's hash of a
    tuple of ints does not depend on the process's hash seed). ``parent``/``depth``
    continue a chain (a vLLM ``BlockStored`` whose parent block is known). Distinct
    prefixes collide about as often as random 64-bit values do; a collision only
    misroutes one request.
    """
    blocks = len(token_ids) // block_size
    if blocks == 0:
        return []
    salts: Iterable[int] = _salts(depth + blocks)
    if depth:
        salts = islice(salts, depth, None)
    # zip groups the tokens in blocks (the grouper idiom); a partial last block ends it
    # (zip stops at the tokens' end before it takes a salt).
    hashes = map(hash, zip(*(iter(token_ids),) * block_size, salts, strict=False))
    if not parent:
        return list(accumulate(hashes, add))
    keys = list(accumulate(hashes, add, initial=parent))
    del keys[0]
    return keys


class RankPrefixIndex:
    """The blocks believed cached on one rank: LRU over ``capacity_blocks``, ``max_age``.

    ``owners``, shared by the ranks of one router, maps a block key to the bit mask of
    the ranks holding it (this rank's bit is ``bit``); a lone index keeps its own.

    The recency order is a plain dict's insertion order (a key is refreshed by taking it
    out and putting it back), not an ``OrderedDict``'s linked list: a prompt's keys then
    go in and out with C-level bulk calls (``map(seen.pop, ...)``, ``seen.update``), the
    bulk of one decision's cost at 256-block prompts, and the index takes less memory.
    A plain dict cannot put a key first: the displaced blocks that come back as the
    least recently used (exact feed) are listed in ``_front``, which the order reads
    before the dict's own.
    """

    def __init__(
        self,
        capacity_blocks: int,
        max_age: float,
        *,
        bit: int = 1,
        owners: dict[int, int] | None = None,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        if max_age <= 0:
            raise ValueError(f"max_age must be > 0, got {max_age}")
        self.capacity_blocks = capacity_blocks
        self.max_age = max_age
        self._bit = bit
        self._owners: dict[int, int] = {} if owners is None else owners
        self._seen: dict[int, float] = {}
        """Key -> last seen; least recently seen first, after the keys of ``_front``."""
        self._front: OrderedDict[int, None] = OrderedDict()
        """Keys of ``_seen`` that are less recently used than all its others, least
        first, wherever the dict holds them (the displaced blocks that came back)."""
        self._provisional: dict[int, float] = {}
        """Keys held only on belief (the exact feed's routed prompts) -> when the belief
        ends unless an event confirms it; oldest first. Always a subset of ``_seen``:
        they count against ``capacity_blocks``, as the engine makes room for a prompt by
        evicting (a belief beyond the capacity would send requests to blocks the engine
        has already evicted)."""
        self._displaced: OrderedDict[int, float] = OrderedDict()
        """Blocks the engine's events reported, pushed out of the capacity by
        provisional ones -> last seen, oldest first. Not believed (absent from
        ``owners``), since the engine evicts to make room as well; but it evicts by its
        own order, which its events tell: one it reports gone is dropped here, and the
        others come back (at the least recently used end) as room returns. At most as
        many as there are provisional blocks."""

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, key: int) -> bool:
        return key in self._seen

    def knows(self, key: int) -> bool:
        """Whether ``key`` is believed cached here or was reported and only displaced
        (a ``BlockStored`` chained on it can still be followed)."""
        return key in self._seen or key in self._displaced

    def last_seen(self, key: int) -> float | None:
        return self._seen.get(key)

    def _oldest(self, count: int) -> list[int]:
        """The ``count`` least recently used keys (fewer if there are not as many)."""
        front = self._front
        if not front:
            return list(islice(self._seen, count))
        oldest = list(islice(front, count))
        if len(oldest) < count:
            rest = (key for key in self._seen if key not in front)
            oldest.extend(islice(rest, count - len(oldest)))
        return oldest

    def store(self, keys: Sequence[int], now: float) -> None:
        """``keys`` (one prompt's chain, root first) are cached here as of ``now``.

        Stored deepest first, so that the root ends most recent: eviction then takes a
        prompt's last blocks before the blocks every longer prompt needs first. A key
        that repeats in ``keys`` ends where its first occurrence puts it.
        """
        if self._displaced:
            deque(map(self._displaced.pop, keys, repeat(None)), maxlen=0)
        if self._front:
            deque(map(self._front.pop, keys, repeat(None)), maxlen=0)
        seen = self._seen
        size = len(seen)
        # Take every key out (None: it was not here), put them back deepest first; the
        # sizes tell how many were new and whether a key repeats, in O(1).
        was = list(map(seen.pop, keys, repeat(None)))
        taken_out = len(seen)
        seen.update(zip(reversed(keys), repeat(now)))
        new = len(seen) - size
        repeats = len(seen) - taken_out != len(keys)
        if repeats:
            # update left a repeated key at its deepest occurrence: to its shallowest
            for key in reversed(keys):
                del seen[key]
                seen[key] = now
        if new:
            # Usually the new keys are the prompt's last ones (after its cached prefix).
            first_new = len(keys) - new
            fresh: Sequence[int] = keys[first_new:]
            if repeats or was[first_new:].count(None) != new:
                fresh = list(compress(keys, map(is_, was, repeat(None))))
            # Own the new keys: one setdefault each; if other ranks hold some too (their
            # setdefault returned their mask), or this rank's bit into every mask.
            owners, bit = self._owners, self._bit
            masks = list(map(owners.setdefault, fresh, repeat(bit)))
            if masks.count(bit) != len(masks):
                owners.update(zip(fresh, map(or_, masks, repeat(bit)), strict=True))
        self._evict_over_capacity()

    def _evict_over_capacity(self) -> None:
        excess = len(self._seen) - self.capacity_blocks
        if excess <= 0:
            return
        victims = self._oldest(excess)
        provisional, displaced = self._provisional, self._displaced
        if provisional:
            # A reported block pushed out by a belief is kept aside (see ``_displaced``).
            seen = self._seen
            for key in victims:
                if provisional.pop(key, None) is None and provisional:
                    displaced[key] = seen[key]
        self._forget(victims)
        while len(displaced) > len(provisional):
            displaced.popitem(last=False)

    def _restore_displaced(self) -> None:
        """Room came back: believe the most recent displaced blocks again, as the least
        recently used (they were, when they were pushed out)."""
        seen, displaced, front = self._seen, self._displaced, self._front
        room = self.capacity_blocks - len(seen)
        restored = []
        while room > 0 and displaced:
            key, last = displaced.popitem()
            seen[key] = last
            front[key] = None
            front.move_to_end(key, last=False)
            restored.append(key)
            room -= 1
        if restored:
            self._own(restored)

    def _own(self, keys: list[int]) -> None:
        owners, bit = self._owners, self._bit
        owners.update(
            zip(keys, map(or_, map(owners.get, keys, repeat(0)), repeat(bit)), strict=True)
        )

    def _forget(self, keys: list[int]) -> None:
        """Drop ``keys`` (all held here, distinct) and this rank's bit from their owners."""
        deque(map(self._seen.__delitem__, keys), maxlen=0)
        if self._front:
            deque(map(self._front.pop, keys, repeat(None)), maxlen=0)
        # Out of the owners map with one pop each; back with the other ranks' bits for
        # those that other ranks hold too (a mask other than this rank's bit alone).
        owners, bit = self._owners, self._bit
        masks = list(map(owners.pop, keys, repeat(0)))
        if masks.count(bit) != len(masks):
            others = list(map(and_, masks, repeat(~bit)))
            owners.update(zip(compress(keys, others), compress(others, others), strict=False))

    def remove(self, keys: Iterable[int]) -> None:
        """Forget ``keys`` (the engine evicted them, or a belief ended)."""
        seen, provisional, displaced = self._seen, self._provisional, self._displaced
        held = []
        for key in dict.fromkeys(keys):
            if key in seen:
                held.append(key)
                provisional.pop(key, None)
            else:
                displaced.pop(key, None)
        if held:
            self._forget(held)
        if displaced:
            self._restore_displaced()

    def clear(self) -> None:
        self._forget(list(self._seen))
        self._provisional.clear()
        self._displaced.clear()

    def store_provisionally(self, keys: Sequence[int], now: float, until: float) -> None:
        """:meth:`store` ``keys`` on belief: those not already known from events are
        forgotten at ``until`` unless :meth:`confirm` comes first."""
        self.expire_provisional(now)
        provisional, displaced = self._provisional, self._displaced
        for key in keys:
            if key in displaced:
                continue  # reported by the engine: :meth:`store` takes it back as such
            if key not in self._seen or key in provisional:
                provisional.pop(key, None)
                provisional[key] = until  # re-inserted: the dict stays oldest first
        self.store(keys, now)

    def confirm(self, keys: Iterable[int]) -> None:
        """``keys`` are known from events now, not on belief."""
        for key in keys:
            self._provisional.pop(key, None)

    def expire_provisional(self, now: float) -> None:
        """Forget the provisional blocks whose time is up and that no event confirmed."""
        provisional = self._provisional
        expired = []
        for key, until in provisional.items():
            if until > now:
                break
            expired.append(key)
        for key in expired:
            del provisional[key]
        self.remove(expired)

    def expire(self, now: float) -> None:
        """Forget blocks last seen more than ``max_age`` before ``now`` (oldest first)."""
        displaced = self._displaced
        while displaced and now - next(iter(displaced.values())) > self.max_age:
            displaced.popitem(last=False)
        seen, front, max_age = self._seen, self._front, self.max_age
        if not seen or now - seen[next(iter(front or seen))] <= max_age:
            return  # the least recently used is young enough: all are
        order = chain(front, (key for key in seen if key not in front)) if front else seen
        expired = list(takewhile(lambda key: not now - seen[key] <= max_age, order))
        if expired:
            provisional = self._provisional
            if provisional:
                for key in expired:
                    provisional.pop(key, None)
            self._forget(expired)

    def matched_blocks(self, keys: Sequence[int], now: float) -> int:
        """How many leading blocks of ``keys`` are cached here (chained: stops at a miss)."""
        self.expire(now)
        return len(list(takewhile(self._seen.__contains__, keys)))


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


def decode_kv_event_frames(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of one message of vLLM's ``ZmqEventPublisher`` (``topic``,
    ``seq`` as 8 bytes big-endian, the ``EventBatch``); :class:`KVEventError` if it is
    not three frames with an 8-byte sequence number."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KVEventError(
            f"a KV-event message is (topic, 8-byte seq, payload); got {len(frames)} frames"
        )
    return int.from_bytes(frames[1], "big"), frames[2]


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


@dataclass(frozen=True)
class PrefixRouting:
    """The prefix policy's settings (``EngineChooser(..., prefix=PrefixRouting(...))``).

    ``block_size``: tokens per block, as the engines' ``--block-size`` (vLLM: 16); only
    full blocks are matched. ``capacity_blocks``: blocks remembered per rank; set it to
    the engines' KV-cache size in blocks (vLLM logs it as ``# GPU blocks``), since an
    index larger than the real cache believes evicted blocks are still there (the
    default, 16,384 blocks = 262,144 tokens, is a mid-size GPU's; the index costs about
    250 bytes a block). ``max_age``: seconds after which an unseen block is forgotten
    (within ``max_age / 8`` more), the bound on stale beliefs when events are lost.
    ``imbalance_abs`` (tokens) and ``imbalance_rel``: when the busiest rank's queued
    work exceeds the idlest's by more than ``imbalance_abs`` *and* by a factor of more
    than ``imbalance_rel``, the loads are imbalanced beyond what affinity may cost and
    the guard sends the request to the least loaded rank (SGLang's cache-aware router
    has the same two thresholds, in requests). The defaults, 4,096 tokens and 3x, lose
    least in the worst case of sweeps on the lock-step model and the process fleet
    (``benchmarks/README.md``, the routing section); no setting is best everywhere. With
    caches of two documents a rank, a guard that never fires (SGLang's 32,768) left most
    of 64 ranks idle behind the holders of a few shared documents (2.3x vLLM's
    throughput, against 4.8x); with caches twice as large the default costs a fifth
    there instead (7.3x against 9.0x); a tighter guard (2x, 1.5x, or 3,072 tokens)
    broke up conversations for nothing (multi-turn up to 15 % slower, and on the
    fleet, whose load reports lag, 4 points of hit rate). ``feed``: ``"approximate"`` takes every
    routed prompt as cached on its rank; ``"exact"`` learns from the engines' KV
    events (:meth:`~trio_dpcoord.EngineChooser.receive_kv_events`), and takes a routed
    prompt's new blocks as cached *provisionally*, for ``provisional_age`` seconds
    (``max_age`` at most; within ``provisional_age / 8`` more), until the rank's events
    confirm them: an engine stores a prompt's blocks only when it computes them, after
    its queue, and without the provisional belief the next turn of a conversation
    routed before that would find nothing anywhere (0: events only).
    Provisional blocks count against ``capacity_blocks`` as the engine's own do (it
    makes room for a prompt by evicting); the reported blocks they push out are kept
    aside, unbelieved, until the events say which ones the engine evicted, so the index
    remembers at most twice ``capacity_blocks`` a rank and believes at most that.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    capacity_blocks: int = 16384
    max_age: float = 600.0
    imbalance_abs: float = 4096.0
    imbalance_rel: float = 3.0
    feed: Feed = "approximate"
    provisional_age: float = 10.0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if not self.max_age > 0:
            raise ValueError(f"max_age must be > 0, got {self.max_age}")
        if not self.imbalance_abs >= 0 or not self.imbalance_rel >= 1:
            raise ValueError("need imbalance_abs >= 0 and imbalance_rel >= 1")
        if self.feed not in ("approximate", "exact"):
            raise ValueError(f"feed must be 'approximate' or 'exact', got {self.feed!r}")
        if not self.provisional_age >= 0:
            raise ValueError(f"provisional_age must be >= 0, got {self.provisional_age!r}")


@dataclass
class RouterCounters:
    """What the router did: decisions (pinned ones included), the prompt tokens they
    routed and how many of those were believed cached on the chosen rank, guard
    fallbacks, KV-event batches applied, rejected (undecodable or from an unknown rank)
    and sequence gaps (lost or reordered batches, each of which forgot that rank's
    exact knowledge)."""

    decisions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    guard_fallbacks: int = 0
    event_batches: int = 0
    rejected_event_batches: int = 0
    event_gaps: int = 0


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """One choice: the rank, the prompt's tokens believed cached there, and whether the
    imbalance guard made it (least loaded, affinity ignored)."""

    rank: int
    cached_tokens: int
    guarded: bool


@dataclass
class _ExactRank:
    last_seq: int | None = None
    vllm_to_ours: dict[Any, tuple[int, int]] = field(default_factory=dict)
    """vLLM's block hash -> (our key, the block's depth in its chain)."""


def first_from(values: Sequence[float], value: float, start: int) -> int:
    """The first index of ``value`` at or after ``start``, wrapping around."""
    try:
        return values.index(value, start)
    except ValueError:
        return values.index(value)


_FEW_RANKS = 1
"""The walk counts the runs of this many ranks or fewer in their own indexes. With the
keys out of the CPU's caches (a large fleet), a C-level lookup in one rank's index costs
about half a Python-level step in the shared map, which answers for every rank at once
(measured at 256 ranks, 240 blocks matched: a lone rank's run 37 us in its index, 75 us
in the map; two ranks' runs about 75 us either way)."""


def _busiest_but(queued: Sequence[float], top: int, high: float, low: float) -> float:
    """The highest work of the ranks other than ``top``, the first busiest (at ``high``;
    the idlest is at ``low``)."""
    if queued.count(high) > 1:
        return high
    rest = list(queued)
    rest[top] = low
    return max(rest)


class PrefixRouter:
    """Chooses the rank that keeps the busiest rank's work lowest.

    A rank's work is its queued work (``queued_work``, in tokens, passed in) plus, for
    the rank that would take the request, the request's uncached prompt tokens there:
    with ranks stepping in lock-step, every step lasts as long as the busiest rank's, so
    that is the cost to minimise. Ties go to the most cached tokens, then to the rank
    whose own work ends lowest, then to rotation (a start that advances by one per
    decision). With nothing cached anywhere that is exactly the least loaded rank. When
    the ranks' queued work is imbalanced beyond both thresholds (see
    :class:`PrefixRouting`) the guard chooses the least loaded rank. A pinned rank is
    returned as is. Every routed or pinned prompt is learnt on its rank with
    ``feed="approximate"``; ``feed="exact"`` learns from :meth:`receive_kv_events`
    (and, until they are due, believes its own decisions provisionally).
    """

    def __init__(self, ranks: int, routing: PrefixRouting | None = None, *, start: int = 0) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.routing = routing if routing is not None else PrefixRouting()
        self.block_size = self.routing.block_size
        self.feed: Feed = self.routing.feed
        self._owners: dict[int, int] = {}
        """Block key -> bit mask of the ranks believed to hold it."""
        self._all = 0
        self._byte_ranks: list[list[tuple[int, ...]]] = []
        self.indexes: list[RankPrefixIndex] = []
        self._exact: list[_ExactRank] = []
        self.ranks = 0
        self.resize(ranks)
        self._rotation = start % ranks
        self._next_sweep = -float("inf")
        self._next_belief_sweep = -float("inf")
        self.counters = RouterCounters()

    def resize(self, ranks: int) -> None:
        """Elastic EP: follow a new rank count (ranks beyond it are forgotten)."""
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        for index in self.indexes[ranks:]:
            index.clear()
        del self.indexes[ranks:], self._exact[ranks:]
        routing = self.routing
        for rank in range(len(self.indexes), ranks):
            self.indexes.append(
                RankPrefixIndex(
                    routing.capacity_blocks, routing.max_age, bit=1 << rank, owners=self._owners
                )
            )
            self._exact.append(_ExactRank())
        self.ranks = ranks
        self._all = (1 << ranks) - 1
        width = (ranks + 7) // 8
        self._byte_ranks = [
            [tuple(8 * offset + i for i in range(8) if byte >> i & 1) for byte in range(256)]
            for offset in range(width)
        ]
        self._rotation = getattr(self, "_rotation", 0) % ranks

    @property
    def stored_blocks(self) -> int:
        """Blocks remembered over all ranks (each at most ``capacity_blocks``)."""
        return sum(len(index) for index in self.indexes)

    def cached_tokens(self, rank: int, token_ids: Sequence[int], now: float) -> int:
        """The leading tokens of ``token_ids`` believed cached on ``rank`` at ``now``."""
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
        return self.route(token_ids, queued_work, now, pinned_rank).rank

    def route(
        self,
        token_ids: Sequence[int],
        queued_work: Sequence[float],
        now: float,
        pinned_rank: int | None = None,
    ) -> RouteDecision:
        """:meth:`choose`, with how much was cached there and whether the guard chose."""
        if len(queued_work) != self.ranks:
            raise ValueError(f"queued_work has {len(queued_work)} ranks, expected {self.ranks}")
        if pinned_rank is not None and not 0 <= pinned_rank < self.ranks:
            raise ValueError(f"pinned rank {pinned_rank} out of range 0..{self.ranks - 1}")
        self.counters.decisions += 1
        keys = block_keys(token_ids, self.block_size)
        if now >= self._next_sweep:
            for index in self.indexes:
                index.expire(now)
            self._next_sweep = now + self.routing.max_age / 8
        if self.feed == "exact" and self.routing.provisional_age and now >= self._next_belief_sweep:
            # Every rank's due beliefs end, not only the chosen rank's: a rank no
            # request went to since must not keep a belief no event confirmed.
            for index in self.indexes:
                index.expire_provisional(now)
            self._next_belief_sweep = now + self.routing.provisional_age / 8
        groups = self._walk(keys)
        if pinned_rank is not None:
            depth = self._depth_of(groups, pinned_rank)
            decision = RouteDecision(pinned_rank, depth * self.block_size, False)
        else:
            decision = self._pick(groups, len(token_ids), queued_work)
        self.counters.prompt_tokens += len(token_ids)
        self.counters.cached_tokens += decision.cached_tokens
        if keys:
            if self.feed == "approximate":
                self.indexes[decision.rank].store(keys, now)
            elif self.routing.provisional_age > 0:
                # the exact feed's belief in a prompt just routed, until events are due
                until = now + min(self.routing.provisional_age, self.routing.max_age)
                self.indexes[decision.rank].store_provisionally(keys, now, until)
        return decision

    def _walk(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """The ranks holding a prefix of ``keys``, as (leading blocks held, bit mask of
        the ranks holding exactly that many), deepest last; ranks holding none omitted.

        Once one rank is left (:data:`_FEW_RANKS`), the rest of its run is counted in its
        own index (a small dict, C-level) rather than key by key in the shared map of
        every rank's blocks.
        """
        owners = self._owners.get
        alive = self._all
        groups: list[tuple[int, int]] = []
        depth = 0
        for key in keys:
            mask = owners(key, 0) & alive
            if mask != alive:
                if depth:
                    groups.append((depth, alive ^ mask))
                alive = mask
                if not alive:
                    return groups
                if alive.bit_count() <= _FEW_RANKS:
                    return self._runs(groups, keys, depth + 1, alive)
            depth += 1
        if depth:
            groups.append((depth, alive))
        return groups

    def _runs(
        self, groups: list[tuple[int, int]], keys: Sequence[int], held: int, ranks: int
    ) -> list[tuple[int, int]]:
        """``groups`` and then the ranks of the mask ``ranks`` by their runs in their own
        indexes (each holds the first ``held`` of ``keys``)."""
        rest = keys[held:]
        masks: dict[int, int] = {}
        for rank in self._members(ranks):
            contains = self.indexes[rank]._seen.__contains__
            depth = held + len(list(takewhile(contains, rest)))
            masks[depth] = masks.get(depth, 0) | 1 << rank
        groups.extend(sorted(masks.items()))
        return groups

    def _depth_of(self, groups: list[tuple[int, int]], rank: int) -> int:
        bit = 1 << rank
        for depth, mask in groups:
            if mask & bit:
                return depth
        return 0

    def _members(self, mask: int) -> list[int]:
        """The ranks of ``mask``, ascending (a byte at a time, through a table)."""
        if not mask & (mask - 1):
            return [mask.bit_length() - 1]
        table = self._byte_ranks
        members: list[int] = []
        for offset, byte in enumerate(mask.to_bytes(len(table), "little")):
            if byte:
                members.extend(table[offset][byte])
        return members

    def _pick(
        self, groups: list[tuple[int, int]], prompt_len: int, queued: Sequence[float]
    ) -> RouteDecision:
        ranks = self.ranks
        start = self._rotation
        self._rotation = (start + 1) % ranks
        block = self.block_size
        low, high = min(queued), max(queued)
        least = first_from(queued, low, start)
        least_depth = self._depth_of(groups, least)
        if ranks == 1:
            return RouteDecision(0, least_depth * block, False)
        routing = self.routing
        if high - low > routing.imbalance_abs and high > routing.imbalance_rel * max(low, 1.0):
            self.counters.guard_fallbacks += 1
            return RouteDecision(least, least_depth * block, True)
        # A rank holding no more than the least loaded one cannot beat it; of the ranks
        # holding the same deeper prefix, only the least loaded one (rotation on ties)
        # can: the candidates are one per depth.
        candidates = [(least, least_depth)]
        for depth, mask in groups:
            if depth > least_depth:
                members = self._members(mask)
                if len(members) == 1:
                    candidates.append((members[0], depth))
                    continue
                value = min(map(queued.__getitem__, members))
                cut = bisect_left(members, start)
                for rank in chain(islice(members, cut, None), islice(members, cut)):
                    if queued[rank] == value:
                        candidates.append((rank, depth))
                        break
        if len(candidates) == 1:
            return RouteDecision(least, least_depth * block, False)
        # Placing on r leaves the busiest at max(the busiest other rank, r's own work):
        # the busiest other than the first busiest rank is needed only if it is a candidate.
        top = queued.index(high)
        best: tuple[float, int, float, int] | None = None
        chosen, chosen_depth = least, least_depth
        for rank, depth in candidates:
            cached = depth * block
            own = queued[rank] + prompt_len - cached
            others = high if rank != top else _busiest_but(queued, top, high, low)
            candidate = (max(others, own), -cached, own, (rank - start) % ranks)
            if best is None or candidate < best:
                best, chosen, chosen_depth = candidate, rank, depth
        return RouteDecision(chosen, chosen_depth * block, False)

    def receive_kv_events(self, rank: int, seq: int, payload: bytes, now: float) -> bool:
        """Apply one engine's KV-event batch (``seq`` from the PUB frame); False if rejected.

        A sequence gap or step back means lost or reordered batches: the rank's exact
        knowledge is forgotten, since what it would now claim could be stale. Rejected
        batches are logged at WARNING and counted; nothing else changes.
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
                if event.block_size != self.block_size:
                    continue  # keys of another block size never match our prompts'
                parent, depth = _ROOT, 0
                if event.parent_block_hash is not None:
                    known = state.vllm_to_ours.get(event.parent_block_hash)
                    if known is None or not index.knows(known[0]):
                        continue  # parent unknown: the chain cannot be matched anyway
                    parent, depth = known[0], known[1] + 1
                ours = block_keys(event.token_ids, event.block_size, parent, depth)
                for offset, (theirs, key) in enumerate(zip(event.block_hashes, ours, strict=True)):
                    state.vllm_to_ours[theirs] = (key, depth + offset)
                index.confirm(ours)
                index.store(ours, now)
            elif isinstance(event, BlockRemoved):
                gone = (state.vllm_to_ours.pop(h, None) for h in event.block_hashes)
                index.remove(known[0] for known in gone if known is not None)
            else:
                index.clear()
                state.vllm_to_ours.clear()
        if len(state.vllm_to_ours) > 2 * index.capacity_blocks:
            state.vllm_to_ours = {
                h: known for h, known in state.vllm_to_ours.items() if index.knows(known[0])
            }
        return True
