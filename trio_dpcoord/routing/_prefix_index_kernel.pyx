# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled twin of :mod:`trio_dpcoord.routing._prefix_index`'s chain-mode store:
``RankPrefixIndex._store_chain`` and ``_evict_pieces`` (with ``_own_new`` and
``_disown`` inside them), the same steps on the same dicts and lists, without a
bytecode per step; and ``_Piece`` as a C struct with the same attributes.

:mod:`._prefix_index` (pure Python) is the spec: every step here is one of its steps,
in its order (the owners map, the pieces and their keys end the same, entry for entry).
``tests/routing/test_compiled_twin.py`` runs routers on both builds side by side.
"""

cimport cython
from cpython.dict cimport PyDict_GetItem
from cpython.object cimport PyObject


cdef extern from "Python.h":
    int PyObject_GC_IsTracked(object o)
    void PyObject_GC_UnTrack(void *o)


cdef void _untrack_ints(list values):
    """Take a list holding only ints out of the cycle collector's lists: it cannot be
    part of a cycle, and a collection would otherwise read every int's type (one cache
    miss each: at 256 ranks a gen0 collection inside a decision took 0.5 ms, a full one
    0.1 s). A list holding anything else stays tracked. Invisible to the pure spec: the
    same objects, only not traversed."""
    if not PyObject_GC_IsTracked(values):
        return
    for value in values:
        if type(value) is not int:
            return
    PyObject_GC_UnTrack(<void *>values)


cdef object _ChunkedKeys = None
cdef Py_ssize_t _CHUNK_BLOCKS = 16
cdef Py_ssize_t _PIECE_BLOCKS = 64


@cython.no_gc
cdef class Piece:
    """``_prefix_index._Piece``: keys of one chain stored together, from depth ``lo``.

    Not tracked by the cycle collector (``no_gc``): it refers to a list of ints and a
    clock reading, never to anything that could refer back to it, and a decision
    stores one or two, which would otherwise count towards a collection inside some
    later decision (at 256 ranks, 0.6 % of decisions ran one, gen0 p50 0.3 ms)."""

    cdef public list keys
    cdef public Py_ssize_t lo
    cdef public object time

    def __init__(self, list keys, Py_ssize_t lo, time):
        _untrack_ints(keys)
        self.keys = keys
        self.lo = lo
        self.time = time


cdef void _own_new(dict owners, object bit, list fresh) except *:
    """``RankPrefixIndex._own_new``: this rank's bit for keys new here."""
    cdef list masks = []
    cdef bint all_bit = True
    for key in fresh:
        mask = owners.setdefault(key, bit)
        masks.append(mask)
        if all_bit and not (mask is bit or mask == bit):
            all_bit = False
    if not all_bit:
        for key, mask in zip(fresh, masks):
            owners[key] = mask | bit


cdef void _disown(dict owners, object bit, list keys) except *:
    """``RankPrefixIndex._disown``: this rank's bit out of the masks of ``keys``."""
    cdef list masks = []
    cdef bint all_bit = True
    for key in keys:
        mask = owners.pop(key, 0)
        masks.append(mask)
        if all_bit and not (mask is bit or mask == bit):
            all_bit = False
    if not all_bit:
        not_bit = ~bit
        for key, mask in zip(keys, masks):
            others = mask & not_bit
            if others:
                owners[key] = others


def evict_pieces(self, Py_ssize_t count):
    """``RankPrefixIndex._evict_pieces``: forget the ``count`` least recently used keys."""
    cdef dict pieces = self._pieces
    cdef dict by_key = self._held
    cdef list victims = []
    cdef list emptied = []
    cdef Piece piece
    cdef list keys
    cdef Py_ssize_t need, size
    for item in pieces:
        piece = <Piece>item
        keys = piece.keys
        need = count - len(victims)
        size = len(keys)
        if size > need:
            victims += keys[size - need :]
            del keys[size - need :]
            break
        victims += keys
        emptied.append(piece)
        if size == need:
            break
    for item in emptied:
        del pieces[item]
    for item in emptied:
        piece = <Piece>item
        first = piece.keys[0]
        if by_key.get(first) is piece:
            del by_key[first]
    self._count -= len(victims)
    _disown(self._owners, self._bit, victims)


