"""The trio shim's socket: :class:`AsyncSocket`, and the context and sockets it opens.

Every zmq call is made with ``zmq.NOBLOCK`` on the trio thread; on ``zmq.Again`` the task
waits and retries.  A zmq socket exposes ``zmq.FD``, which is *edge-triggered*: it turns
readable when the socket's command mailbox gets work, and *any* zmq call on the socket
(send, recv, ``getsockopt(EVENTS)``, bind, ...) may consume that edge.  So ``zmq.EVENTS``
is re-read after every failed attempt, right before waiting on the FD.

Several tasks may use one socket at once (e.g. an XPUB receiving subscriptions while
broadcasting), but trio lets only one task wait on an fd.  So exactly one waiting task --
the *FD waiter* -- sits in ``trio.lowlevel.wait_readable`` (inside its own cancel scope);
the others park in a per-direction ``ParkingLot``.  Whenever a task touches the socket
while others wait, it reads ``zmq.EVENTS`` (the true level state, edge-independent) and
wakes every waiter whose direction is now ready -- cancelling the FD waiter's scope if it is
one of them -- because its own call may have consumed the edge they were waiting for.
When the FD waiter leaves (woken, cancelled, closed) it unparks all parked tasks; each
retries, and the first to get ``zmq.Again`` again takes over the FD.  With no other waiter
(the common case) the extra cost per operation is a single integer check.  A socket
opened ``exclusive`` (one task at a time, enforced) needs none of this: its waiter waits
on the FD without a cancel scope, the cheapest wait trio offers.

Checkpoints follow trio's ``_try_sync`` idiom: ``checkpoint_if_cancelled()``, one
synchronous attempt, and on success ``cancel_shielded_checkpoint()`` -- so data that was
received is never lost to cancellation.  As in trio's ``_nonblocking_helper``, a receive
that had to wait has already passed a full checkpoint and returns without another.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar, cast

import trio
import zmq

from .._compiled import accelerate

__all__ = ["AsyncSocket"]

logger = logging.getLogger(__name__)

# Plain ints: pyzmq's constants are enum.Flag members, and ``events & zmq.POLLIN`` or
# ``zmq.NOBLOCK | zmq.SNDMORE`` builds a new Flag object (EnumType.__call__) on every
# operation, which showed in the wave-path profile.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK_SNDMORE = _NOBLOCK | _SNDMORE
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_get_option: Callable[[zmq.Socket[bytes], int], int] = zmq.Socket.getsockopt  # type: ignore[assignment]
"""``getsockopt`` for the int options (EVENTS), called unbound: typed ``int`` without a
``typing.cast`` call per read (pyzmq's stubs say ``int | bytes`` for every option)."""

_Received = TypeVar("_Received")


class AsyncSocket:
    """A trio wrapper around a ``zmq.Socket`` used only from the trio thread.

    Any number of tasks may send and receive concurrently.  A multipart message is sent in
    one synchronous call, so it is atomic with respect to other senders.

    ``exclusive=True`` declares that one task at a time uses the socket (as a coordinator's
    engine-output socket is used by its listener alone): an operation started while a task
    waits on the socket raises :class:`trio.BusyResourceError`, as trio's own streams do.
    In exchange its waits skip the cancel scope that lets another task wake the FD waiter,
    which was a fifth of the CPU a message that wakes a sleeping process costs.
    """

    closed: bool
    last_endpoint: str | None
    receive_waited: bool
    """Whether the last receive waited on the FD: the socket had nothing queued when it
    began, or when the receive before it ended (a batch ends on an EVENTS read that the
    next receive trusts). Either way the queue was empty a moment ago: how a reader tells
    it keeps up (``_backlog.py``)."""

    def __init__(self, socket: zmq.Socket[bytes], *, exclusive: bool = False) -> None:
        self._sock = socket
        self._exclusive = exclusive
        self._fd = cast(int, socket.getsockopt(zmq.FD))
        self._type = cast(int, socket.getsockopt(zmq.TYPE))
        self.closed = False
        self.last_endpoint = None
        self.receive_waited = False
        # Tasks currently inside _wait (the FD waiter plus parked tasks).
        self._waiting = 0
        self._fd_scope: trio.CancelScope | None = None
        self._fd_events = 0
        self._parked_in = trio.lowlevel.ParkingLot()
        self._parked_out = trio.lowlevel.ParkingLot()
        # Tasks parked in either lot: with none (the common case) waking them is skipped.
        self._parked = 0
        # Remaining frames of a message whose continuation frame got zmq.Again (libzmq
        # counts HWM in whole messages, so this should never happen; handled anyway).
        self._send_tail: list[bytes] | None = None
        # EVENTS as read by the last zmq call on this socket, when that call was the read
        # itself; any other call clears it (see _touched). The next receive starts from it
        # instead of reading EVENTS again: one zmq call (and pyzmq's enum lookup) less.
        self._events_hint: int | None = None

    # -- plumbing ---------------------------------------------------------------------

    @property
    def zmq_socket(self) -> zmq.Socket[bytes]:
        """The wrapped socket.  After calling it directly, call :meth:`notify_touched`
        before this ``AsyncSocket`` is used again (and at once if other tasks wait on it):
        a direct call may consume the FD's edge."""
        self._events_hint = None
        return self._sock

    def _check_open(self) -> None:
        if self.closed:
            raise trio.ClosedResourceError("zmq socket was closed")
        if self._waiting and self._exclusive:
            raise trio.BusyResourceError(f"another task is waiting on exclusive {self!r}")

    def _dispatch(self, events: int) -> None:
        """Wake every waiter whose direction is ready according to ``events``."""
        if self._parked:
            if events & _POLLIN:
                self._parked_in.unpark_all()
            if events & _POLLOUT:
                self._parked_out.unpark_all()
        scope = self._fd_scope
        if scope is not None and events & self._fd_events:
            scope.cancel()

    def _touched(self, events: int | None = None) -> None:
        """We just made a zmq call; it may have eaten the edge another task waits for.
        ``events``: what EVENTS said, when that read was the call (it becomes the hint)."""
        if self._waiting:
            if events is None:
                events = read_events(self._sock)
            # _dispatch's cases, checked here: a send while the FD waiter waits for input
            # (an XPUB's subscriptions, the wave path) wakes nobody, without a call
            if self._parked or (self._fd_scope is not None and events & self._fd_events):
                self._dispatch(events)
        self._events_hint = events

    def notify_touched(self) -> None:
        """Re-check readiness for waiting tasks after using :attr:`zmq_socket` directly."""
        self._check_open()
        self._touched()

    async def _wait(self, event: int, suspect: int = 0, events: int | None = None) -> int:
        """Wait until ``event`` may be ready (spurious returns allowed); caller retries.

        Must be called right after a zmq call on this socket returned ``zmq.Again``, or
        with ``events``: the ``EVENTS`` the caller read as its last zmq call (not ready).
        ``suspect`` counts the caller's consecutive attempts for which ``EVENTS`` claimed
        readiness although the call failed; the updated count is returned.
        """
        self._waiting += 1
        try:
            if events is None:
                self._events_hint = None
                events = read_events(self._sock)
            if self._waiting > 1:
                self._dispatch(events)
            deadline = math.inf
            if events & event:
                suspect += 1
                if suspect == 1:
                    # Probably became ready between the failed call and now: retry at
                    # once, through a checkpoint.
                    await trio.lowlevel.checkpoint()
                    return suspect
                # EVENTS keeps claiming readiness that the call denies (e.g. XPUB with
                # XPUB_NODROP always reports POLLOUT): wait for the FD as usual, with a
                # short, growing timeout in case the claim was right after all.
                deadline = trio.current_time() + min(0.0005 * 2**suspect, 0.05)
            else:
                suspect = 0
            if self._exclusive:
                # nobody else can have eaten the edge: no scope to be woken through
                if deadline == math.inf:
                    await trio.lowlevel.wait_readable(self._fd)
                else:
                    with trio.move_on_at(deadline):
                        await trio.lowlevel.wait_readable(self._fd)
            elif self._fd_scope is None:
                scope = trio.CancelScope(deadline=deadline)
                self._fd_scope = scope
                self._fd_events = event
                try:
                    with scope:
                        await trio.lowlevel.wait_readable(self._fd)
                finally:
                    self._fd_scope = None
                    # Hand the FD over: parked tasks retry, one of them becomes FD waiter.
                    if self._parked:
                        self._parked_in.unpark_all()
                        self._parked_out.unpark_all()
            else:
                self._parked += 1
                try:
                    with trio.CancelScope(deadline=deadline):
                        await (self._parked_in if event == _POLLIN else self._parked_out).park()
                finally:
                    self._parked -= 1
            return suspect
        finally:
            self._waiting -= 1

    # -- setup --------------------------------------------------------------------------

    def bind(self, address: str) -> str:
        """Bind and return the resolved endpoint (``tcp://127.0.0.1:0`` -> real port)."""
        self._check_open()
        try:
            self._sock.bind(address)
            endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        finally:
            self._touched()
        self.last_endpoint = endpoint
        return endpoint

    def connect(self, address: str) -> None:
        self._check_open()
        try:
            self._sock.connect(address)
        finally:
            self._touched()

    def setsockopt(self, option: int, value: int | bytes) -> None:
        self._check_open()
        try:
            self._sock.setsockopt(option, value)
        finally:
            self._touched()

    def getsockopt(self, option: int) -> int | bytes:
        self._check_open()
        try:
            value: int | bytes = self._sock.getsockopt(option)
        finally:
            self._touched()
        return value

    # -- sending ------------------------------------------------------------------------

    def _try_send(self, frames: Sequence[bytes]) -> bool:
        """One synchronous attempt; True once the message is committed to zmq."""
        self._events_hint = None
        if self._send_tail is not None and not self._flush_tail():
            return False
        sent = send_frames(self._sock, frames)
        if sent == len(frames):
            return True
        if sent == 0:
            return False
        logger.warning("zmq refused a continuation frame; finishing it later")
        self._send_tail = list(frames[sent:])
        return True

    def _flush_tail(self) -> bool:
        self._events_hint = None
        tail = self._send_tail
        assert tail is not None
        sent = send_frames(self._sock, tail)
        if sent < len(tail):
            del tail[:sent]
            return False
        self._send_tail = None
        return True

    async def send(self, frame: bytes) -> None:
        await self.send_multipart((frame,))

    async def send_multipart(self, frames: Sequence[bytes]) -> None:
        """Send one message; waits (respecting HWM backpressure) while zmq says Again."""
        if not frames:
            raise ValueError("a zmq message needs at least one frame")
        await trio.lowlevel.checkpoint_if_cancelled()
        suspect = 0
        while True:
            self._check_open()
            try:
                sent = self._try_send(frames)
            except BaseException:
                self._touched()
                raise
            if sent:
                break
            suspect = await self._wait(_POLLOUT, suspect)
        self._touched()
        # A continuation frame was refused: the message is committed, so finish it even
        # if cancelled (only closing the socket stops this).
        while self._send_tail is not None:
            with trio.CancelScope(shield=True):
                suspect = await self._wait(_POLLOUT, suspect)
            self._check_open()
            if self._send_tail is not None:  # another sender may have finished it
                try:
                    self._flush_tail()
                finally:
                    self._touched()
        await trio.lowlevel.cancel_shielded_checkpoint()

    def send_nowait(self, frames: Sequence[bytes]) -> bool:
        """Synchronous non-blocking send attempt; True if the message was sent."""
        if not frames:
            raise ValueError("a zmq message needs at least one frame")
        if self.closed or (self._waiting and self._exclusive):
            self._check_open()  # raises
        try:
            return self._try_send(frames)
        finally:
            if self._waiting:
                self._touched()  # another task waits on the socket: EVENTS again
            else:
                self._events_hint = None  # _touched() without waiters, one call less

    # -- receiving ----------------------------------------------------------------------

    async def _receive(
        self, take: Callable[[zmq.Socket[bytes], int], tuple[_Received, int | None]], count: int
    ) -> _Received:
        """The one receive loop: ``take(socket, count)`` is a synchronous attempt that
        raises ``zmq.Again`` when nothing is queued, else returns what it took and the
        ``EVENTS`` it read as its last zmq call (None if it did not); on Again wait for
        the FD and try again. ``take`` and ``count`` are passed, not bound in a closure:
        no function object per receive.

        ``zmq.EVENTS`` is read before each attempt: the previous receive usually drained
        the socket, and an attempt that fails raises ``zmq.Again``, an exception object per
        empty receive (it showed in the wave path's profile), where EVENTS is an int. Read
        right before waiting, it is also the re-check the edge-triggered FD needs. When
        the last zmq call on the socket *was* an EVENTS read (a batch receive ends with
        one), its value is used once instead: no call since can have eaten an edge, so
        waiting on the FD is safe, and a hint used up cannot make the loop spin. After a
        wait, the attempt comes first: the FD woke the task, so a message is most likely
        queued (a wave report to an idle coordinator), and an EVENTS read before it would
        be one zmq call more (a ``poll`` system call inside libzmq) on the wake path; a
        spurious wake costs the ``zmq.Again`` instead, and ``_wait`` re-reads EVENTS.

        An exclusive socket's wait for a readable FD is made here, not through
        :meth:`_wait` (the same wait): one coroutine less to pass through on every wake,
        as the wave path's profile counts them.

        ``_try_sync`` checkpoints: cancellation is checked before the first attempt, and
        what ``take()`` returned is never lost to it; a receive that had to wait has passed
        a full checkpoint and returns without another. A receive that waits before its
        first attempt (the wave path: EVENTS said nothing is queued) has its cancellation
        checked by the wait itself, so the check before the attempt is made only when no
        wait came first.
        """
        sock = self._sock
        suspect = 0
        waited = False
        while True:
            if self.closed or (self._waiting and self._exclusive):
                self._check_open()
            if not waited:
                events = self._events_hint
                if events is None:
                    events = read_events(sock)
                else:
                    self._events_hint = None
                if not events & _POLLIN:
                    if self._exclusive:
                        # _wait(_POLLIN, suspect, events) without its coroutine: EVENTS
                        # denies readiness, so the claim count starts again
                        suspect = 0
                        self._waiting += 1
                        try:
                            await trio.lowlevel.wait_readable(self._fd)
                        finally:
                            self._waiting -= 1
                    else:
                        suspect = await self._wait(_POLLIN, suspect, events)
                    waited = True
                    continue
                await trio.lowlevel.checkpoint_if_cancelled()  # never yields unless it raises
            else:
                self._events_hint = None  # another task's, from before our call
            try:
                received, events_read = take(sock, count)
            except zmq.Again:
                suspect = await self._wait(_POLLIN, suspect)
                waited = True
                continue
            except BaseException:
                self._touched()
                raise
            self._touched(events_read)
            self.receive_waited = waited
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return received

    async def recv(self) -> bytes:
        """Receive one frame."""
        return await self._receive(_take_frame, 1)

    async def recv_multipart(self) -> list[bytes]:
        """Receive one (whole) multipart message."""
        return await self._receive(_take_message, 1)

    async def recv_batch(self, max_messages: int = 1000) -> list[bytes]:
        """Wait for at least one frame, then also take every frame already queued (up to
        ``max_messages``) without waiting again.  Meant for single-frame messages (the
        parts of a multipart message come back as separate items)."""
        if max_messages < 1:
            raise ValueError("max_messages must be >= 1")
        return await self._receive(_take_frames, max_messages)

    async def recv_multipart_batch(self, max_messages: int = 1000) -> list[list[bytes]]:
        """Like :meth:`recv_batch`, for multipart messages (:func:`take_messages`,
        compiled where built)."""
        if max_messages < 1:
            raise ValueError("max_messages must be >= 1")
        return await self._receive(take_messages, max_messages)

    # -- closing ------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close (LINGER 0).  Waiting tasks get ``trio.ClosedResourceError``.  Idempotent;
        always a checkpoint; the socket is closed even if this is cancelled."""
        if not self.closed:
            self.closed = True
            trio.lowlevel.notify_closing(self._fd)
            self._parked_in.unpark_all()
            self._parked_out.unpark_all()
            self._send_tail = None
            self._sock.close(linger=0)
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> AsyncSocket:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        try:
            name = zmq.SocketType(self._type).name
        except ValueError:
            name = str(self._type)
        return f"<AsyncSocket {name} {'closed' if self.closed else f'fd={self._fd}'}>"


def _take_frame(sock: zmq.Socket[bytes], count: int) -> tuple[bytes, None]:
    """One frame (``zmq.Again``: nothing queued); no EVENTS read."""
    return sock.recv(_NOBLOCK), None


def _take_message(sock: zmq.Socket[bytes], count: int) -> tuple[list[bytes], None]:
    """One whole multipart message (``zmq.Again``: nothing queued); no EVENTS read."""
    return sock.recv_multipart(_NOBLOCK), None


def _receive_frames(sock: zmq.Socket[bytes], batch: list[bytes], count: int) -> None:
    """Up to ``count`` queued frames onto ``batch`` (``zmq.Again`` once drained)."""
    recv, append = sock.recv, batch.append
    for _ in range(count):
        append(recv(_NOBLOCK))


def _take_queued(
    sock: zmq.Socket[bytes],
    receive: Callable[[zmq.Socket[bytes], list[_Received], int], None],
    max_messages: int,
) -> tuple[list[_Received], int | None]:
    """``receive(sock, batch, 1)`` (``zmq.Again`` propagates: nothing queued), then
    whatever is already queued, up to ``max_messages`` in all, without waiting
    (``receive(sock, batch, n)`` appends up to ``n``, raising ``zmq.Again`` once
    drained); returns the batch and, when the batch ended on an EVENTS read that said
    nothing more is queued, that EVENTS (the caller's hint for the next receive), else
    None. After the first message EVENTS says whether more are queued: a lone message
    (every wave report) then ends the batch without the ``zmq.Again`` a drained socket
    raises. Past the first message, ``zmq.Again`` (drained) or any other
    ``zmq.ZMQError`` ends the batch: the messages already taken must not be lost, and
    another error resurfaces on the next call."""
    batch: list[_Received] = []
    receive(sock, batch, 1)
    if max_messages > 1:
        events = read_events(sock)
        if not events & _POLLIN:
            return batch, events
        with contextlib.suppress(zmq.ZMQError):
            receive(sock, batch, max_messages - 1)
    return batch, None


def _take_frames(sock: zmq.Socket[bytes], max_messages: int) -> tuple[list[bytes], int | None]:
    """The batch of single frames (a multipart message's frames come as separate items)."""
    return _take_queued(sock, _receive_frames, max_messages)


def take_messages(
    sock: zmq.Socket[bytes], max_messages: int
) -> tuple[list[list[bytes]], int | None]:
    """The batch receive's attempt (:func:`_take_queued` of :func:`receive_queued`): at
    least one message or ``zmq.Again``, the batch, and the EVENTS it ended on (or None).
    Its compiled twin (``_socket_kernel.pyx``) does all of it in one call into C."""
    return _take_queued(sock, receive_queued, max_messages)


def read_events(sock: zmq.Socket[bytes]) -> int:
    """``zmq.EVENTS`` of ``sock`` (``POLLIN`` / ``POLLOUT`` now; libzmq processes the
    socket's pending commands first, which may consume the FD's edge: see the module's
    docstring). A few per wave; its compiled twin (``_socket_kernel.pyx``) calls libzmq's
    ``zmq_getsockopt`` itself, without pyzmq's option-type lookup."""
    return _get_option(sock, _EVENTS)


def send_frames(sock: zmq.Socket[bytes], frames: Sequence[bytes]) -> int:
    """Send ``frames`` as one message without waiting (``SNDMORE`` on all but the last);
    how many of them zmq took: 0 when it refused the first (``zmq.Again``: nothing is
    committed), ``len(frames)`` once all went, in between when it refused a continuation
    frame (libzmq counts its high-water mark in whole messages, so that should never
    happen; the caller keeps the rest). Any other error raises as pyzmq's. The
    broadcaster's send (START_DP_WAVE to every engine is one message: the XPUB copies it
    to each). Its compiled twin (``_socket_kernel.pyx``) calls libzmq's ``zmq_send``
    itself: no pyzmq ``send`` (a Python method) per frame."""
    if not frames:
        raise ValueError("a zmq message needs at least one frame")
    send = sock.send
    last = len(frames) - 1
    for index in range(last):
        try:
            send(frames[index], _NOBLOCK_SNDMORE)
        except zmq.Again:
            return index
    try:
        send(frames[last], _NOBLOCK)
    except zmq.Again:
        return last
    return last + 1


def receive_queued(sock: zmq.Socket[bytes], batch: list[list[bytes]], count: int) -> None:
    """Append up to ``count`` queued messages of ``sock`` (each a list of its frames'
    bytes) to ``batch``, without waiting; ``zmq.Again`` once drained, as any other
    ``zmq.ZMQError``, with the messages taken so far on ``batch``. The engine-output
    listener's hot loop: the single-frame case inline, ``Frame.more`` where pyzmq's
    ``getsockopt(RCVMORE)`` costs more (0.8 us). Its compiled twin
    (``_socket_kernel.pyx``) calls libzmq itself, without a ``zmq.Frame`` per message."""
    recv, append = sock.recv, batch.append
    for _ in range(count):
        frame = recv(_NOBLOCK, copy=False)
        if frame.more:
            parts = [frame.bytes]
            while frame.more:
                frame = recv(_NOBLOCK, copy=False)
                parts.append(frame.bytes)
            append(parts)
        else:
            append([frame.bytes])


accelerate(globals(), "trio_dpcoord.trio_zmq._socket_kernel")  # the compiled twin, if built
