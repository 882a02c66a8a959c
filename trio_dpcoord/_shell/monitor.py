"""Connection state of ZeroMQ sockets, from libzmq's socket monitor (via the shim).

A peer that only connects (an engine's XSUB and PUSH, a front-end's XSUB) never learns
from ZeroMQ itself that the other side died: the library reconnects quietly and the
sockets just stay silent. vLLM users reported exactly that as hangs (vLLM issue #32136).
libzmq's monitor reports the connection's life cycle (``HANDSHAKE_SUCCEEDED`` when it is
up, ``DISCONNECTED`` when it drops, at once when the peer process dies, or after the
ZMTP heartbeat timeout when the peer is unreachable); :class:`ConnectionMonitor` turns
those events into a small state a trio task can wait on.

A bound socket (the coordinator's) has one connection per peer: :class:`PeerMonitor`
counts them, names each peer by its address and logs every one that is lost, with
the socket and since when it was connected.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import trio
import zmq

from ..core._pacing import BurstSummary
from ..trio_zmq import AsyncSocket, accepted_peer_address, open_monitor, parse_monitor_event
from .endpoints import DEFAULT_LIVENESS, Liveness

__all__ = [
    "HEARTBEAT_OPTIONS",
    "ConnectionMonitor",
    "PeerMonitor",
    "open_connection_monitor",
    "open_peer_monitor",
]

logger = logging.getLogger(__name__)

HEARTBEAT_OPTIONS: Final[dict[int, int]] = DEFAULT_LIVENESS.socket_options()
"""ZMTP heartbeats and TCP keepalive for a connecting socket: a peer that stops
answering for 3 s (a partition, a frozen host) counts as disconnected even though no
TCP reset arrives."""

_EVENTS: Final = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_MONITOR_STOPPED
)
_PEER_EVENTS: Final = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED


class ConnectionMonitor:
    """Whether the monitored socket is connected, and since when it is not.

    ``down_since`` is the ``trio.current_time()`` of the last drop, or of opening while
    never connected yet; None while connected.
    """

    def __init__(self, name: str, pair: AsyncSocket) -> None:
        self.name = name
        self._pair = pair
        self.connected = False
        self.ever_connected = False
        self.down_since: float | None = trio.current_time()
        self.disconnects = 0
        self.reconnects = 0
        self._changed = trio.lowlevel.ParkingLot()

    def down_for(self) -> float:
        """Seconds the connection has been down (0.0 while connected)."""
        if self.down_since is None:
            return 0.0
        return trio.current_time() - self.down_since

    async def wait_changed(self) -> None:
        """Wait for the next connect or disconnect."""
        await self._changed.park()

    def _apply(self, event: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.connected:
            if self.ever_connected:
                self.reconnects += 1
            self.connected = True
            self.ever_connected = True
            self.down_since = None
        elif event == zmq.EVENT_DISCONNECTED and self.connected:
            self.connected = False
            self.disconnects += 1
            self.down_since = trio.current_time()
        else:
            return
        self._changed.unpark_all()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply the monitor's events until cancelled; start it in the caller's nursery."""
        task_status.started()
        while True:
            try:
                event = parse_monitor_event(await self._pair.recv_multipart()).event
            except ValueError as exc:
                logger.warning("%s: %s", self.name, exc)
                continue
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            self._apply(event)


@asynccontextmanager
async def open_connection_monitor(
    context: zmq.Context[zmq.Socket[bytes]], socket: AsyncSocket, name: str
) -> AsyncIterator[ConnectionMonitor]:
    """Watch ``socket``'s connection for the duration of the block: start
    :meth:`ConnectionMonitor.run` in a nursery inside it. Enter it before the socket has
    a chance to connect, so that the first handshake is seen. (No nursery of its own, so
    exceptions pass through the block unwrapped.)"""
    async with open_monitor(context, socket, _EVENTS) as pair:
        yield ConnectionMonitor(name, pair)