@cython.boundscheck(True)
def store_chain(self, keys, Py_ssize_t held, now):
    """``RankPrefixIndex._store_chain``: a chain from the root stored, its first ``held``
    held here (the walk's), the same order as the pure method leaves."""
    cdef dict pieces = self._pieces
    cdef dict by_key = self._held
    cdef list chunks
    cdef Py_ssize_t span
    if type(keys) is _ChunkedKeys:
        chunks, span = keys.chunks, _CHUNK_BLOCKS
    else:
        chunks = [keys]
        span = max(1, len(keys))
    cdef list refreshed = []
    cdef Py_ssize_t depth = 0
    cdef PyObject *found
    cdef Piece piece
    while depth < held:  # the held prefix's pieces, root first
        found = PyDict_GetItem(by_key, chunks[depth // span][depth % span])
        if found == NULL or (<Piece>found).lo != depth:  # not a chain here
            self._materialize()
            self.store(keys, now)
            return
        piece = <Piece>found
        refreshed.append(piece)
        depth += len(piece.keys)
    cdef Py_ssize_t count = len(keys)
    cdef list fresh
    cdef Py_ssize_t at, first_chunk
    if type(keys) is _ChunkedKeys and keys._rest is None and span == _CHUNK_BLOCKS:
        first_chunk = held // span
        fresh = []
        if first_chunk < len(chunks):
            fresh.extend((<list>chunks[first_chunk])[held % span :])
            for at in range(first_chunk + 1, len(chunks)):
                fresh.extend(<list>chunks[at])
    else:
        fresh = list(keys[held:])
    cdef Py_ssize_t boundary = (held // _PIECE_BLOCKS + 1) * _PIECE_BLOCKS
    cdef list new = []
    cdef Py_ssize_t start, end
    cdef Py_ssize_t fresh_count = len(fresh)
    if not fresh_count:
        pass
    elif count <= boundary:  # one piece (a follow-up turn's new blocks, usually)
        piece = Piece(fresh, held, now)
        new.append(piece)
        by_key[fresh[0]] = piece
    else:
        start = held
        end = boundary
        while start < count:
            piece = Piece(fresh[start - held : end - held], start, now)
            new.append(piece)
            start, end = end, min(end + _PIECE_BLOCKS, count)
        for item in new:
            piece = <Piece>item
            by_key[piece.keys[0]] = piece
    self._count += fresh_count
    cdef Piece last, part
    cdef Py_ssize_t cut
    if refreshed and depth > held:  # the last piece runs past the prefix: split it
        last = <Piece>refreshed[len(refreshed) - 1]
        cut = held - last.lo
        part = Piece(last.keys[:cut], last.lo, now)
        del last.keys[:cut]
        last.lo = held
        by_key[part.keys[0]] = part
        by_key[last.keys[0]] = last
        refreshed[len(refreshed) - 1] = part
    cdef Py_ssize_t number
    for number in range(len(new) - 1, -1, -1):
        pieces[new[number]] = None
    for number in range(len(refreshed) - 1, -1, -1):
        piece = <Piece>refreshed[number]
        pieces.pop(piece, None)  # (the split-off part is not in yet)
        piece.time = now
        pieces[piece] = None
    if fresh_count:
        _own_new(self._owners, self._bit, fresh)
    cdef Py_ssize_t excess = self._count - self.capacity_blocks
    if excess > 0:
        self._evict_pieces(excess)


def accelerate(namespace):
    """The replacements for the pure module's names (``namespace``: its globals); the
    index's two chain-mode methods become this module's functions."""
    global _ChunkedKeys, _CHUNK_BLOCKS, _PIECE_BLOCKS
    _ChunkedKeys = namespace["ChunkedKeys"]
    _CHUNK_BLOCKS = namespace["CHUNK_BLOCKS"]
    _PIECE_BLOCKS = namespace["PIECE_BLOCKS"]
    index = namespace["RankPrefixIndex"]
    index._store_chain = store_chain
    index._evict_pieces = evict_pieces
    return {"_Piece": Piece}
