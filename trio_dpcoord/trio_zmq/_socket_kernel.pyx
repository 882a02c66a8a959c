# cython: language_level=3
"""The compiled twins of :func:`trio_dpcoord.trio_zmq._socket.receive_queued` and
:func:`~trio_dpcoord.trio_zmq._socket.take_messages` (the batch receive of the
engine-output listener: its first message, the EVENTS read after it, the rest), of
:func:`~trio_dpcoord.trio_zmq._socket.send_frames` (the broadcaster's send of one
message) and of ``read_events``, calling libzmq itself.

:mod:`._socket` (pure Python, pyzmq) is the spec: up to ``count`` queued messages, each
the list of its frames' bytes, appended to the batch; ``zmq.Again`` once drained, any
other error as pyzmq's ``zmq.ZMQError``, the messages taken so far kept. pyzmq makes a
``zmq.Frame`` per message to say whether more frames follow (its ``getsockopt(RCVMORE)``
costs more); here ``zmq_msg_recv`` fills a ``zmq_msg_t`` on the stack and its bytes are
copied into the one ``bytes`` object the message needs, as ``recv(copy=True)`` does.
A send goes frame by frame to ``zmq_send`` (libzmq's ``zmq_msg_init_size``, a copy and
``zmq_msg_send``, as pyzmq's ``send(copy=True)``), from the frame's buffer, in one call
for the whole message instead of pyzmq's Python ``send`` per frame.

libzmq is the copy pyzmq loaded (found in ``/proc/self/maps``, opened again by ctypes:
the same library, so the same socket objects); where it cannot be found (not Linux, a
pyzmq without a shared libzmq) this module does not import and the pure function runs,
as where it was not built. ``tests/shell/test_compiled_twin.py`` checks both over real
sockets.
"""

import ctypes
import errno as _errno

import zmq

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport uintptr_t


cdef extern from *:
    """
    #include <stddef.h>
    typedef struct { unsigned char _[64]; } __attribute__((aligned(8))) tdc_zmq_msg_t;
    typedef int (*tdc_msg_init_t)(tdc_zmq_msg_t *);
    typedef int (*tdc_msg_recv_t)(tdc_zmq_msg_t *, void *, int);
    typedef int (*tdc_msg_close_t)(tdc_zmq_msg_t *);
    typedef void *(*tdc_msg_data_t)(tdc_zmq_msg_t *);
    typedef size_t (*tdc_msg_size_t)(const tdc_zmq_msg_t *);
    typedef int (*tdc_msg_more_t)(const tdc_zmq_msg_t *);
    typedef int (*tdc_errno_t)(void);
    typedef int (*tdc_send_t)(void *, const void *, size_t, int);
    typedef int (*tdc_getsockopt_t)(void *, int, void *, size_t *);
    """
    ctypedef struct tdc_zmq_msg_t:
        pass
    ctypedef int (*tdc_msg_init_t)(tdc_zmq_msg_t *)
    ctypedef int (*tdc_msg_recv_t)(tdc_zmq_msg_t *, void *, int)
    ctypedef int (*tdc_msg_close_t)(tdc_zmq_msg_t *)
    ctypedef void *(*tdc_msg_data_t)(tdc_zmq_msg_t *)
    ctypedef size_t (*tdc_msg_size_t)(const tdc_zmq_msg_t *)
    ctypedef int (*tdc_msg_more_t)(const tdc_zmq_msg_t *)
    ctypedef int (*tdc_errno_t)()
    ctypedef int (*tdc_send_t)(void *, const void *, size_t, int)
    ctypedef int (*tdc_getsockopt_t)(void *, int, void *, size_t *)


cdef tdc_msg_init_t _msg_init
cdef tdc_msg_recv_t _msg_recv
cdef tdc_msg_close_t _msg_close
cdef tdc_msg_data_t _msg_data
cdef tdc_msg_size_t _msg_size
cdef tdc_msg_more_t _msg_more
cdef tdc_errno_t _zmq_errno
cdef tdc_send_t _send
cdef tdc_getsockopt_t _getsockopt

cdef int _DONTWAIT = zmq.NOBLOCK
cdef int _SNDMORE = zmq.SNDMORE
cdef int _EVENTS = zmq.EVENTS
cdef int _POLLIN = zmq.POLLIN
cdef int _EAGAIN = _errno.EAGAIN
cdef int _EINTR = _errno.EINTR


def _loaded_libzmq():
    """The path of the libzmq pyzmq loaded in this process, or None."""
    import zmq.backend  # noqa: F401  (loads libzmq)

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ")[-1]
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libzmq") and ".so" in name:
                    return path
    except OSError:
        return None
    return None


def _bind():
    """Point the function pointers at libzmq's (ImportError where it cannot)."""
    path = _loaded_libzmq()
    if path is None:
        raise ImportError("the libzmq pyzmq uses was not found in /proc/self/maps")
    library = ctypes.CDLL(path)
    major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    library.zmq_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
    if (major.value, minor.value, patch.value) != zmq.zmq_version_info():
        raise ImportError("the libzmq found is not the one pyzmq uses")
    names = ("zmq_msg_init", "zmq_msg_recv", "zmq_msg_close", "zmq_msg_data",
             "zmq_msg_size", "zmq_msg_more", "zmq_errno", "zmq_send",
             "zmq_getsockopt")
    a = [ctypes.cast(getattr(library, name), ctypes.c_void_p).value for name in names]
    _set(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8])


