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

from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS
from libc.stdint cimport int64_t


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
    """
    Py_hash_t tdc_tuple_hash(PyObject **items, Py_ssize_t count, PyObject *extra) except? -1


cdef object _salts = None
"""``_keys._salts`` (the position salts, extended on demand), bound by :func:`accelerate`."""

cdef object _pure_block_keys = None
cdef object _pure_chunk_hashes = None
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
    salts = _salts(depth + blocks)
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


def accelerate(namespace):
    """The replacements for the pure module's names (``namespace``: its globals)."""
    global _salts, _pure_block_keys, _pure_chunk_hashes
    _salts = namespace["_salts"]
    _pure_block_keys = namespace["block_keys"]
    _pure_chunk_hashes = namespace["chunk_hashes"]
    return {"block_keys": block_keys, "chunk_hashes": chunk_hashes}
