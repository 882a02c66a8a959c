# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled twin of :mod:`trio_dpcoord.routing._keys`' hashing: :func:`block_keys` and
:func:`chunk_hashes`, the same values computed without building a tuple per block.

:mod:`._keys` (pure Python) is the spec. Its block key is ``hash()`` of the tuple of the
block's tokens and its position's salt, chained by xor; here the tuple's hash is
computed the way CPython computes it (``tuplehash``: xxHash's round over each item's
``hash()``, then the length; unchanged from 3.8 to 3.13), reading the token list in
place. ``tests/routing/test_compiled_twin.py`` checks both against each other; the build
(``setup.py``) compiles this file when a C compiler is there, and the package runs
the pure module when it is not (or with ``TRIO_DPCOORD_PURE_PYTHON=1``).
"""

cimport cython
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS
from libc.stdint cimport int64_t
from cpython.mem cimport PyMem_Malloc, PyMem_Free


cdef extern from *:
    """
    #if SIZEOF_PY_UHASH_T > 4
    #define TDC_PRIME_1 ((Py_uhash_t)11400714785074694791ULL)
    #define TDC_PRIME_2 ((Py_uhash_t)14029467366897019727ULL)
    #define TDC_PRIME_5 ((Py_uhash_t)2870177450012600261ULL)
    #define TDC_ROTATE(x) ((x << 31) | (x >> 33))
    #else
    #define TDC_PRIME_1 ((Py_uhash_t)2654435761UL)
    #define TDC_PRIME_2 ((Py_uhash_t)2246822519UL)
    #define TDC_PRIME_5 ((Py_uhash_t)374761393UL)
    #define TDC_ROTATE(x) ((x << 13) | (x >> 19))
    #endif

    /* hash(o); an int of one digit (the usual token id) read in place: its hash is its
       value (below the modulus 2**61 - 1), -1 being -2 as everywhere in Python. */
    static inline Py_hash_t tdc_hash(PyObject *o) {
        if (PyLong_CheckExact(o)) {
    #if PY_VERSION_HEX >= 0x030C0000
            if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
                Py_ssize_t value = PyUnstable_Long_CompactValue((PyLongObject *)o);
                return value == -1 ? -2 : value;
            }
    #else
            Py_ssize_t size = Py_SIZE(o);
            if (size >= -1 && size <= 1) {
                Py_ssize_t value = size * (Py_ssize_t)((PyLongObject *)o)->ob_digit[0];
                return value == -1 ? -2 : value;
            }
    #endif
        }
        return PyObject_Hash(o);
    }

    /* CPython's tuplehash over items[0:count] and then ``extra`` (if not NULL): the
       hash of the tuple (*items[0:count], extra). -1 with an exception set on error. */
    static Py_hash_t tdc_tuple_hash(PyObject **items, Py_ssize_t count, PyObject *extra) {
        Py_uhash_t acc = TDC_PRIME_5;
        Py_ssize_t length = count;
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_hash_t lane = tdc_hash(items[i]);
            if (lane == -1) return -1;
            acc += (Py_uhash_t)lane * TDC_PRIME_2;
            acc = TDC_ROTATE(acc);
            acc *= TDC_PRIME_1;
        }
        if (extra != NULL) {
            Py_hash_t lane = tdc_hash(extra);
            if (lane == -1) return -1;
            acc += (Py_uhash_t)lane * TDC_PRIME_2;
            acc = TDC_ROTATE(acc);
            acc *= TDC_PRIME_1;
            length += 1;
        }
        acc += (Py_uhash_t)length ^ (TDC_PRIME_5 ^ 3527539UL);
        if (acc == (Py_uhash_t)-1) return 1546275796;
        return (Py_hash_t)acc;
    }

    /* The lane of an int of one digit, into *lane; 0 for anything else (hashed apart). */
    static inline int tdc_compact(PyObject *o, Py_hash_t *lane) {
        if (!PyLong_CheckExact(o)) return 0;
    #if PY_VERSION_HEX >= 0x030C0000
        if (!PyUnstable_Long_IsCompact((PyLongObject *)o)) return 0;
        Py_ssize_t value = PyUnstable_Long_CompactValue((PyLongObject *)o);
    #else
        Py_ssize_t size = Py_SIZE(o);
        if (size < -1 || size > 1) return 0;
        Py_ssize_t value = size * (Py_ssize_t)((PyLongObject *)o)->ob_digit[0];
    #endif
        *lane = value == -1 ? -2 : value;
        return 1;
    }

    #define TDC_ROUND(acc, lane) do { \
        acc += (Py_uhash_t)(lane) * TDC_PRIME_2; acc = TDC_ROTATE(acc); acc *= TDC_PRIME_1; \
    } while (0)
    #define TDC_FINISH(acc, length) \
        ((acc) + ((Py_uhash_t)(length) ^ (TDC_PRIME_5 ^ 3527539UL)) == (Py_uhash_t)-1 \
         ? (Py_hash_t)1546275796 \
         : (Py_hash_t)((acc) + ((Py_uhash_t)(length) ^ (TDC_PRIME_5 ^ 3527539UL))))

    /* The tuple hashes of ``count`` chunks of ``span`` items from ``items`` on, into
       ``out``, four chunks at a time (their rounds interleaved: four independent chains
       where CPython's tuple hash runs one); the same values as tdc_tuple_hash. Returns
       0, or 1 at the first chunk holding an item other than an int of one digit (the
       caller hashes the prompt another way). */
    static int tdc_chunk_hashes(PyObject **items, Py_ssize_t span, Py_ssize_t count,
                                Py_hash_t *out) {
        Py_ssize_t chunk = 0;
        for (; chunk + 4 <= count; chunk += 4) {
            PyObject **p0 = items + chunk * span, **p1 = p0 + span;
            PyObject **p2 = p1 + span, **p3 = p2 + span;
            Py_uhash_t a0 = TDC_PRIME_5, a1 = TDC_PRIME_5, a2 = TDC_PRIME_5, a3 = TDC_PRIME_5;
            for (Py_ssize_t i = 0; i < span; i++) {
                Py_hash_t l0, l1, l2, l3;
                if (!(tdc_compact(p0[i], &l0) & tdc_compact(p1[i], &l1)
                      & tdc_compact(p2[i], &l2) & tdc_compact(p3[i], &l3)))
                    return 1;
                TDC_ROUND(a0, l0); TDC_ROUND(a1, l1); TDC_ROUND(a2, l2); TDC_ROUND(a3, l3);
            }
            out[chunk] = TDC_FINISH(a0, span);
            out[chunk + 1] = TDC_FINISH(a1, span);
            out[chunk + 2] = TDC_FINISH(a2, span);
            out[chunk + 3] = TDC_FINISH(a3, span);
        }
        for (; chunk < count; chunk++) {
            PyObject **p = items + chunk * span;
            Py_uhash_t acc = TDC_PRIME_5;
            for (Py_ssize_t i = 0; i < span; i++) {
                Py_hash_t lane;
                if (!tdc_compact(p[i], &lane)) return 1;
                TDC_ROUND(acc, lane);
            }
            out[chunk] = TDC_FINISH(acc, span);
        }
        return 0;
    }

    /* hash((int(a), int(b))) for two hash values read as ints (a chunk's tuple hash and
       its position's salt's hash): hash(int(v)) is v modulo 2**61 - 1, sign kept, -1
       being -2. */
    static inline Py_hash_t tdc_int_hash(Py_hash_t v) {
        Py_uhash_t magnitude = v < 0 ? (Py_uhash_t)0 - (Py_uhash_t)v : (Py_uhash_t)v;
        magnitude %= (Py_uhash_t)_PyHASH_MODULUS;
        Py_hash_t h = v < 0 ? -(Py_hash_t)magnitude : (Py_hash_t)magnitude;
        return h == -1 ? -2 : h;
    }
    static inline Py_hash_t tdc_pair_hash(Py_hash_t a, Py_hash_t b) {
        Py_uhash_t acc = TDC_PRIME_5;
        TDC_ROUND(acc, tdc_int_hash(a));
        TDC_ROUND(acc, b);
        return TDC_FINISH(acc, 2);
    }
    """
    Py_hash_t tdc_tuple_hash(PyObject **items, Py_ssize_t count, PyObject *extra) except? -1
    int tdc_chunk_hashes(PyObject **items, Py_ssize_t span, Py_ssize_t count, Py_hash_t *out)
    Py_hash_t tdc_pair_hash(Py_hash_t a, Py_hash_t b)


cdef object _salts = None
"""``_keys._salts`` (the position salts, extended on demand), bound by :func:`accelerate`."""

cdef object _pure_block_keys = None
cdef object _pure_chunk_hashes = None
cdef object _pure_lookup_chunks = None
cdef object _pure_probe = None
cdef object _ChunkedKeys = None
cdef object _Rest = None
cdef Py_ssize_t _CHUNK_BLOCKS = 16
cdef object _ROOT_KEY = 0
"""The pure module's functions: what the C loops do not take (a ``parent`` outside 64
bits, a size of 0 or less) goes there, errors and all."""


def block_keys(token_ids, Py_ssize_t block_size, parent=0, Py_ssize_t depth=0):
    """``_keys.block_keys``, computed in one pass over the tokens in place."""
    cdef int64_t key
    if block_size <= 0 or depth < 0 or type(parent) is not int or not -2**63 <= parent < 2**63:
        return _pure_block_keys(token_ids, block_size, parent, depth)  # errors, big ints
    key = parent
    seq = PySequence_Fast(token_ids, "block_keys: token_ids must be a sequence")
    cdef Py_ssize_t blocks = PySequence_Fast_GET_SIZE(seq) // block_size
    if blocks <= 0:
        return []
    salts = _salt_list(depth + blocks)
    cdef list salt_list = salts
    cdef PyObject **items = PySequence_Fast_ITEMS(seq)
    cdef PyObject **salt_items = PySequence_Fast_ITEMS(salt_list)
    cdef list out = PyList_New(blocks)
    cdef Py_ssize_t block
    cdef Py_hash_t hashed
    cdef object value
    for block in range(blocks):
        hashed = tdc_tuple_hash(items + block * block_size, block_size, salt_items[depth + block])
        key ^= hashed
        value = key
        Py_INCREF(value)
        PyList_SET_ITEM(out, block, value)
    return out


cdef class _ChunkHashes:
    """The iterator of :func:`chunk_hashes`: each full chunk's tuple hash when asked."""

    cdef object seq
    cdef Py_ssize_t span
    cdef Py_ssize_t at
    cdef Py_ssize_t end

    def __iter__(self):
        return self

    def __next__(self):
        self.end = PySequence_Fast_GET_SIZE(self.seq)  # (a list may shrink meanwhile)
        if self.at + self.span > self.end:
            raise StopIteration
        cdef PyObject **items = PySequence_Fast_ITEMS(self.seq)
        cdef Py_hash_t hashed = tdc_tuple_hash(items + self.at, self.span, NULL)
        self.at += self.span
        return hashed