cdef void _set(uintptr_t init, uintptr_t recv, uintptr_t close, uintptr_t data,
               uintptr_t size, uintptr_t more, uintptr_t error, uintptr_t send,
               uintptr_t getsockopt):
    global _msg_init, _msg_recv, _msg_close, _msg_data, _msg_size, _msg_more, _zmq_errno
    global _send, _getsockopt
    _send = <tdc_send_t>send
    _getsockopt = <tdc_getsockopt_t>getsockopt
    _msg_init = <tdc_msg_init_t>init
    _msg_recv = <tdc_msg_recv_t>recv
    _msg_close = <tdc_msg_close_t>close
    _msg_data = <tdc_msg_data_t>data
    _msg_size = <tdc_msg_size_t>size
    _msg_more = <tdc_msg_more_t>more
    _zmq_errno = <tdc_errno_t>error


_bind()


cdef object _received(tdc_zmq_msg_t *msg):
    """The message's bytes (then closed)."""
    data = PyBytes_FromStringAndSize(<char *>_msg_data(msg), <Py_ssize_t>_msg_size(msg))
    return data


cdef int _recv(void *handle, tdc_zmq_msg_t *msg) except -1:
    """One frame into ``msg`` (initialised here); raises as pyzmq does on failure."""
    _msg_init(msg)
    if _msg_recv(msg, handle, _DONTWAIT) < 0:
        code = _zmq_errno()
        _msg_close(msg)
        if code == _EAGAIN:
            raise zmq.Again()
        raise zmq.ZMQError(code)
    return 0


cdef int _receive_into(void *handle, list batch, Py_ssize_t count) except -1:
    """Up to ``count`` queued messages onto ``batch`` (``zmq.Again`` once drained)."""
    cdef tdc_zmq_msg_t msg
    cdef Py_ssize_t i
    cdef int more
    for i in range(count):
        _recv(handle, &msg)
        more = _msg_more(&msg)
        frame = _received(&msg)
        _msg_close(&msg)
        if not more:
            batch.append([frame])
            continue
        parts = [frame]
        while more:
            # the rest of a multipart message is delivered atomically with its first part
            _recv(handle, &msg)
            more = _msg_more(&msg)
            parts.append(_received(&msg))
            _msg_close(&msg)
        batch.append(parts)
    return 0


def receive_queued(sock, list batch, Py_ssize_t count):
    """:func:`._socket.receive_queued`, compiled: the same messages, the same errors."""
    cdef void *handle = <void *><uintptr_t>sock.underlying
    if handle == NULL:
        raise zmq.ZMQError(_errno.ENOTSOCK)
    _receive_into(handle, batch, count)


cdef int _read_events(void *handle) except -1:
    """``zmq_getsockopt(ZMQ_EVENTS)`` (``EINTR``: tried again), raising as pyzmq does."""
    cdef int events = 0
    cdef size_t size = sizeof(int)
    cdef int code
    while _getsockopt(handle, _EVENTS, &events, &size) < 0:
        code = _zmq_errno()
        if code != _EINTR:
            raise zmq.ZMQError(code)
    return events


def take_messages(sock, Py_ssize_t max_messages):
    """:func:`._socket.take_messages`, compiled: the same batch, the same EVENTS, the
    same errors; the first message, the EVENTS read and the rest in one call."""
    cdef void *handle = <void *><uintptr_t>sock.underlying
    cdef int events
    cdef list batch = []
    if handle == NULL:
        raise zmq.ZMQError(_errno.ENOTSOCK)
    _receive_into(handle, batch, 1)
    if max_messages > 1:
        events = _read_events(handle)
        if not events & _POLLIN:
            return batch, events
        try:
            _receive_into(handle, batch, max_messages - 1)
        except zmq.ZMQError:
            pass  # drained (Again), or an error the next call meets: keep what was taken
    return batch, None


cdef bint _send_one(void *handle, object frame, int flags) except -1:
    """One frame (any object with the buffer protocol, as pyzmq takes); False on
    ``EAGAIN``, raises as pyzmq does on any other failure (``EINTR``: tried again)."""
    cdef Py_buffer view
    cdef int rc
    cdef int code
    if isinstance(frame, str):
        raise TypeError("unicode not allowed, use send_string")
    PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE)
    try:
        while True:
            rc = _send(handle, view.buf, <size_t>view.len, flags)
            if rc >= 0:
                return True
            code = _zmq_errno()
            if code == _EAGAIN:
                return False
            if code != _EINTR:
                raise zmq.ZMQError(code)
    finally:
        PyBuffer_Release(&view)


def send_frames(sock, frames):
    """:func:`._socket.send_frames`, compiled: the same frames taken, the same errors."""
    cdef Py_ssize_t last = len(frames) - 1
    cdef Py_ssize_t index
    cdef void *handle
    if last < 0:
        raise ValueError("a zmq message needs at least one frame")
    handle = <void *><uintptr_t>sock.underlying
    if handle == NULL:
        raise zmq.ZMQError(_errno.ENOTSOCK)
    for index in range(last):
        if not _send_one(handle, frames[index], _DONTWAIT | _SNDMORE):
            return index
    if not _send_one(handle, frames[last], _DONTWAIT):
        return last
    return last + 1


def read_events(sock):
    """:func:`._socket.read_events`, compiled: ``zmq_getsockopt(ZMQ_EVENTS)`` itself."""
    cdef void *handle = <void *><uintptr_t>sock.underlying
    if handle == NULL:
        raise zmq.ZMQError(_errno.ENOTSOCK)
    return _read_events(handle)


def accelerate(namespace):
    """The replacements for the pure module's names (``namespace``: its globals)."""
    return {
        "receive_queued": receive_queued,
        "send_frames": send_frames,
        "read_events": read_events,
        "take_messages": take_messages,
    }