class PeerMonitor:
    """The peers connected to one bound socket, from its monitor's events.

    :meth:`changes` yields True for each accepted connection and False for each lost one
    (the peer closed it, died, or stayed silent past the heartbeat timeout); the caller
    counts them (the coordinator's core does). Every loss is logged at WARNING naming
    the socket, the peer's address and since when it was connected; in a burst (a mass
    disconnect) the first few, then one summary line (the rest at DEBUG). ``key`` names the
    socket in counters (vLLM's name: ``back_publish``), ``role`` in the logs (what it
    carries: ``engine broadcast``).
    """

    def __init__(self, key: str, role: str, pair: AsyncSocket, liveness: Liveness) -> None:
        self.key = key
        self.role = role
        self.address = ""
        """The socket's endpoint, for the logs (set it once bound)."""
        self._pair = pair
        self._liveness = liveness
        self._connected: dict[int, tuple[str, float]] = {}
        """Open connections: descriptor -> (peer address, wall-clock time accepted)."""
        self._burst = BurstSummary()
        """A mass disconnect: the first few losses told one by one, then one summary."""
        self.shutdown_expected = False
        """The fleet is being stopped on purpose: losses are told at INFO, not WARNING."""

    @property
    def _loss_level(self) -> int:
        return logging.INFO if self.shutdown_expected else logging.WARNING

    def _summarize(self, now: float, *, final: bool = False) -> None:
        summary = self._burst.take_summary(now, final=final)
        if summary is not None:
            held, first, last = summary
            logger.log(
                self._loss_level,
                "%s socket %s lost %d more peers in %.1f s (each logged at DEBUG; %d left)",
                self.role,
                self.address,
                held,
                last - first,
                len(self._connected),
            )

    def _lost(self, fd: int) -> None:
        peer, since = self._connected.pop(fd, (f"fd {fd}", math.nan))
        now = trio.current_time()
        self._summarize(now)
        logger.log(
            self._loss_level if self._burst.admit(now) else logging.DEBUG,
            "%s socket %s lost peer %s (connected since %s): it closed the connection, "
            "died, or %s (%d peers left)",
            self.role,
            self.address,
            peer,
            _clock(since),
            f"answered no heartbeat for {self._liveness.heartbeat_timeout:g} s"
            if self._liveness.heartbeat_interval is not None
            else "its connection broke",
            len(self._connected),
        )

    async def changes(self) -> AsyncIterator[bool]:
        """True per accepted connection, False per lost one, until the monitor stops."""
        try:
            async for change in self._changes():
                yield change
        finally:
            self._summarize(trio.current_time(), final=True)

    async def _changes(self) -> AsyncIterator[bool]:
        while True:
            frames: list[bytes] | None = None
            with trio.move_on_at(self._burst.summary_due()):  # a burst's summary line
                frames = await self._pair.recv_multipart()
            if frames is None:
                self._summarize(trio.current_time())
                continue
            try:
                event = parse_monitor_event(frames)
            except ValueError as exc:
                logger.warning("%s socket: %s", self.role, exc)
                continue
            if event.event == zmq.EVENT_MONITOR_STOPPED:
                return
            if event.event == zmq.EVENT_ACCEPTED:
                self._connected[event.value] = (accepted_peer_address(event.value), time.time())
                yield True
            elif event.event == zmq.EVENT_DISCONNECTED:
                self._lost(event.value)
                yield False


def _clock(stamp: float) -> str:
    if math.isnan(stamp):  # accepted before the monitor started
        return "before monitoring began"
    return time.strftime("%H:%M:%S", time.localtime(stamp)) + f".{int(stamp * 1000) % 1000:03d}"


@asynccontextmanager
async def open_peer_monitor(
    context: zmq.Context[zmq.Socket[bytes]],
    socket: AsyncSocket,
    key: str,
    role: str,
    liveness: Liveness,
) -> AsyncIterator[PeerMonitor]:
    """Watch the peers of bound ``socket`` for the duration of the block (read
    :meth:`PeerMonitor.changes` in a task inside it). Enter it before binding, then set
    :attr:`PeerMonitor.address` to the bound endpoint."""
    async with open_monitor(context, socket, _PEER_EVENTS) as pair:
        yield PeerMonitor(key, role, pair, liveness)
