# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled twin of :data:`trio_dpcoord.protocol._output_decoder.decode_ingest_stats`:
the coordinator's ingest decoder, scanning the msgpack bytes of a stats report in place.

:mod:`._output_decoder` (pure Python) is the spec. Here the frame's bytes are read where
they lie: no Python object is made for any field but the six returned (``(engine_index,
waiting, running, kv_cache_usage, wave, step)``, one flat tuple, as the pure path gives).
The contract is the pure path's, made stricter, never looser: a tuple only for a frame
whose answer from :func:`~._output_decoder.decode_coordinator_output` is that stats
report, in the shape engines send (a fixarray of 9: a non-negative int, an empty array, a
map with str keys, a float, five nils, nothing after); None for anything it does not vouch
for, valid or not, which the full decoder then judges. Refused here though the pure path
may take them (rare, and the full decoder gives the same answer): arrays and maps of the
outer shape in a wider header than needed, ext values, bin keys, one of the five read
keys twice, values nested deeper than :data:`MAX_DEPTH`. What msgpack-python refuses is
refused here too (truncated or trailing bytes, the unused byte 0xc1, keys that are not
str or bytes, str that is not UTF-8).

``tests/protocol/test_compiled_twin.py`` checks the two against each other (generated
frames of every shape, msgpack variants, the vLLM vectors, fuzzed bytes); ``setup.py``
builds this file where a C compiler is present, and the pure module runs where it is
not (or with ``TRIO_DPCOORD_PURE_PYTHON=1``).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.float cimport PyFloat_FromDouble
from libc.stdint cimport uint64_t
from libc.string cimport memcmp


cdef extern from *:
    """
    #include <string.h>
    #include <math.h>
    static inline unsigned int tdc_be16(const unsigned char *p) {
        return ((unsigned int)p[0] << 8) | p[1];
    }
    static inline uint32_t tdc_be32(const unsigned char *p) {
        return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
    }
    static inline uint64_t tdc_be64(const unsigned char *p) {
        return ((uint64_t)tdc_be32(p) << 32) | tdc_be32(p + 4);
    }
    static inline double tdc_f32(const unsigned char *p) {
        uint32_t u = tdc_be32(p); float f; memcpy(&f, &u, 4); return (double)f;
    }
    static inline double tdc_f64(const unsigned char *p) {
        uint64_t u = tdc_be64(p); double d; memcpy(&d, &u, 8); return d;
    }
    static inline int tdc_isfinite(double d) { return isfinite(d); }
    """
    unsigned int tdc_be16(const unsigned char *p) nogil
    unsigned int tdc_be32(const unsigned char *p) nogil
    uint64_t tdc_be64(const unsigned char *p) nogil
    double tdc_f32(const unsigned char *p) nogil
    double tdc_f64(const unsigned char *p) nogil
    int tdc_isfinite(double d) nogil
    object PyUnicode_DecodeUTF8(const char *s, Py_ssize_t size, const char *errors)


cdef enum:
    NOT_VOUCHED = -1  # a position no value is at: the frame is not vouched for

MAX_DEPTH = 32
"""Nesting of a skipped value deeper than this: not vouched for (msgpack-python's own
limit is deeper; the full decoder judges)."""

cdef int _MAX_DEPTH = MAX_DEPTH
cdef Py_ssize_t _max_frame = 0  # MAX_DATA_FRAME_BYTES, from the pure module (accelerate)


cdef inline bint _utf8(const unsigned char *s, Py_ssize_t n):
    """Whether ``s[:n]`` is what msgpack-python decodes as str (strict UTF-8): ASCII in
    place, anything else by CPython's own decoder (rare in these frames)."""
    cdef Py_ssize_t i
    for i in range(n):
        if s[i] >= 0x80:
            try:
                PyUnicode_DecodeUTF8(<const char *>s, n, NULL)
            except UnicodeDecodeError:
                return False
            return True
    return True


cdef Py_ssize_t _str_header(const unsigned char *b, Py_ssize_t pos, Py_ssize_t end,
                            Py_ssize_t *length):
    """A str's header at ``pos``: its length in ``length``, the position of its bytes
    (within ``end``), or NOT_VOUCHED if no str starts there or it overruns."""
    cdef unsigned int tag
    cdef Py_ssize_t n
    if pos >= end:
        return NOT_VOUCHED
    tag = b[pos]
    if 0xa0 <= tag <= 0xbf:
        n = tag & 0x1f
        pos += 1
    elif tag == 0xd9:
        if end - pos < 2:
            return NOT_VOUCHED
        n = b[pos + 1]
        pos += 2
    elif tag == 0xda:
        if end - pos < 3:
            return NOT_VOUCHED
        n = tdc_be16(b + pos + 1)
        pos += 3
    elif tag == 0xdb:
        if end - pos < 5:
            return NOT_VOUCHED
        n = tdc_be32(b + pos + 1)
        pos += 5
    else:
        return NOT_VOUCHED
    if end - pos < n:
        return NOT_VOUCHED
    length[0] = n
    return pos


