"""The block keys of the prefix policy: every full block of ``block_size`` prompt tokens
keyed by our own hash chained on its parent block's key (no hash seed shared with vLLM),
and :class:`ChunkKeys`, which keys a prompt's whole chunks from a cache so that a
repeated prefix costs a lookup, not a hash per block. Plain objects, no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate, chain, islice
from operator import xor
from typing import Literal, overload

from .._compiled import accelerate

__all__ = [
    "CHUNK_BLOCKS",
    "DEFAULT_BLOCK_SIZE",
    "ROOT_KEY",
    "ChunkKeys",
    "ChunkedKeys",
    "Feed",
    "block_keys",
]


DEFAULT_BLOCK_SIZE = 16
"""vLLM's default KV-cache block size."""

Feed = Literal["approximate", "exact"]

ROOT_KEY = 0
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
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY, depth: int = 0
) -> list[int]:
    """Chained keys of the full blocks of ``token_ids`` (a partial last block has none).

    Key ``i`` is ``parent`` xor, over blocks ``j <= i``, the hash of block ``j``'s tokens
    together with the salt of its position ``depth + j``: a running xor, so that hashing
    and chaining a prompt take one C-level pass each (Python's hash of a tuple of ints
    does not depend on the process's hash seed). ``parent``/``depth`` continue a chain
    (a vLLM ``BlockStored`` whose parent block is known). Distinct prefixes collide
    about as often as random 64-bit values do (none among 320,000 sequences of a few
    blocks in every order, measured); a collision only misroutes one request.

    Xor, not a sum: the tuple hash's last round adds its last item, the salt, and
    multiplies, so a block's hash is nearly its own part plus its position's; summed,
    the positions nearly cancel out and a key hardly depends on its blocks' order (the
    same two blocks in swapped places shared a key a third of the time; the 4,096
    orders of six blocks drawn from four, 590 keys).
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
        return list(accumulate(hashes, xor))
    keys = list(accumulate(hashes, xor, initial=parent))
    del keys[0]
    return keys


def chunk_hashes(token_ids: Sequence[int], span: int) -> Iterator[int]:
    """The hash of each full chunk of ``span`` tokens as a tuple, lazily (zip builds each
    tuple from the tokens: no slice copied per chunk); a partial last chunk has none."""
    return map(hash, zip(*(iter(token_ids),) * span, strict=False))


CHUNK_BLOCKS = 16
"""Blocks per chunk of :class:`ChunkKeys`' cache (256 tokens at vLLM's block size)."""


class ChunkedKeys(Sequence[int]):
    """A prompt's keys in lists of :data:`CHUNK_BLOCKS` (the last may be shorter), as
    :class:`ChunkKeys` gives them: the cached chunks are its own lists, not copied, so
    a prompt's keys cost one reference a chunk rather than one a key (each a write to
    the key's int object, out of the CPU's caches at 256 ranks).

    From :meth:`ChunkKeys.lookup` they may be *incomplete*: only the leading chunks the
    cache knew (``known`` blocks) are computed, the rest when first needed (an index or a
    slice past them, iteration, :meth:`complete`), so that a decision hashes no more of a
    prompt than its walk reads (:meth:`probe` keys the one block after the known chunks);
    the cache learns the prompt's new chunks when they are completed."""

    __slots__ = ("_length", "_rest", "chunks", "known")

    def __init__(self, chunks: list[list[int]], length: int) -> None:
        self.chunks = chunks
        self._length = length
        self.known = length
        """Leading blocks whose keys are in ``chunks`` (all of them once complete)."""
        self._rest: _Rest | None = None

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[int]:
        if self._rest is not None:
            self.complete()
        return chain.from_iterable(self.chunks)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if self._rest is not None:
            self.complete()
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step != 1 or stop <= start:
                return list(self)[index]
            first, offset = divmod(start, CHUNK_BLOCKS)
            if stop - start <= CHUNK_BLOCKS - offset:  # within one chunk
                return self.chunks[first][offset : offset + stop - start]
            return list(islice(self, start, stop))
        if index < 0:
            index += self._length
        return self.chunks[index // CHUNK_BLOCKS][index % CHUNK_BLOCKS]

    def probe(self) -> int:
        """The key of block ``known`` (the first past the known chunks; it must exist),
        computed alone: one block's hash, not the rest of the prompt's."""
        rest = self._rest
        if rest is None:
            return self[self.known]
        if rest.probe is None:
            size = rest.cache.block_size
            at = rest.start
            salt = _salts(self.known + 1)[self.known]
            rest.probe = rest.parent ^ hash((*rest.tokens[at : at + size], salt))
        return rest.probe

    def extend(self) -> None:
        """Compute the keys of the next chunk past the known ones (``known`` grows by up
        to :data:`CHUNK_BLOCKS`), the rest still on demand."""
        rest = self._rest
        if rest is None:
            return
        size = rest.cache.block_size
        start, stop = rest.start, rest.start + CHUNK_BLOCKS * size
        chunk = block_keys(rest.tokens[start:stop], size, rest.parent, self.known)
        if not chunk:
            self.complete()
            return
        self.chunks.append(chunk)
        self.known += len(chunk)
        rest.start = start + len(chunk) * size
        rest.parent = chunk[-1]
        rest.probe = None
        if self.known == self._length:
            self.complete()

    def complete(self) -> ChunkedKeys:
        """Compute the keys past the known chunks (the cache learns the prompt's new
        chunks then, as :meth:`ChunkKeys.__call__` does); a no-op once complete."""
        return complete_keys(self)


def complete_keys(keys: ChunkedKeys) -> ChunkedKeys:
    """:meth:`ChunkedKeys.complete` (a function, which the compiled twin replaces)."""
    rest = keys._rest
    if rest is None:
        return keys
    keys._rest = None
    cache = rest.cache
    tokens, start, parent = rest.tokens, rest.start, rest.parent
    size = cache.block_size
    computed = block_keys(tokens[start:] if start else tokens, size, parent, start // size)
    out = keys.chunks
    out.extend(computed[at : at + CHUNK_BLOCKS] for at in range(0, len(computed), CHUNK_BLOCKS))
    keys.known = keys._length
    cache._learn(tokens, out, rest.cached, rest.ids)
    return keys


class _Rest:
    """What an incomplete :class:`ChunkedKeys` needs to compute the rest of its keys: the
    prompt's tokens, the first token past the known keys and the last known key; for
    the cache to learn the new chunks, how many chunks it knew (``cached``) and the
    prompt's prefixes' ids as far as taken (see :class:`ChunkKeys`)."""

    __slots__ = ("cache", "cached", "ids", "parent", "probe", "start", "tokens")

    def __init__(
        self,
        cache: ChunkKeys,
        tokens: Sequence[int],
        start: int,
        parent: int,
        cached: int,
        ids: list[int],
    ) -> None:
        self.cache = cache
        self.tokens = tokens
        self.start = start
        self.parent = parent
        self.cached = cached
        self.ids = ids
        self.probe: int | None = None


class ChunkKeys:
    """:func:`block_keys` from ``ROOT_KEY``, with the keys of prompts' leading chunks of
    :data:`CHUNK_BLOCKS` blocks remembered (at most ``max_chunks`` of them, the least
    recently used out first: a conversation's or a document's chunks stay while the new
    chunks of prompts that never come back pass through).

    Hashing every block is the costliest step of a decision in pure Python (a 17-item
    tuple per block, about 10 ns a token) and prompts repeat their leading tokens (a
    conversation's earlier turns, a shared document or system prompt). Each chunk's
    tokens are hashed as one tuple (about 5 ns a token) and the prefix of whole chunks
    ending with it gets an id, the previous prefix's xor the hash of that tuple hash
    with the chunk's position's salt (:func:`block_keys`' chaining, a chunk a link);
    the cache maps a prefix's id to the keys of all its chunks (the list a prompt's
    keys were learnt in, and how many of its chunks). So a repeated prefix costs a
    tuple hash per 256 tokens and a lookup or two (its deepest known prefix, found from
    the prompt's end), not one a chunk; its keys are the same lists every time, the very
    int objects the indexes hold (a lookup matches them by identity). A prompt's chunks
    past its deepest known prefix are hashed block by block when needed (see
    :class:`ChunkedKeys`) and remembered (only the first, if no chunk of the prompt was
    known). Two prefixes with the same id would share keys: as likely as two 64-bit
    hashes colliding, and like a key collision it misroutes only.

    A prompt's first chunk is looked up before the others are hashed: a prompt of its
    own costs one tuple hash until its keys are needed. A lookup refreshes the first
    prefix and the deepest one it found; the ones between can be forgotten first (a
    prompt that needs one of them again finds the first, and learns the rest again).
    """

    def __init__(self, block_size: int, max_chunks: int) -> None:
        self.block_size = block_size
        self.max_chunks = max(1, max_chunks)
        self._span = CHUNK_BLOCKS * block_size
        self._chunks: dict[int, tuple[list[list[int]], int]] = {}
        """A prefix's id -> (chunk key lists, of which the prefix's are the first n; n)."""

    def __len__(self) -> int:
        return len(self._chunks)

    def __call__(self, token_ids: Sequence[int]) -> ChunkedKeys:
        """``block_keys(token_ids, block_size)``, in chunks."""
        return self.lookup(token_ids).complete()

    def lookup(self, token_ids: Sequence[int]) -> ChunkedKeys:
        """The keys of ``token_ids``' leading chunks that the cache knows, the rest to be
        computed on demand (see :class:`ChunkedKeys`)."""
        return lookup_chunks(self, token_ids)

    def _learn(
        self, token_ids: Sequence[int], out: list[list[int]], cached: int, ids: list[int]
    ) -> None:
        """Remember the new full chunks of a prompt whose first ``cached`` chunks were
        known (``ids``: its prefixes' ids, as far as taken): all of them if its first
        chunk was known (a conversation or a document coming back), else only the first
        (a prompt of its own may never come back: it costs one tuple hash, not one a
        chunk; if it does come back, the rest is learnt then)."""
        chunks = self._chunks
        whole = len(token_ids) // self._span
        learn = whole if cached else min(whole, 1)
        if learn > cached:
            kept = out[:learn]  # the learnt chunks only: not the prompt's partial last one
            for number in range(cached, learn):
                chunks[ids[number]] = (kept, number + 1)
        excess = len(chunks) - self.max_chunks
        if excess > 0:
            for old in list(islice(chunks, excess)):
                del chunks[old]


def lookup_chunks(cache: ChunkKeys, token_ids: Sequence[int]) -> ChunkedKeys:
    """:meth:`ChunkKeys.lookup` (a function, which the compiled twin replaces: it hashes
    the chunks past the first several at a time, the same values)."""
    span = cache._span
    total = len(token_ids)
    chunks = cache._chunks
    keys = ChunkedKeys([], total // cache.block_size)
    # The full chunks' tuple hashes, lazily: the first alone, the others if it is known.
    hashes = chunk_hashes(token_ids, span)
    first = next(hashes, None)
    ids: list[int] = []
    found = 0
    if first is not None:
        salts = _salts(total // span)
        ids.append(hash((first, salts[0])))
        entry = chunks.pop(ids[0], None)
        if entry is not None:
            chunks[ids[0]] = entry  # most recently used: out last
            # the others' ids at C level: each chunk's hash with its position's salt,
            # chained by xor (as block keys are)
            salted = map(hash, zip(hashes, islice(salts, 1, None), strict=False))
            ids = list(accumulate(salted, xor, initial=ids[0]))
            for deepest in range(len(ids) - 1, 0, -1):
                deeper = chunks.pop(ids[deepest], None)
                if deeper is not None:
                    chunks[ids[deepest]] = entry = deeper
                    break
            lists, found = entry
            keys.chunks = lists[:found]
    start = found * span
    if start < total:
        keys.known = found * CHUNK_BLOCKS
        parent = keys.chunks[-1][-1] if found else ROOT_KEY
        keys._rest = _Rest(cache, token_ids, start, parent, found, ids)
    return keys


accelerate(globals(), "trio_dpcoord.routing._keys_kernel")  # the compiled twin, if built
