"""libzmq's socket monitors under trio: :func:`open_monitor` for the duration of a block,
:func:`parse_monitor_event` for each event it reports, :func:`accepted_peer_address` for
the peer of an accepted connection.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket as _socket
import struct
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import zmq

from ._open import open_socket
from ._socket import AsyncSocket

__all__ = ["MonitorEvent", "accepted_peer_address", "open_monitor", "parse_monitor_event"]


@dataclass(frozen=True, slots=True)
class MonitorEvent:
    """One libzmq socket-monitor event: ``event`` is a ``zmq.EVENT_*`` flag; ``value`` is
    the file descriptor for ``ACCEPTED``/``DISCONNECTED`` (else an errno or interval);
    ``endpoint`` is the socket's own bound or connected endpoint."""

    event: int
    value: int
    endpoint: str


_MONITOR_HEAD = struct.Struct("=HI")  # libzmq's monitor v1: uint16 event, uint32 value


def parse_monitor_event(frames: Sequence[bytes]) -> MonitorEvent:
    """Decode the frames of one monitor event; ``ValueError`` when they are not one.

    Our own decoder of libzmq's two-frame layout: pyzmq's ``zmq.utils.monitor`` imports
    ``zmq.asyncio`` and with it asyncio, about 1 MiB a trio process never uses."""
    try:
        head, endpoint = frames
        event, value = _MONITOR_HEAD.unpack(head)
        return MonitorEvent(event, value, bytes(endpoint).decode())
    except (struct.error, TypeError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"unreadable socket monitor event: {exc}") from exc


_monitor_ids = itertools.count()


def accepted_peer_address(fd: int) -> str:
    """The remote address (``host:port``) of a connection a monitor reported as
    ``ACCEPTED`` with descriptor ``fd``, best effort: the descriptor belongs to libzmq's
    I/O thread, so it is read through a duplicate at once, and a connection already gone
    is named by its descriptor only."""
    try:
        with _socket.socket(fileno=os.dup(fd)) as dup:
            peer = dup.getpeername()
    except OSError:
        return f"fd {fd}"
    if isinstance(peer, tuple):
        host, port = peer[0], peer[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return "a local peer" if not peer else str(peer)


@asynccontextmanager
async def open_monitor(
    context: zmq.Context[zmq.Socket[bytes]], socket: AsyncSocket, events: int
) -> AsyncIterator[AsyncSocket]:
    """libzmq's monitor of ``socket`` for the duration of the block: a PAIR socket that
    receives one multipart message per event in ``events`` (``zmq.EVENT_*`` flags; decode
    with :func:`parse_monitor_event`). Enter it before ``socket`` binds or connects to see
    every event. ``zmq.EVENT_MONITOR_STOPPED`` arrives when the monitor stops."""
    address = f"inproc://trio-dpcoord-monitor-{id(socket):x}-{next(_monitor_ids)}"
    socket._check_open()
    socket._sock.monitor(address, events)
    socket._touched()
    try:
        # An unbounded pipe (RCVHWM 0 on the connecting side makes the inproc pipe's
        # high-water mark 0): libzmq sends events with blocking sends while holding the
        # monitored socket's monitor mutex, so with the default ~1,000-event pipe a burst
        # of events (a mass disconnect) that the reader has not drained yet would block
        # libzmq's I/O thread, and stopping the monitor (one more event) would wait for ever.
        async with open_socket(context, zmq.PAIR, connect=address, options={zmq.RCVHWM: 0}) as pair:
            try:
                yield pair
            finally:
                # Stop the monitor while its PAIR peer still exists: libzmq sends a last
                # event on stopping, and that send would block forever with no peer.
                _stop_monitor(socket)
    finally:
        _stop_monitor(socket)


def _stop_monitor(socket: AsyncSocket) -> None:
    if not socket.closed:
        with contextlib.suppress(zmq.ZMQError):  # already stopped, or the context is gone
            socket._sock.disable_monitor()
        socket._touched()
