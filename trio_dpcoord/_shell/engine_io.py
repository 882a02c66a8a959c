"""The engine client's sockets (:class:`ClientSockets`) at work: the request input
(:class:`Outbox`) and, per rank, the output listener and the connection watcher
(:func:`run_client_tasks`).

The client (:mod:`.engine_client`) decides; these only move bytes. The request path is
the per-request cost of the whole client, so it takes no hop it does not need: a request
goes onto the input socket from the caller's task when nothing waits before it, and an
engine's outputs are read in batches and handed to the client as they come, one
call per message.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import trio
import zmq

from .._errors import EngineClientError
from ..trio_zmq import AsyncSocket, parse_monitor_event
from .tasks import open_task_nursery

__all__ = ["ClientSockets", "Outbox", "run_client_tasks"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClientSockets:
    """The request input (ROUTER) and, per rank, its output (PULL), the PULL's
    disconnection monitor and the address the rank connects to."""

    input: AsyncSocket
    input_address: str
    outputs: list[tuple[AsyncSocket, AsyncSocket, str]]


class Outbox:
    """The request-input socket's sender: every ADD, ABORT and UTILITY goes through
    :meth:`put`, in order.

    A message is sent at once, from the task that puts it, when nothing is queued before
    it and zmq takes it without waiting (the socket has no high-water mark, so it takes
    it, and trio runs one task at a time: a synchronous send is never interleaved with
    another). Otherwise it is queued for :meth:`run`, the one task that waits on the
    socket, which sends the queue in order as the socket allows. Either way a message
    leaves after every message put before it. (Queuing every message for the sending
    task, to send each scheduling round's in a burst, cost more per request in the
    client-ceiling benchmark than the task switch it saves: benchmarks/README.md.)
    :meth:`close` refuses further puts (``trio.ClosedResourceError``).
    """

    def __init__(self, socket: AsyncSocket) -> None:
        self._socket = socket
        self._queue: deque[list[bytes]] = deque()
        self._sender: trio.lowlevel.Task | None = None
        """The sending task while it waits for work."""
        self._closed = False

    def put(self, identity: bytes, frames: list[bytes]) -> None:
        """Send ``frames`` to the engine ``identity`` names, or queue them; never blocks."""
        if self._closed:
            raise trio.ClosedResourceError("the outbox is closed")
        message = [identity, *frames]
        if not self._queue and self._socket.send_nowait(message):
            return
        self._queue.append(message)
        sender = self._sender
        if sender is not None:
            self._sender = None
            trio.lowlevel.reschedule(sender)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Send what :meth:`put` queued, in order, waiting for the socket as it must."""
        task_status.started()
        queue = self._queue
        socket = self._socket
        while True:
            if not queue:
                self._sender = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._stop_waiting)
                continue
            while queue:
                message = queue[0]
                if not socket.send_nowait(message):
                    await socket.send_multipart(message)  # waits for the socket
                queue.popleft()

    def _stop_waiting(self, raise_cancel: object) -> trio.lowlevel.Abort:
        self._sender = None
        return trio.lowlevel.Abort.SUCCEEDED

    def close(self) -> None:
        self._closed = True


class _Client(Protocol):
    """What the tasks call on the engine client."""

    _outbox: Outbox

    def _receive_outputs(self, rank: int, frames: list[bytes]) -> None: ...

    def _rank_dead(self, rank: int, reason: str) -> None: ...

    def _reject(self, reason: str, detail: str) -> None: ...

    def _close(self) -> None: ...

    async def _watch_silence(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None: ...


@asynccontextmanager
async def run_client_tasks(client: _Client, sockets: ClientSockets) -> AsyncIterator[None]:
    """The client's tasks: the outbox's sender, the silence watch, and per rank its
    output listener and connection watcher; on the way out, whatever is in flight fails
    (``client._close``)."""
    async with open_task_nursery(
        on_exit=client._close,
        failure=lambda group: EngineClientError(f"engine client task failed: {group!r}"),
    ) as nursery:
        await nursery.start(client._outbox.run)
        await nursery.start(client._watch_silence)
        for rank, (pull, monitor, _) in enumerate(sockets.outputs):
            await nursery.start(_output_listener, client, rank, pull)
            await nursery.start(_connection_watcher, client, rank, monitor)
        yield


async def _output_listener(
    client: _Client,
    rank: int,
    socket: AsyncSocket,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Reads rank ``rank``'s output socket, every message already queued at once, and
    hands each to the client."""
    task_status.started()
    receive = client._receive_outputs
    while True:
        for frames in await socket.recv_multipart_batch():
            receive(rank, frames)


async def _connection_watcher(
    client: _Client,
    rank: int,
    monitor: AsyncSocket,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The rank's output connection closed (the process died) or was dropped by the
    heartbeats (it went silent): the rank is gone."""
    task_status.started()
    while True:
        try:
            event = parse_monitor_event(await monitor.recv_multipart())
        except ValueError as exc:
            client._reject("monitor", str(exc))
            continue
        if event.event == zmq.EVENT_DISCONNECTED:
            client._rank_dead(rank, "its output connection was lost")
