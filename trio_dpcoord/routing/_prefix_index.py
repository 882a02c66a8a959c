"""The per-rank prefix index of the prefix policy, and the block keys it is keyed by.

Plain objects, no I/O and no clock of their own: inputs are prompts' token ids, per-rank
queued work, vLLM KV-cache event batches and clock readings; the output is a rank.
:class:`~trio_dpcoord.EngineChooser` with ``routing="prefix"`` is how front-ends use it.

The index keys every full block of ``block_size`` prompt tokens by our own hash chained on
its parent block's key, so no hash seed has to be shared with vLLM. Memory per rank is
bounded by ``capacity_blocks`` (least recently used go first, the deepest block of a
prompt before its parents) and by ``max_age`` (a block not seen for that long is
forgotten), so a lost event batch cannot leave blocks believed cached for ever; a gap or
a step back in a rank's event sequence also forgets that rank's exact knowledge at once.

One decision hashes the prompt's whole chunks as tuples (their keys come from
:class:`ChunkKeys`' cache), keys block by block only as far as some rank holds the
prompt (the rest when the prompt is stored), and bisects a block -> ranks map (or walks
it from the first block, once KV events may have left a rank holding a block without
its parent): its cost grows with the prompt, not with the number of ranks times the
prompt.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import chain, compress, islice, repeat, takewhile
from operator import and_, is_, itemgetter, or_

from .._compiled import accelerate
from ._keys import (
    CHUNK_BLOCKS,
    DEFAULT_BLOCK_SIZE,
    ROOT_KEY,
    ChunkedKeys,
    ChunkKeys,
    Feed,
    block_keys,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CHUNK_BLOCKS",
    "DEFAULT_BLOCK_SIZE",
    "ROOT_KEY",
    "ChunkKeys",
    "ChunkedKeys",
    "Feed",
    "RankPrefixIndex",
    "block_keys",
]

PIECE_BLOCKS = 64
"""Blocks per piece of a chain-mode index at most (see :class:`_Piece`)."""


class _Piece:
    """Keys of one chain that were stored together, hence equally recent: ``keys`` from
    depth ``lo`` on, within one stretch of :data:`PIECE_BLOCKS` (so at most that many).

    Larger pieces are fewer objects to make and move; a smaller one is fewer keys to
    point at a new piece when a prompt's cached prefix ends inside one (it splits)."""

    __slots__ = ("keys", "lo", "time")

    def __init__(self, keys: list[int], lo: int, time: float) -> None:
        self.keys = keys
        self.lo = lo
        self.time = time


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

    In chain mode (:meth:`_chain_mode`, which a router with the approximate feed uses),
    every store is a prompt's whole chain, root first, and the index keeps the same
    order in pieces instead (see ``_held``): refreshing a prompt's cached prefix moves
    one piece per 64 blocks (:data:`PIECE_BLOCKS`), not every key, so a decision's cost
    no longer touches every block the rank holds of the prompt (at 256 ranks, each such
    touch is a cache miss). Anything but chains and expiry (:meth:`remove`, beliefs)
    turns the pieces back into the plain order first (:meth:`_materialize`).
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
        self._held: dict[int, _Piece] | None = None
        """Chain mode (not None), instead of ``_seen``: each piece's first key -> the
        piece (a store finds the held prefix's pieces by their first keys; whether a key
        is held here is this rank's bit in ``owners``), so a stored or evicted key costs
        no write here, only in ``owners``."""
        self._count = 0
        """Chain mode: the keys held (in the pieces)."""
        self._pieces: dict[_Piece, None] = {}
        """Chain mode: the pieces, least recently used first; within a piece, its keys
        deepest first (a store's order: see :meth:`store`). The plain order, in pieces."""
        self._displaced: OrderedDict[int, float] = OrderedDict()
        """Blocks the engine's events reported, pushed out of the capacity by
        provisional ones -> last seen, oldest first. Not believed (absent from
        ``owners``), since the engine evicts to make room as well; but it evicts by its
        own order, which its events tell: one it reports gone is dropped here, and the
        others come back (at the least recently used end) as room returns. At most as
        many as there are provisional blocks."""

    def __len__(self) -> int:
        return len(self._seen) if self._held is None else self._count

    def __contains__(self, key: int) -> bool:
        if self._held is None:
            return key in self._seen
        return bool(self._owners.get(key, 0) & self._bit)  # chain mode: the owners map

    def knows(self, key: int) -> bool:
        """Whether ``key`` is believed cached here or was reported and only displaced
        (a ``BlockStored`` chained on it can still be followed)."""
        return key in self or key in self._displaced

    def last_seen(self, key: int) -> float | None:
        if self._held is None:
            return self._seen.get(key)
        if key not in self:
            return None
        for piece in self._pieces:  # chain mode: a diagnostic's search
            if key in piece.keys:
                return piece.time
        return None

    def _oldest(self, count: int) -> list[int]:
        """The ``count`` least recently used keys (fewer if there are not as many)."""
        if self._held is not None:
            oldest: list[int] = []
            for piece in self._pieces:
                if len(oldest) >= count:
                    break
                oldest.extend(reversed(piece.keys))
            return oldest[:count]
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
        if self._held is not None:
            # the leading keys this rank holds: its bit in their masks, at C level
            masks = map(self._owners.get, keys, repeat(0))
            held = len(list(takewhile(partial(and_, self._bit), masks)))
            self._store_chain(keys, held, now)
            return
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
            self._own_new(fresh)
        self._evict_over_capacity()

    def _own_new(self, fresh: Sequence[int]) -> None:
        """This rank's bit for keys new here: one setdefault each; if other ranks hold
        some too (their setdefault returned their mask), or the bit into every mask."""
        owners, bit = self._owners, self._bit
        masks = list(map(owners.setdefault, fresh, repeat(bit)))
        if masks.count(bit) != len(masks):
            owners.update(zip(fresh, map(or_, masks, repeat(bit)), strict=True))

    def _chain_mode(self) -> None:
        """Keep the order in pieces from now on (see the class docstring); the index
        must be empty. Only a router whose stores are all prompts' chains sets it."""
        if len(self):
            raise ValueError("chain mode starts empty")
        self._held = {}

    def _store_chain(self, keys: Sequence[int], held: int, now: float) -> None:
        """:meth:`store` in chain mode, ``keys`` being a chain from the root of which the
        first ``held`` are held here (as :meth:`_walk` found). The same order results:
        the new keys in pieces of their own, each chunk's deepest first, then the held
        prefix's pieces (split where the prefix ends inside one), deepest first, all at
        the recent end; then the least recent keys go beyond the capacity."""
        pieces, by_key = self._pieces, self._held
        assert by_key is not None
        # keys[k] is chunks[k // span][k % span], without a Python-level call per key
        chunks: Sequence[Sequence[int]] = [keys]
        span = max(1, len(keys))
        if isinstance(keys, ChunkedKeys):
            chunks, span = keys.chunks, CHUNK_BLOCKS
        refreshed: list[_Piece] = []
        depth = 0
        while depth < held:  # the held prefix's pieces, root first
            piece = by_key.get(chunks[depth // span][depth % span])
            if piece is None or piece.lo != depth:  # not a chain here (a key collision)
                self._materialize()
                self.store(keys, now)
                return
            refreshed.append(piece)
            depth += len(piece.keys)
        count = len(keys)
        fresh = list(keys[held:])
        # The new keys, a piece per stretch of PIECE_BLOCKS (or the part of one from ``held``).
        boundary = (held // PIECE_BLOCKS + 1) * PIECE_BLOCKS
        new: list[_Piece] = []
        if not fresh:
            pass
        elif count <= boundary:  # one piece (a follow-up turn's new blocks, usually)
            new.append(_Piece(fresh, held, now))
            by_key[fresh[0]] = new[0]
        else:
            starts = [held, *range(boundary, count, PIECE_BLOCKS)]
            ends = [*starts[1:], count]
            runs = [fresh[a - held : b - held] for a, b in zip(starts, ends, strict=True)]
            new = list(map(_Piece, runs, starts, repeat(now)))
            by_key.update(zip(map(itemgetter(0), runs), new, strict=True))
        self._count += len(fresh)
        if refreshed and depth > held:  # the last piece runs past the prefix: split it
            last = refreshed[-1]
            cut = held - last.lo
            part = _Piece(last.keys[:cut], last.lo, now)
            del last.keys[:cut]
            last.lo = held
            by_key[part.keys[0]] = part
            by_key[last.keys[0]] = last
            refreshed[-1] = part
        if len(new) == 1:
            pieces[new[0]] = None
        else:
            pieces.update(zip(reversed(new), repeat(None)))
        for piece in reversed(refreshed):
            pieces.pop(piece, None)  # (the split-off part is not in yet)
            piece.time = now
            pieces[piece] = None
        if fresh:
            self._own_new(fresh)
        excess = self._count - self.capacity_blocks
        if excess > 0:
            self._evict_pieces(excess)

    def _evict_pieces(self, count: int) -> None:
        """Chain mode: forget the ``count`` least recently used keys."""
        pieces, by_key = self._pieces, self._held
        assert by_key is not None
        victims: list[int] = []
        emptied: list[_Piece] = []
        # One pass from the front (a dict skips its deleted entries at every new iter)
        for piece in pieces:
            keys, need = piece.keys, count - len(victims)
            if len(keys) > need:
                victims += keys[len(keys) - need :]
                del keys[len(keys) - need :]
                break
            victims += keys
            emptied.append(piece)
            if len(keys) == need:
                break
        deque(map(pieces.__delitem__, emptied), maxlen=0)
        for piece in emptied:
            if by_key.get(piece.keys[0]) is piece:
                del by_key[piece.keys[0]]
        self._count -= len(victims)
        self._disown(victims)

    def _materialize(self) -> None:
        """Leave chain mode: the pieces become the plain order (same keys, times, order)."""
        if self._held is None:
            return
        seen: dict[int, float] = {}
        for piece in self._pieces:
            seen.update(zip(reversed(piece.keys), repeat(piece.time)))
        self._seen = seen
        self._held = None
        self._pieces = {}
        self._count = 0

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
        self._disown(keys)

    def _disown(self, keys: list[int]) -> None:
        """This rank's bit out of the masks of ``keys`` (distinct, no longer held)."""
        # Out of the owners map with one pop each; back with the other ranks' bits for
        # those that other ranks hold too (a mask other than this rank's bit alone).
        owners, bit = self._owners, self._bit
        masks = list(map(owners.pop, keys, repeat(0)))
        if masks.count(bit) != len(masks):
            others = list(map(and_, masks, repeat(~bit)))
            owners.update(zip(compress(keys, others), compress(others, others), strict=False))

    def remove(self, keys: Iterable[int]) -> None:
        """Forget ``keys`` (the engine evicted them, or a belief ended)."""
        if self._held is not None:
            keys = list(keys)
            if not keys:
                return
            self._materialize()
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
        if self._held is not None:
            self._disown(list(chain.from_iterable(piece.keys for piece in self._pieces)))
            self._held.clear()
            self._pieces.clear()
            self._count = 0
            return
        self._forget(list(self._seen))
        self._provisional.clear()
        self._displaced.clear()

    def store_provisionally(self, keys: Sequence[int], now: float, until: float) -> None:
        """:meth:`store` ``keys`` on belief: those not already known from events are
        forgotten at ``until`` unless :meth:`confirm` comes first."""
        self._materialize()
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
        if self._held is not None:
            due = 0
            for piece in self._pieces:
                if now - piece.time <= self.max_age:
                    break
                due += len(piece.keys)
            if due:
                self._evict_pieces(due)
            return
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
        held = self._seen.__contains__ if self._held is None else self.__contains__
        return len(list(takewhile(held, keys)))

    # --- read-only views (tests, diagnostics): copies, never the index's own state ---------

    def blocks(self) -> dict[int, float]:
        """Every block believed cached here -> when it was last seen, least recently used
        first (the order eviction takes them in). A copy."""
        if self._held is not None:
            return {key: piece.time for piece in self._pieces for key in reversed(piece.keys)}
        last_seen = self.last_seen
        return {key: last_seen(key) or 0.0 for key in self._oldest(len(self))}

    def provisional_blocks(self) -> dict[int, float]:
        """The blocks of :meth:`blocks` held on belief only (the exact feed's routed
        prompts) -> when the belief ends unless an event confirms it, oldest first. A copy."""
        return dict(self._provisional)

    def displaced_blocks(self) -> dict[int, float]:
        """Blocks the engine reported, pushed out of the capacity by provisional ones and
        not believed cached -> when last seen, oldest first; they come back as room
        returns. A copy."""
        return dict(self._displaced)


accelerate(globals(), "trio_dpcoord.routing._prefix_index_kernel")  # the compiled twin, if built