def chunk_hashes(token_ids, Py_ssize_t span):
    """``_keys.chunk_hashes``: the hash of each full chunk's tuple of ``span`` tokens, lazily."""
    if span <= 0:
        return _pure_chunk_hashes(token_ids, span)
    cdef _ChunkHashes hashes = _ChunkHashes.__new__(_ChunkHashes)
    hashes.seq = PySequence_Fast(token_ids, "chunk_hashes: token_ids must be a sequence")
    hashes.span = span
    hashes.at = 0
    hashes.end = PySequence_Fast_GET_SIZE(hashes.seq)
    return hashes


cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void *o)


cdef void _untrack_keys(list keys):
    """Take a chunk's list of keys (ints only: block_keys made them) out of the cycle
    collector's lists (see ``_prefix_index_kernel._untrack_ints``: it cannot be part of
    a cycle, and a collection would read every key's type)."""
    PyObject_GC_UnTrack(<void *>keys)


cdef list _position_salts = None
"""``_keys._POSITION_SALTS`` (the list ``_salts`` extends and returns)."""


cdef inline list _salt_list(Py_ssize_t upto):
    """``_salts(upto)``, without the call while the list is long enough already."""
    if _position_salts is not None and len(_position_salts) >= upto:
        return _position_salts
    return _salts(upto)


