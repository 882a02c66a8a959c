"""The front-end side of the coordinator's front socket, for trio front-ends.

What a vLLM 0.33.0 DP client does with the front socket (docs/protocol.md §7.1), as a trio
async context manager: an XSUB connected to the coordinator's front address keeps the
latest ``(counts, wave, running)`` publish, requests are routed with vLLM's score
(§7.2) or the prefix policy (the same :class:`EngineChooser` an embedded front-end
uses), and
``SCALE_ELASTIC_EP`` and the legacy FIRST_REQ go upstream on the same socket.

Four tasks, data flowing one way through each::

    coordinator front XPUB ─► XSUB ─► publish receiver (batch, keep the latest) ─► state
    scale(), notify_first_request() ─► [send channel] ─► sender ─► XSUB ─► coordinator
    socket monitor events ─► monitor ─► connection watcher (log; give up when gone)

The sender is the only code that sends on the XSUB (its subscription included). The
monitor and the watcher follow the connection itself (a ZeroMQ socket monitor plus ZMTP
heartbeats): a lost connection is logged at once, and with ``coordinator_timeout`` the
front-end gives up with :class:`CoordinatorError` instead of following a dead coordinator
forever (vLLM issue #32136). ZeroMQ reconnects by itself and the XSUB re-sends its
subscription, so a coordinator restarted on the same address is followed again and its
next publish arrives.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import final

import trio
import zmq

from .. import protocol
from .._errors import CoordinatorClosedError, CoordinatorError
from .._reject_log import RejectLog
from ..core._frontend import FrontendState, FrontendStatistics
from ..core._wave import HEARTBEAT_INTERVAL, WaveSnapshot
from ..protocol import EngineLoad
from ..routing._chooser import Routing
from ..routing._settings import PrefixRouting
from ..trio_zmq import AsyncSocket, curve_client_options, open_context, open_socket
from .monitor import HEARTBEAT_OPTIONS, ConnectionMonitor, open_connection_monitor
from .tasks import open_task_nursery

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["Frontend", "open_frontend"]

logger = logging.getLogger(__name__)


@final
class Frontend:
    """The handle :func:`open_frontend` yields: the coordinator as one front-end sees it.

    Built complete by :func:`open_frontend` once its socket is connected. Every method is
    synchronous and cheap, for use from trio tasks; only :meth:`wait_for` awaits.
    Properties are fixed settings; methods read what changes (docs/api.md's rule).
    """

    def __init__(
        self, front_address: str, monitor: ConnectionMonitor, state: FrontendState
    ) -> None:
        self._front_address = front_address
        self._state = state
        """Every rule: what the publishes said, the claim, the engine choice (sans-IO)."""
        self._closed = False
        self._reject = RejectLog(logger)
        self._observers = trio.lowlevel.ParkingLot()
        self._send, self._send_queue = trio.open_memory_channel[bytes](math.inf)
        self._monitor = monitor
        self._lost: CoordinatorError | None = None

    @property
    def front_address(self) -> str:
        """The coordinator front socket this front-end follows."""
        return self._front_address

    @property
    def client_index(self) -> int:
        return self._state.client_index

    @property
    def client_count(self) -> int:
        return self._state.client_count

    @property
    def routing(self) -> Routing:
        """The engine-choice policy: ``"vllm"`` or ``"prefix"``."""
        return self._state.routing

    @property
    def engine_count(self) -> int:
        """How many engines the latest publish listed (``engine_count`` as given to
        :func:`open_frontend` before one; 0 if unknown yet)."""
        return self._state.engine_count

    # --- reading the coordinator's state ---------------------------------------------

    def snapshot(self) -> WaveSnapshot:
        """The wave to stamp on a new request, and whether the engines run."""
        return self._state.snapshot()

    def engine_loads(self) -> tuple[EngineLoad, ...]:
        """Per engine ``(waiting, running, kv_cache_usage)`` from the latest publish.

        Before the first publish with counts: zeros for ``engine_count`` engines (empty
        if that was not given).
        """
        return self._state.engine_loads()

    def statistics(self) -> FrontendStatistics:
        """Publishes received (``last_publish_time`` in ``trio.current_time()``) and
        rejected by reason (logged at WARNING), connection drops, this front-end's
        requests in flight per engine and the prefix policy's counters: a frozen copy."""
        return self._state.statistics(disconnects=self._monitor.disconnects)

    def coordinator_silent_for(self) -> float:
        """Seconds since the latest publish (since opening, before the first one).

        The coordinator sends a heartbeat every 5 s at the latest, so much more than
        that means it is gone or unreachable.
        """
        return trio.current_time() - self._state.silent_since()

    def connected(self) -> bool:
        """Whether the connection to the coordinator's front socket is up now."""
        return self._monitor.connected

    async def wait_for(self, predicate: Callable[[Frontend], bool]) -> None:
        """Wait until ``predicate(self)`` holds; re-checked after every batch of publishes.

        Raises :class:`CoordinatorClosedError` if the front-end closes first. Combine
        with ``trio.fail_after`` to bound the wait.
        """
        while not predicate(self):
            if self._closed:
                raise CoordinatorClosedError("the front-end has stopped")
            await self._observers.park()

    # --- routing ----------------------------------------------------------------------

    def choose(self, prompt_token_ids: Sequence[int] | None = None) -> int:
        """The engine for one new request, by the routing policy with the latest loads.

        vLLM 0.33.0's score by default; with ``routing="prefix"``, ``prompt_token_ids``
        lets the choice weigh what each engine has cached (without them, least loaded).
        Counts the request as in flight on that engine until :meth:`finished`.
        Before any load report the in-flight counts alone spread requests over the
        engines.
        """
        return self._state.choose(prompt_token_ids, trio.current_time())

    def observe(self, engine_index: int, prompt_token_ids: Sequence[int]) -> bool:
        """A request went to ``engine_index`` without :meth:`choose` (a pinned
        ``data_parallel_rank``): the prefix policy learns it (no-op with vLLM's).
        Returns whether it now counts in flight there: only then must
        :meth:`finished` follow when it ends (otherwise that would release the
        count of a request the chooser placed)."""
        return self._state.observe(engine_index, prompt_token_ids, trio.current_time())

    def receive_kv_events(self, engine_index: int, seq: int, payload: bytes) -> bool:
        """One of ``engine_index``'s vLLM KV-event batches (from its ``--kv-events-config``
        PUB socket: the frame's sequence number and msgpack payload), the prefix policy's
        exact feed. False if rejected (logged at WARNING, counted in
        :meth:`statistics`) or when not routing by prefix."""
        return self._state.receive_kv_events(engine_index, seq, payload, trio.current_time())

    def finished(self, engine_index: int) -> None:
        """A request routed to ``engine_index`` finished (vLLM's ``finished_requests``):
        its in-flight count is released."""
        self._state.finished(engine_index)

    # --- commands to the coordinator -------------------------------------------------

    def resize(self, engine_count: int) -> None:
        """Elastic EP: ask the coordinator to resize its load table (``SCALE_ELASTIC_EP``)."""
        self._queue(FrontendState.resize(engine_count))
        logger.info("asking the coordinator to resize to %d engines", engine_count)

    def notify_first_request(self, engine_index: int) -> None:
        """A request is being routed to ``engine_index``: wake the engines if they sleep.

        The legacy FIRST_REQ path (docs/protocol.md §7.4): if the latest publish says paused,
        the local snapshot flips to running at once (so concurrent requests send one
        notice) and ``[engine_index, wave]`` goes to the coordinator, which wakes the
        engines with PR #46833's rule. vLLM 0.33.0 engines wake themselves; this is for
        front-ends that want the coordinator to do it. ``TypeError`` for a non-int,
        ``ValueError`` for an index outside the engines (when their count is known),
        :class:`CoordinatorClosedError` once stopped, as the embedded handle.
        """
        if self._closed:
            raise CoordinatorClosedError("the front-end has stopped")
        frame = self._state.claim_first_request(engine_index)
        if frame is not None:
            self._queue(frame)

    def _queue(self, frame: bytes) -> None:
        if self._closed:
            raise CoordinatorClosedError("the front-end has stopped")
        self._send.send_nowait(frame)

    # --- the tasks ----------------------------------------------------------------------

    async def _sender(
        self,
        sub: AsyncSocket,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The only code that sends on the XSUB: the subscription first, then commands."""
        await sub.send(protocol.SUBSCRIBE)
        task_status.started()
        async for frame in self._send_queue:
            await sub.send(frame)

    async def _publish_receiver(
        self,
        sub: AsyncSocket,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Drains the publishes in batches; the latest wave and the latest counts win."""
        task_status.started()
        while True:
            frames = await sub.recv_batch()
            for reject in self._state.receive_publishes(frames, trio.current_time()):
                self._reject(reject.reason, reject.detail)
            self._observers.unpark_all()

    def _give_up_at(self, monitor: ConnectionMonitor, timeout: float | None) -> float:
        if timeout is None:
            return math.inf
        if monitor.down_since is not None:
            return monitor.down_since + timeout
        return self._state.silent_since() + max(timeout, 2 * HEARTBEAT_INTERVAL)

    async def _watch_connection(
        self,
        monitor: ConnectionMonitor,
        give_up_after: float | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Log connection drops at once; with ``give_up_after``, raise when the coordinator
        is gone: the connection down that long, or no publish for
        ``max(give_up_after, 2 * HEARTBEAT_INTERVAL)`` s while connected (a hung one)."""
        task_status.started()
        seen_disconnects = 0
        timeout = give_up_after
        while True:
            with trio.move_on_at(self._give_up_at(monitor, timeout)):
                await monitor.wait_changed()
                if monitor.disconnects > seen_disconnects:
                    seen_disconnects = monitor.disconnects
                    logger.warning(
                        "lost the connection to the coordinator at %s (last wave %d); reconnecting",
                        self.front_address,
                        self._state.snapshot().current_wave,
                    )
                elif monitor.connected:
                    logger.info("connected to the coordinator at %s", self.front_address)
                continue
            if trio.current_time() < self._give_up_at(monitor, timeout):
                continue  # a publish or a reconnection moved the deadline
            if monitor.down_since is not None:
                why = (
                    f"connection down for {monitor.down_for():.1f} s"
                    if monitor.ever_connected
                    else "never connected"
                )
            else:
                why = "connected, but silent"
            message = (
                f"no publish from the coordinator at {self.front_address} for "
                f"{self.coordinator_silent_for():.1f} s ({why}; coordinator_timeout "
                f"{timeout:g} s): it is gone"
            )
            logger.error("%s", message)
            self._lost = CoordinatorError(message)
            raise self._lost

    @asynccontextmanager
    async def _running_tasks(
        self, sub: AsyncSocket, coordinator_timeout: float | None
    ) -> AsyncIterator[None]:
        """The four tasks (publish receiver, sender, monitor, connection watcher) running
        for the duration of the block; leaving it, or any task failing, closes the
        handle (a failure becomes :meth:`_failure`'s error)."""
        async with open_task_nursery(on_exit=self._close, failure=self._failure) as nursery:
            await nursery.start(self._publish_receiver, sub)
            await nursery.start(self._sender, sub)
            await nursery.start(self._monitor.run)
            await nursery.start(self._watch_connection, self._monitor, coordinator_timeout)
            logger.info(
                "front-end %d of %d following the coordinator at %s",
                self.client_index,
                self.client_count,
                self.front_address,
            )
            yield

    def _failure(self, group: BaseExceptionGroup[BaseException]) -> BaseException:
        """What a failed background task becomes: the coordinator-lost error if that is
        all it was, else one CoordinatorError."""
        lost = self._lost
        if (
            lost is not None
            and group.split(lambda e: e is lost or isinstance(e, trio.Cancelled))[1] is None
        ):
            return lost
        return CoordinatorError(f"front-end task failed: {group!r}")

    def _close(self) -> None:
        self._closed = True
        self._send.close()
        self._observers.unpark_all()


@asynccontextmanager
async def open_frontend(
    front_address: str,
    *,
    client_index: int = 0,
    client_count: int = 1,
    engine_count: int | None = None,
    coordinator_timeout: float | None = None,
    curve_server_key: bytes | None = None,
    routing: Routing = "vllm",
    prefix_routing: PrefixRouting | None = None,
) -> AsyncIterator[Frontend]:
    """Follow a coordinator's front socket for the duration of the block.

    ``front_address`` is the ``front`` endpoint the standalone coordinator printed (or
    :attr:`Coordinator.front_address`). ``client_index`` of ``client_count`` front-ends
    sets where this one's engine scan starts, as in vLLM; ``engine_count``, if known,
    lets :meth:`Frontend.choose` work before the first publish arrives.
    ``routing``: how :meth:`Frontend.choose` chooses, ``"vllm"`` (vLLM 0.33.0's
    score, the default) or ``"prefix"`` (prefix-cache affinity weighed against the
    busiest rank, settings in ``prefix_routing``); see :class:`EngineChooser`.
    ``curve_server_key``: the coordinator's ``curve_public_key`` when it runs with
    CURVE (this front-end then connects as a CURVE client with a fresh key pair).

    Yields once the XSUB is connected and subscribed (the coordinator answers a
    subscription with a publish as soon as its start-up gate is open). A dropped
    connection is logged at once (WARNING); ZeroMQ reconnects and re-subscribes, so a
    coordinator restarted on the same address is followed again. With
    ``coordinator_timeout`` the block is cancelled and :class:`CoordinatorError` ("no
    publish from the coordinator ... it is gone", also logged at ERROR) raised when the
    connection has been down that long (a dead coordinator process drops it at once; an
    unreachable host after the 3 s heartbeat timeout), or when no publish came for
    ``max(coordinator_timeout, 10)`` s while connected (a healthy coordinator publishes
    at least every 5 s). Leaving the block stops every task and closes the socket; a
    failure inside raises :class:`CoordinatorError` with the original exceptions as its
    cause; an exception from the block itself propagates unchanged.
    """
    if coordinator_timeout is not None and not coordinator_timeout > 0:
        raise ValueError(f"coordinator_timeout must be positive, got {coordinator_timeout!r}")
    state = FrontendState(
        client_index=client_index,
        client_count=client_count,
        engine_count=engine_count,
        now=trio.current_time(),
        routing=routing,
        prefix_routing=prefix_routing,
    )
    handle: Frontend | None = None
    try:
        async with AsyncExitStack() as stack:
            sub, monitor = await _connect_front_socket(stack, front_address, curve_server_key)
            handle = Frontend(front_address, monitor, state)
            async with handle._running_tasks(sub, coordinator_timeout):
                yield handle
    finally:
        if handle is not None:
            handle._close()


async def _connect_front_socket(
    stack: AsyncExitStack, front_address: str, curve_server_key: bytes | None
) -> tuple[AsyncSocket, ConnectionMonitor]:
    """The XSUB connected to ``front_address`` and its connection monitor, both closed
    with ``stack``; :class:`CoordinatorError` if ZeroMQ refuses the address."""
    context = await stack.enter_async_context(open_context())
    try:
        sub = await stack.enter_async_context(
            open_socket(
                context,
                zmq.XSUB,
                options={
                    zmq.LINGER: 0,
                    **HEARTBEAT_OPTIONS,
                    **curve_client_options(curve_server_key),
                },
            )
        )
        # Monitored before connecting, so that the first handshake is seen.
        monitor = await stack.enter_async_context(
            open_connection_monitor(context, sub, "front-end coordinator link")
        )
        sub.connect(front_address)
    except zmq.ZMQError as exc:
        raise CoordinatorError(
            f"cannot connect to the coordinator's front socket {front_address!r}: {exc}"
        ) from exc
    return sub, monitor