cdef Py_ssize_t _skip(const unsigned char *b, Py_ssize_t pos, Py_ssize_t end, int depth):
    """The position after the one value at ``pos`` that msgpack-python would decode
    without error (restricted as the module says), or NOT_VOUCHED."""
    cdef unsigned int tag
    cdef Py_ssize_t n, count, i, start
    if pos >= end or depth > _MAX_DEPTH:
        return NOT_VOUCHED
    tag = b[pos]
    if tag <= 0x7f or tag >= 0xe0 or tag == 0xc0 or tag == 0xc2 or tag == 0xc3:
        return pos + 1
    if 0xa0 <= tag <= 0xbf or 0xd9 <= tag <= 0xdb:
        start = _str_header(b, pos, end, &n)
        if start == NOT_VOUCHED or not _utf8(b + start, n):
            return NOT_VOUCHED
        return start + n
    if 0x90 <= tag <= 0x9f or tag == 0xdc or tag == 0xdd:
        if tag <= 0x9f:
            count = tag & 0x0f
            pos += 1
        elif tag == 0xdc:
            if end - pos < 3:
                return NOT_VOUCHED
            count = tdc_be16(b + pos + 1)
            pos += 3
        else:
            if end - pos < 5:
                return NOT_VOUCHED
            count = tdc_be32(b + pos + 1)
            pos += 5
        if count > end - pos:  # each item takes a byte at least
            return NOT_VOUCHED
        for i in range(count):
            pos = _skip(b, pos, end, depth + 1)
            if pos == NOT_VOUCHED:
                return NOT_VOUCHED
        return pos
    if 0x80 <= tag <= 0x8f or tag == 0xde or tag == 0xdf:
        if tag <= 0x8f:
            count = tag & 0x0f
            pos += 1
        elif tag == 0xde:
            if end - pos < 3:
                return NOT_VOUCHED
            count = tdc_be16(b + pos + 1)
            pos += 3
        else:
            if end - pos < 5:
                return NOT_VOUCHED
            count = tdc_be32(b + pos + 1)
            pos += 5
        if count > (end - pos) // 2:
            return NOT_VOUCHED
        for i in range(count):
            # msgpack's strict_map_key: str or bytes keys only; bytes keys not vouched
            start = _str_header(b, pos, end, &n)
            if start == NOT_VOUCHED or not _utf8(b + start, n):
                return NOT_VOUCHED
            pos = _skip(b, start + n, end, depth + 1)
            if pos == NOT_VOUCHED:
                return NOT_VOUCHED
        return pos
    if tag == 0xc4 or tag == 0xc5 or tag == 0xc6:  # bin
        if tag == 0xc4:
            if end - pos < 2:
                return NOT_VOUCHED
            n = b[pos + 1]
            pos += 2
        elif tag == 0xc5:
            if end - pos < 3:
                return NOT_VOUCHED
            n = tdc_be16(b + pos + 1)
            pos += 3
        else:
            if end - pos < 5:
                return NOT_VOUCHED
            n = tdc_be32(b + pos + 1)
            pos += 5
        if end - pos < n:
            return NOT_VOUCHED
        return pos + n
    if tag == 0xca:
        n = 5
    elif tag == 0xcb:
        n = 9
    elif tag == 0xcc or tag == 0xd0:
        n = 2
    elif tag == 0xcd or tag == 0xd1:
        n = 3
    elif tag == 0xce or tag == 0xd2:
        n = 5
    elif tag == 0xcf or tag == 0xd3:
        n = 9
    else:  # 0xc1 (never used), ext and fixext: not vouched
        return NOT_VOUCHED
    if end - pos < n:
        return NOT_VOUCHED
    return pos + n


cdef Py_ssize_t _uint(const unsigned char *b, Py_ssize_t pos, Py_ssize_t end,
                      uint64_t *value):
    """A non-negative int at ``pos`` (any msgpack int width): its value, the position
    after it; NOT_VOUCHED for anything else (a negative int, a bool, nil, ...)."""
    cdef unsigned int tag
    cdef long long signed_value
    if pos >= end:
        return NOT_VOUCHED
    tag = b[pos]
    if tag <= 0x7f:
        value[0] = tag
        return pos + 1
    if tag == 0xcc or tag == 0xd0:
        if end - pos < 2:
            return NOT_VOUCHED
        if tag == 0xd0 and b[pos + 1] >= 0x80:
            return NOT_VOUCHED
        value[0] = b[pos + 1]
        return pos + 2
    if tag == 0xcd or tag == 0xd1:
        if end - pos < 3:
            return NOT_VOUCHED
        if tag == 0xd1 and b[pos + 1] >= 0x80:
            return NOT_VOUCHED
        value[0] = tdc_be16(b + pos + 1)
        return pos + 3
    if tag == 0xce or tag == 0xd2:
        if end - pos < 5:
            return NOT_VOUCHED
        if tag == 0xd2 and b[pos + 1] >= 0x80:
            return NOT_VOUCHED
        value[0] = tdc_be32(b + pos + 1)
        return pos + 5
    if tag == 0xcf or tag == 0xd3:
        if end - pos < 9:
            return NOT_VOUCHED
        if tag == 0xd3 and b[pos + 1] >= 0x80:
            return NOT_VOUCHED
        value[0] = tdc_be64(b + pos + 1)
        return pos + 9
    return NOT_VOUCHED