def chunked_len(self):
    """``ChunkedKeys.__len__``."""
    return self._length


cdef extern from "Python.h":
    int PyObject_GenericSetAttr(object o, object name, object value) except -1


cdef object _new_keys(length):
    """``ChunkedKeys([], length)``: its four slots set as its ``__init__`` sets them,
    without a Python frame (a decision makes one)."""
    keys = _ChunkedKeys.__new__(_ChunkedKeys)
    PyObject_GenericSetAttr(keys, "chunks", [])
    PyObject_GenericSetAttr(keys, "_length", length)
    PyObject_GenericSetAttr(keys, "known", length)
    PyObject_GenericSetAttr(keys, "_rest", None)
    return keys


cdef object _new_rest(cache, tokens, start, parent, cached, ids):
    """``_Rest(cache, tokens, start, parent, cached, ids)``, as :func:`_new_keys`."""
    rest = _Rest.__new__(_Rest)
    PyObject_GenericSetAttr(rest, "cache", cache)
    PyObject_GenericSetAttr(rest, "tokens", tokens)
    PyObject_GenericSetAttr(rest, "start", start)
    PyObject_GenericSetAttr(rest, "parent", parent)
    PyObject_GenericSetAttr(rest, "cached", cached)
    PyObject_GenericSetAttr(rest, "ids", ids)
    PyObject_GenericSetAttr(rest, "probe", None)
    return rest


