"""Connection state of a connecting socket, from ZeroMQ's socket monitor.

A peer that only connects (an engine's XSUB and PUSH, a front-end's XSUB) never learns
from ZeroMQ itself that the other side died: the library reconnects quietly and the
sockets just stay silent. vLLM users reported exactly that as hangs (vLLM issue #32136).
libzmq's monitor reports the connection's life cycle (``HANDSHAKE_SUCCEEDED`` when it is
up, ``DISCONNECTED`` when it drops, at once when the peer process dies, or after the
ZMTP heartbeat timeout when the peer is unreachable) on a PAIR socket; this module turns
those events into a small state a trio task can wait on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from .trio_zmq import AsyncSocket, open_socket

__all__ = ["HEARTBEAT_OPTIONS", "ConnectionMonitor", "open_connection_monitor"]

logger = logging.getLogger(__name__)

HEARTBEAT_OPTIONS: Final[dict[int, int]] = {
    zmq.HEARTBEAT_IVL: 1000,
    zmq.HEARTBEAT_TIMEOUT: 3000,
    zmq.HEARTBEAT_TTL: 3000,
}
"""ZMTP heartbeats for a connecting socket: a peer that stops answering for 3 s (a
partition, a frozen host) counts as disconnected even though no TCP reset arrives."""

_EVENTS: Final = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_MONITOR_STOPPED
)
_counter = itertools.count()


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
            frames = await self._pair.recv_multipart()
            try:
                event = int(parse_monitor_message(frames)["event"])
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("%s: unreadable socket monitor event (%s)", self.name, exc)
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
    address = f"inproc://trio-dpcoord-monitor-{id(socket):x}-{next(_counter)}"
    socket.zmq_socket.monitor(address, _EVENTS)
    try:
        async with open_socket(context, zmq.PAIR, connect=address) as pair:
            try:
                yield ConnectionMonitor(name, pair)
            finally:
                # Stop the monitor while its PAIR peer still exists: libzmq sends a last
                # event on stopping, and that send would block forever with no peer.
                _stop(socket)
    finally:
        _stop(socket)


def _stop(socket: AsyncSocket) -> None:
    if not socket.closed:
        with contextlib.suppress(zmq.ZMQError):  # already stopped, or the context is gone
            socket.zmq_socket.disable_monitor()