cdef Py_ssize_t _float(const unsigned char *b, Py_ssize_t pos, Py_ssize_t end,
                       double *value):
    """A float (32 or 64 bits) at ``pos``: its value, the position after it;
    NOT_VOUCHED for anything else."""
    if pos >= end:
        return NOT_VOUCHED
    if b[pos] == 0xcb:
        if end - pos < 9:
            return NOT_VOUCHED
        value[0] = tdc_f64(b + pos + 1)
        return pos + 9
    if b[pos] == 0xca:
        if end - pos < 5:
            return NOT_VOUCHED
        value[0] = tdc_f32(b + pos + 1)
        return pos + 5
    return NOT_VOUCHED


# The five keys read of scheduler_stats (each its bit in ``seen``).
cdef enum:
    RUNNING = 1
    WAITING = 2
    STEP = 4
    WAVE = 8
    KV = 16


def ingest_stats(frame):
    """:data:`decode_ingest_stats`, compiled: ``(engine_index, waiting, running,
    kv_cache_usage, wave, step)`` of a stats-only report in the shape engines send,
    else None (the full decoder judges). Never raises."""
    cdef const unsigned char *b
    cdef Py_ssize_t end, pos, count, i, n
    cdef uint64_t engine, running = 0, waiting = 0, step = 0, wave = 0
    cdef double kv = 0.0, timestamp
    cdef unsigned int tag, seen = 0, bit
    if not PyBytes_CheckExact(frame):
        return None
    end = PyBytes_GET_SIZE(frame)
    if end < 13 or end > _max_frame:  # the shortest: 99 00 90 80 ca xxxx c0*5
        return None
    b = <const unsigned char *>PyBytes_AS_STRING(frame)
    if b[0] != 0x99:
        return None
    pos = _uint(b, 1, end, &engine)
    if pos == NOT_VOUCHED or pos >= end or b[pos] != 0x90:
        return None
    pos += 1
    # scheduler_stats: a map with str keys
    if pos >= end:
        return None
    tag = b[pos]
    if 0x80 <= tag <= 0x8f:
        count = tag & 0x0f
        pos += 1
    elif tag == 0xde:
        if end - pos < 3:
            return None
        count = tdc_be16(b + pos + 1)
        pos += 3
    elif tag == 0xdf:
        if end - pos < 5:
            return None
        count = tdc_be32(b + pos + 1)
        pos += 5
    else:
        return None
    if count > (end - pos) // 2:
        return None
    for i in range(count):
        pos = _str_header(b, pos, end, &n)
        if pos == NOT_VOUCHED:
            return None
        bit = 0
        if n == 16:
            if memcmp(b + pos, b"num_running_reqs", 16) == 0:
                bit = RUNNING
            elif memcmp(b + pos, b"num_waiting_reqs", 16) == 0:
                bit = WAITING
        elif n == 12:
            if memcmp(b + pos, b"step_counter", 12) == 0:
                bit = STEP
            elif memcmp(b + pos, b"current_wave", 12) == 0:
                bit = WAVE
        elif n == 14:
            if memcmp(b + pos, b"kv_cache_usage", 14) == 0:
                bit = KV
        if bit == 0:
            if not _utf8(b + pos, n):
                return None
            pos = _skip(b, pos + n, end, 1)
        elif seen & bit:
            return None
        else:
            seen |= bit
            pos += n
            if bit == RUNNING:
                pos = _uint(b, pos, end, &running)
            elif bit == WAITING:
                pos = _uint(b, pos, end, &waiting)
            elif bit == STEP:
                pos = _uint(b, pos, end, &step)
            elif bit == WAVE:
                pos = _uint(b, pos, end, &wave)
            else:
                pos = _float(b, pos, end, &kv)
                if pos != NOT_VOUCHED and not tdc_isfinite(kv):
                    return None
        if pos == NOT_VOUCHED:
            return None
    # timestamp (a float), then utility_output, finished_requests, wave_complete,
    # start_wave, weight version: five nils, and the frame's end
    pos = _float(b, pos, end, &timestamp)
    if pos == NOT_VOUCHED or end - pos != 5 or memcmp(b + pos, b"\xc0\xc0\xc0\xc0\xc0", 5) != 0:
        return None
    return (
        PyLong_FromUnsignedLongLong(engine),
        PyLong_FromUnsignedLongLong(waiting),
        PyLong_FromUnsignedLongLong(running),
        PyFloat_FromDouble(kv),
        PyLong_FromUnsignedLongLong(wave),
        PyLong_FromUnsignedLongLong(step),
    )


def accelerate(namespace):
    """The replacements for the pure module's names (``namespace``: its globals)."""
    global _max_frame
    _max_frame = namespace["MAX_DATA_FRAME_BYTES"]
    return {"decode_ingest_stats": ingest_stats}
