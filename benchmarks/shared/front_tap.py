"""A front-end's view of a DP coordinator that may die: every publish on its front socket
with the time it arrived, and the times the connection dropped.

The restart benchmarks (``restart_real``, ``restart_fleet``) time a coordinator's
recovery from a kill to the first publish a front-end receives from its successor. The
subscriber retries its connection every 10 ms (``RECONNECT_IVL_MS``; libzmq's default,
which vLLM's API servers keep, is 100-200 ms with its jitter): a publish goes only to
the subscribers present when it is sent, and a subscriber that came back after the
successor's first publish would time the publish after it instead. Its reconnections
are recorded too (``connects``), so that a late one can be told from a late publish. A
publish the
dead process sent just before it died may still arrive after the kill; the socket
monitor tells them apart: only publishes received after the subscriber saw its
connection drop count (libzmq hands over what a connection delivered before it reports
the connection gone, and a successor's publishes come a reconnection later).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgpack
import trio
import zmq

from tests.vllm_real import FrontPublish
from trio_dpcoord.trio_zmq import (
    AsyncSocket,
    open_context,
    open_monitor,
    open_socket,
    parse_monitor_event,
)

RECONNECT_IVL_MS = 10


@dataclass
class RecoveryTap:
    """What the subscriber saw; it subscribes to everything and never sends."""

    publishes: list[FrontPublish] = field(default_factory=list)
    disconnects: list[float] = field(default_factory=list)
    connects: list[float] = field(default_factory=list)
    """When each connection's handshake succeeded (the first one included)."""

    def dropped_after(self, at: float) -> float | None:
        """When the connection dropped first at or after ``at`` (trio time), if it did."""
        return next((t for t in self.disconnects if t >= at), None)

    def first_publish_after_drop(self, at: float) -> FrontPublish | None:
        """The first publish received after the connection dropped (after ``at``): the
        successor's first word to the front-ends."""
        since = self.dropped_after(at)
        if since is None:
            return None
        return next((p for p in self.publishes if p.at > since), None)

    def reconnected(self, at: float) -> float | None:
        """Seconds from ``at`` to the first handshake after the drop; None: none yet."""
        since = self.dropped_after(at)
        if since is None:
            return None
        return next((t - at for t in self.connects if t > since), None)

    def recovery(self, at: float) -> float | None:
        """Seconds from ``at`` (a kill) to :meth:`first_publish_after_drop`; None: none yet."""
        publish = self.first_publish_after_drop(at)
        return None if publish is None else publish.at - at


async def _receive(socket: AsyncSocket, tap: RecoveryTap) -> None:
    while True:
        for frame in await socket.recv_batch():
            try:
                counts, wave, running = msgpack.unpackb(frame)
                publish = FrontPublish(counts, int(wave), bool(running), trio.current_time())
            except (ValueError, TypeError, msgpack.UnpackException):
                continue
            tap.publishes.append(publish)


async def _watch(monitor: AsyncSocket, tap: RecoveryTap) -> None:
    while True:
        event = parse_monitor_event(await monitor.recv_multipart())
        if event.event == zmq.EVENT_DISCONNECTED:
            tap.disconnects.append(trio.current_time())
        elif event.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            tap.connects.append(trio.current_time())


@asynccontextmanager
async def open_recovery_tap(
    address: str, *, within: float = 60.0, reconnect_ivl_ms: int | None = RECONNECT_IVL_MS
) -> AsyncIterator[RecoveryTap]:
    """Subscribe to the front socket at ``address`` for the block; entered once the first
    publish arrived (``trio.TooSlowError`` if none came ``within`` seconds).
    ``reconnect_ivl_ms`` None: libzmq's default reconnection, as vLLM's API servers have."""
    tap = RecoveryTap()
    options: dict[int, int | bytes] = {zmq.SUBSCRIBE: b""}
    if reconnect_ivl_ms is not None:
        options[zmq.RECONNECT_IVL] = reconnect_ivl_ms
    async with (
        open_context() as context,
        open_socket(
            context,
            zmq.SUB,
            options=options,
        ) as socket,
        open_monitor(
            context, socket, zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        ) as monitor,
        trio.open_nursery() as nursery,
    ):
        socket.connect(address)
        nursery.start_soon(_receive, socket, tap)
        nursery.start_soon(_watch, monitor, tap)
        with trio.fail_after(within):
            while not tap.publishes:  # noqa: ASYNC110 - the receiver task appends
                await trio.sleep(0.02)
        yield tap
        nursery.cancel_scope.cancel()