cdef enum:
    _HEAD_CHUNKS = 4  # chunks hashed before the first is looked up (see lookup_chunks)


def lookup_chunks(cache, token_ids):
    """``_keys.lookup_chunks`` (``ChunkKeys.lookup``): the chunks' tuple hashes computed
    four at a time (the first four before the first is looked up), the rest as the pure
    function does. A prompt with a token that is not an int of one digit (in its first
    four chunks, or anywhere once its first is known) goes to the pure function (from
    the start: its only change so far, the first prefix refreshed, it repeats to the
    same effect)."""
    cdef Py_ssize_t span = cache._span
    cdef Py_ssize_t total = len(token_ids)
    cdef dict chunks = cache._chunks
    keys = _new_keys(total // cache.block_size)
    cdef list ids = []
    cdef Py_ssize_t found = 0
    cdef Py_ssize_t whole = total // span if span > 0 else 0
    cdef Py_hash_t head[4]
    cdef Py_ssize_t head_count
    cdef Py_hash_t *hashes
    cdef Py_ssize_t number, deepest
    cdef list salt_list
    cdef PyObject **items
    cdef Py_hash_t chained
    if whole:
        seq = PySequence_Fast(token_ids, "lookup: token_ids must be a sequence")
        if PySequence_Fast_GET_SIZE(seq) != total:
            return _pure_lookup_chunks(cache, token_ids)
        items = PySequence_Fast_ITEMS(seq)
        # The first four chunks hashed together: four interleaved chains cost about what
        # the first one alone did (its rounds are a chain of dependent multiplies).
        head_count = whole if whole < _HEAD_CHUNKS else _HEAD_CHUNKS
        if tdc_chunk_hashes(items, span, head_count, head):
            return _pure_lookup_chunks(cache, token_ids)
        salt_list = _salt_list(whole)
        chained = tdc_pair_hash(head[0], hash(salt_list[0]))
        ids.append(chained)
        entry = chunks.pop(ids[0], None)
        if entry is not None:
            chunks[ids[0]] = entry  # most recently used: out last
            if whole > 1:
                hashes = <Py_hash_t *>PyMem_Malloc((whole - 1) * sizeof(Py_hash_t))
                if hashes == NULL:
                    raise MemoryError()
                try:
                    for number in range(1, head_count):
                        hashes[number - 1] = head[number]
                    if whole > head_count and tdc_chunk_hashes(
                        items + head_count * span, span, whole - head_count,
                        hashes + head_count - 1
                    ):
                        return _pure_lookup_chunks(cache, token_ids)
                    for number in range(1, whole):
                        chained ^= tdc_pair_hash(hashes[number - 1], hash(salt_list[number]))
                        ids.append(chained)
                finally:
                    PyMem_Free(hashes)
            for deepest in range(whole - 1, 0, -1):
                deeper = chunks.pop(ids[deepest], None)
                if deeper is not None:
                    chunks[ids[deepest]] = entry = deeper
                    break
            lists, found = entry
            keys.chunks = lists[:found]
    cdef Py_ssize_t start = found * span
    if start < total:
        keys.known = found * _CHUNK_BLOCKS
        parent = _ROOT_KEY
        if found:
            last = keys.chunks[found - 1]
            parent = last[len(last) - 1]
        keys._rest = _new_rest(cache, token_ids, start, parent, found, ids)
    return keys


def probe(self):
    """``ChunkedKeys.probe``: the key of block ``known`` alone, its tuple hashed in place
    (no slice, no tuple); the pure method for what it does not take."""
    rest = self._rest
    if rest is None or rest.probe is not None or type(rest.tokens) is not list:
        return _pure_probe(self)
    cdef Py_ssize_t size = rest.cache.block_size
    cdef Py_ssize_t at = rest.start
    cdef Py_ssize_t known = self.known
    cdef list tokens = rest.tokens
    if size <= 0 or at < 0 or at + size > len(tokens) or known < 0:
        return _pure_probe(self)
    cdef list salt_list = _salt_list(known + 1)
    cdef PyObject **items = PySequence_Fast_ITEMS(tokens)
    cdef Py_hash_t hashed = tdc_tuple_hash(items + at, size, <PyObject *>salt_list[known])
    rest.probe = rest.parent ^ hashed
    return rest.probe


def complete_keys(keys):
    """``_keys.complete_keys`` (``ChunkedKeys.complete``), with ``ChunkKeys._learn``
    inline: the same steps, the new keys from the compiled :func:`block_keys`."""
    rest = keys._rest
    if rest is None:
        return keys
    keys._rest = None
    cache = rest.cache
    tokens, start, parent = rest.tokens, rest.start, rest.parent
    size = cache.block_size
    cdef list computed = block_keys(tokens[start:] if start else tokens, size, parent, start // size)
    cdef list out = keys.chunks
    cdef Py_ssize_t count = len(computed), at
    for at in range(0, count, _CHUNK_BLOCKS):
        chunk = computed[at : at + _CHUNK_BLOCKS]
        _untrack_keys(chunk)  # (the cache keeps it)
        out.append(chunk)
    keys.known = keys._length
    _learn(cache, tokens, out, rest.cached, rest.ids)
    return keys


@cython.boundscheck(True)  # (a prompt grown since its lookup: IndexError, as in Python)
cdef _learn(cache, tokens, list out, Py_ssize_t cached, list ids):
    """``ChunkKeys._learn``: remember the prompt's new full chunks (see there)."""
    cdef dict chunks = cache._chunks
    cdef Py_ssize_t whole = len(tokens) // cache._span
    cdef Py_ssize_t learn = whole if cached else min(whole, 1)
    cdef Py_ssize_t number
    if learn > cached:
        kept = out[:learn]  # the learnt chunks only: not the prompt's partial last one
        for number in range(cached, learn):
            chunks[ids[number]] = (kept, number + 1)
    cdef Py_ssize_t excess = len(chunks) - cache.max_chunks
    cdef list old
    if excess > 0:
        old = []
        for key in chunks:
            if len(old) >= excess:
                break
            old.append(key)
        for key in old:
            del chunks[key]


def accelerate(namespace):
    """The replacements for the pure module's names (``namespace``: its globals)."""
    global _salts, _pure_block_keys, _pure_chunk_hashes, _pure_lookup_chunks
    global _ChunkedKeys, _Rest, _CHUNK_BLOCKS, _ROOT_KEY, _pure_probe, _position_salts
    _salts = namespace["_salts"]
    _pure_block_keys = namespace["block_keys"]
    _pure_chunk_hashes = namespace["chunk_hashes"]
    _pure_lookup_chunks = namespace["lookup_chunks"]
    _ChunkedKeys = namespace["ChunkedKeys"]
    _Rest = namespace["_Rest"]
    _CHUNK_BLOCKS = namespace["CHUNK_BLOCKS"]
    _ROOT_KEY = namespace["ROOT_KEY"]
    _pure_probe = _ChunkedKeys.probe
    # the methods themselves (they only call these functions): no Python frame between
    _ChunkedKeys.probe = probe
    _ChunkedKeys.complete = complete_keys
    _ChunkedKeys.__len__ = chunked_len
    _position_salts = namespace["_POSITION_SALTS"]
    namespace["ChunkKeys"].lookup = lookup_chunks
    return {
        "block_keys": block_keys,
        "chunk_hashes": chunk_hashes,
        "lookup_chunks": lookup_chunks,
        "complete_keys": complete_keys,
    }

