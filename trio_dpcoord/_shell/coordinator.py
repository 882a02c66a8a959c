"""The coordinator service: the sans-IO core wired to ZeroMQ by a handful of trio pumps.

One nursery runs::

    handle.route / notify_first_request (claim and apply, in the caller's task) ────┐
    front XPUB ─► command receiver (front-ends' subscriptions, FIRST_REQ, SCALE) ────┤
    engine PUSH ─► PULL ─► engine-output listener (batch receive) ──────────────────┤
    back XPUB subscriptions ─► subscription watcher ────────────────────────────────┤
    core.next_deadline() ─► timer (timed publishes, wake deadlines) ─► core.tick() ─┤
    socket monitors (peers connected, lost) ─► peer watchers ───────────────────────┤
                 every pump: core.<input>(..., now) under the lock, effects dispatched
                                         in the same critical section
          [memory channel] ─► broadcaster ─┬► back XPUB ─► engines  (READY, START_DP_WAVE)
                                           └► front XPUB ─► front-ends (publishes)

Every rule lives in :class:`~trio_dpcoord.core.CoordinatorCore`; the pumps only move
bytes. Data flows one way and every socket has exactly one sending task (the
broadcaster sends on both XPUBs: what one wave decides, START_DP_WAVE then the publish
of the new state, leaves in one scheduler pass, engines first). The core is
called under a plain :class:`threading.Lock`, never held across an ``await``, and its
effects are enqueued in the same critical section, so broadcasts and publishes leave in
the order they were decided, and other threads may read the snapshot. The one timer
waits for the core's next deadline; an input that moves it earlier moves the wait.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Final, TypeAlias, final

import trio
import zmq

from .._errors import CoordinatorClosedError, CoordinatorError, ReadyTimeoutError
from ..core._coordinator import (
    Broadcast,
    CoordinatorCore,
    CoordinatorCounters,
    Effect,
    Publish,
    Reject,
    SubscriptionView,
)
from ..core._wave import WaveSnapshot
from ..protocol import EngineLoad
from ..routing._chooser import EngineChooser, Routing
from ..routing._prefix_router import PrefixRouting
from ..trio_zmq import AsyncSocket, open_context, open_socket
from .endpoints import DEFAULT_LIVENESS, Liveness, PrivateIpcDirectory, bind_socket
from .monitor import PeerMonitor, open_peer_monitor
from .tasks import RejectLog, open_task_nursery
from .view import Route

__all__ = ["Coordinator", "open_coordinator"]

logger = logging.getLogger(__name__)

_LISTENER_BATCH: Final = 64
"""Engine outputs taken per receive. A wave start that arrives while a batch is applied
waits for all of it: with 1,000 per batch, wake-ups under stats load (N = 8, 52,000
reports/s, next to vLLM's coordinator under the same load) took 23 ms at the median,
21x vLLM's; with 64, 4 ms (1.4x) and a p99 below vLLM's. Ingest throughput stayed
within the noise of interleaved rounds."""

Outgoing: TypeAlias = Broadcast | Publish
"""What the broadcaster carries out: the core's effects that go out on a socket."""

_XPUB_OPTIONS: Final[dict[int, int | bytes]] = {
    # Verbose: every engine's subscription reaches the gate (vLLM's setting); verboser:
    # every unsubscription too, so a vanished peer shows.
    zmq.XPUB_VERBOSE: 1,
    zmq.XPUB_VERBOSER: 1,
    zmq.LINGER: 0,
}


@dataclass(frozen=True, slots=True)
class _SocketSpec:
    """How one of the coordinator's sockets is opened, and what the logs call it."""

    socket_type: int
    options: dict[int, int | bytes]
    exclusive: bool
    """One task alone receives on it (see :class:`~trio_dpcoord.trio_zmq.AsyncSocket`)."""
    ipc_name: str
    """Its file in the private ``ipc://`` directory."""
    role: str
    """What it carries, for the logs and bind errors."""


_SOCKETS: Final[dict[str, _SocketSpec]] = {
    # by key: vLLM's name for the socket, used in counters and the handle's addresses
    "back_publish": _SocketSpec(zmq.XPUB, _XPUB_OPTIONS, False, "back-publish", "engine broadcast"),
    "back_output": _SocketSpec(
        zmq.PULL, {zmq.RCVHWM: 0, zmq.LINGER: 0}, True, "back-output", "engine output"
    ),
    "front": _SocketSpec(zmq.XPUB, _XPUB_OPTIONS, False, "front", "front"),
}


class _Pumps:
    """The core, its lock, and the tasks that feed it and carry out what it returns."""

    def __init__(self, core: CoordinatorCore) -> None:
        self.core = core
        self.lock = threading.Lock()
        self.closed = False
        self.monitors: list[PeerMonitor] = []
        """The bound sockets' peer monitors (their log level follows expect_shutdown)."""
        self.ready = trio.Event()
        self.observers = trio.lowlevel.ParkingLot()
        # The listener waits here after a wave start under load (see engine_output_listener)
        self.drained = trio.lowlevel.ParkingLot()
        self.reject_log = RejectLog(logger)
        self.outgoing, self._outgoing_queue = trio.open_memory_channel[list[Outgoing]](math.inf)
        self._timer: trio.CancelScope | None = None
        """The timer task's wait, until the core's next deadline."""

    def changed(self) -> None:
        if self.observers:
            self.observers.unpark_all()

    def dispatch(self, effects: Sequence[Effect]) -> bool:
        """Hand each effect to its owner. Called under the lock, right after the core.
        What the broadcaster sends goes as one channel item per core call. True when one
        of the effects was a broadcast."""
        outgoing: list[Outgoing] = []
        broadcast = False
        for effect in effects:
            if isinstance(effect, Reject):
                self.reject_log(effect.reason, effect.detail)
            else:
                outgoing.append(effect)
                broadcast = broadcast or type(effect) is Broadcast
        if outgoing:
            self.outgoing.send_nowait(outgoing)
        return broadcast

    def reschedule(self) -> None:
        """Under the lock, after an input: if it moved the core's next deadline earlier,
        wake the timer task sooner (a later one it finds by itself when it wakes)."""
        timer = self._timer
        if timer is not None:
            due = self.core.next_deadline()
            if due < timer.deadline:
                timer.deadline = due

    # --- the pumps ------------------------------------------------------------------------

    async def broadcaster(
        self,
        xpub: AsyncSocket,
        front: AsyncSocket | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The only code that sends: on the engine broadcast socket and, in standalone
        mode, on the front socket, whatever the core decided, in the order it decided it.

        One task for both sockets: a wave's START_DP_WAVE and its publish take one task
        step, not two, and the engines' message always goes first (two tasks woken in one
        scheduler pass run in either order). Each send is first tried synchronously:
        the channel's receive is the loop's checkpoint.
        """
        task_status.started()
        async for items in self._outgoing_queue:
            await self._send_queued(items, xpub, front)

    async def _send_queued(
        self, items: list[Outgoing], xpub: AsyncSocket, front: AsyncSocket | None
    ) -> None:
        """Send ``items`` and whatever is already queued behind them, in this task step (a
        second receive would cost a scheduler pass of its own), then tell the core what
        went out, under the lock once."""
        sent_broadcasts: list[Broadcast] = []
        publishes = 0
        while True:
            for item in items:
                if isinstance(item, Broadcast):
                    if not xpub.send_nowait(item.frames):
                        await xpub.send_multipart(item.frames)
                    sent_broadcasts.append(item)
                else:
                    assert front is not None, "publishes need a front socket"
                    if not front.send_nowait((item.payload,)):
                        await front.send(item.payload)
                    publishes += 1
            try:
                items = self._outgoing_queue.receive_nowait()
            except trio.WouldBlock:
                break
        if self.drained:
            self.drained.unpark_all()
        with self.lock:
            now = trio.current_time()
            for broadcast in sent_broadcasts:
                self.core.broadcast_sent(broadcast, now)
            for _ in range(publishes):
                self.core.publish_sent()
            ready = sent_broadcasts and not self.ready.is_set() and self.core.ready_sent()
        if ready:
            logger.info("READY sent to %d engines", self.core.subscriptions().current)
            self.ready.set()
        if sent_broadcasts:
            self.changed()

    async def timer(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The one timer: sleeps until the core's next deadline (timed publishes, wake
        confirmations, burst summaries), then tells the core the time. An input that moves
        the deadline earlier moves this wait's deadline too (:meth:`reschedule`)."""
        task_status.started()
        try:
            while True:
                with self.lock:
                    due = self.core.next_deadline()
                with trio.move_on_at(due) as self._timer:
                    await trio.sleep_forever()
                with self.lock:
                    self.dispatch(self.core.tick(trio.current_time()))
                self.changed()
        finally:
            self._timer = None
            with self.lock:
                self.core.log_summaries(trio.current_time(), final=True)

    async def subscription_watcher(
        self, xpub: AsyncSocket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Engines (un)subscribing on the broadcast socket: the start-up gate (§5.2)."""
        task_status.started()
        await self._apply_each_frame(xpub, self.core.receive_engine_subscription)

    async def _apply_each_frame(
        self, socket: AsyncSocket, receive: Callable[[bytes, float], Sequence[Effect]]
    ) -> None:
        """For ever: a batch from ``socket``, each frame given to the core's ``receive``
        under the lock once per batch, its effects dispatched, the timer rescheduled."""
        while True:
            frames = await socket.recv_batch()
            with self.lock:
                now = trio.current_time()
                for frame in frames:
                    self.dispatch(receive(frame, now))
                self.reschedule()
            self.changed()

    async def engine_output_listener(
        self, pull: AsyncSocket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Engine outputs in batches (§5.4, §5.5); applied before the gate opens too.

        A message that makes the core decide a broadcast (a wave start) ends the piece of
        the batch applied under the lock. Under load (a batch of more than one message)
        the listener then waits until the broadcaster has sent what is queued, so that
        START_DP_WAVE leaves before the stats reports behind it are applied: one yield is
        not enough, since trio runs the tasks woken in one scheduler pass in either
        order, and in half the passes the rest of the batch (up to a thousand reports)
        went first. A batch of one means the queue was empty: no wait, no extra pass.
        The wait is cancelled only when the service stops, and then nothing received
        matters any more. Within a piece, the load reports are checked and counted in
        order but only each engine's newest is written (``stats_coalesced`` counts the
        others), as the piece ends: wave reports are not kept waiting behind the stats
        queued before them, and whoever takes the lock next finds the table as if every
        report had been applied.
        """
        task_status.started()
        core = self.core
        receive = core.receive_engine_output
        while True:
            batch = await pull.recv_multipart_batch(_LISTENER_BATCH)
            count = len(batch)
            index = 0
            while index < count:
                urgent = False
                with self.lock:
                    now = trio.current_time()
                    if index == 0:  # empty before this batch (it waited) or after it
                        drained = pull.receive_waited or count < _LISTENER_BATCH
                        core.engine_output_batch_read(drained=drained, now=now)
                    # Load reports are held and only each engine's newest is written, as
                    # the lock is let go (the same table as one by one, see the core).
                    while index < count:
                        effects = receive(batch[index], now, hold_stats=True)
                        index += 1
                        if effects and self.dispatch(effects):
                            urgent = True
                            break
                    self.dispatch(core.apply_held_stats())
                    self.reschedule()
                self.changed()
                if urgent and count > 1:
                    await self.drained.park()

    async def command_receiver(
        self, front: AsyncSocket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The front socket: front-ends' subscriptions and their commands, FIRST_REQ and
        SCALE_ELASTIC_EP, applied by the core as they are read (§5.3, §5.8, §4.9)."""
        task_status.started()
        await self._apply_each_frame(front, self.core.receive_front_frame)

    async def peer_watcher(
        self, peers: PeerMonitor, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Peers connecting to and lost by one bound socket (the monitor logs each loss)."""
        task_status.started()
        async for opened in peers.changes():
            with self.lock:
                now = trio.current_time()
                if opened:
                    self.core.connection_opened(peers.key, now)
                else:
                    self.core.connection_lost(peers.key, now)
            self.changed()

    def notify_first_request(self, engine_index: int) -> int:
        """The handle's claim, applied in the caller's task (see the handle); returns the
        wave to stamp on the request, read in the same critical section."""
        with self.lock:
            if self.closed:
                raise CoordinatorClosedError("the coordinator has stopped")
            wave = self.core.snapshot().current_wave
            claim = self.core.claim_first_request(engine_index)
            if claim is not None:
                self.dispatch(self.core.receive_command(claim, trio.current_time()))
                self.reschedule()
        if claim is not None:
            self.changed()
        return wave

    def close(self) -> None:
        # The channel stays open: a task that already holds received frames when the
        # nursery is cancelled still enqueues what they cause (the cancel stops it at its
        # next checkpoint); a closed channel would fail it with ClosedResourceError.
        with self.lock:
            self.closed = True


@final
class Coordinator:
    """The handle :func:`open_coordinator` yields: what an embedding front-end uses.

    Built complete by :func:`open_coordinator` once every socket is bound. Every method is
    synchronous and cheap, safe from any trio task; :meth:`snapshot`,
    :meth:`engine_loads`, :meth:`subscriptions`, :meth:`statistics` and
    :attr:`engine_count` may also be called from other threads (:meth:`route`,
    :meth:`observe` and :meth:`finished` only from trio tasks). Properties are fixed
    settings; methods read what changes (the README's rule).
    """

    def __init__(
        self,
        pumps: _Pumps,
        addresses: dict[str, str | None],
        chooser: EngineChooser,
        curve_public_key: bytes | None,
        *,
        ready_timeout: float | None,
    ) -> None:
        """``addresses``: the bound address of each socket, by its key in the counters."""
        self._pumps = pumps
        self._chooser = chooser
        self._core = pumps.core
        self._lock = pumps.lock
        self._back_publish_address = addresses["back_publish"] or ""
        self._back_output_address = addresses["back_output"] or ""
        self._front_address = addresses["front"]
        self._curve_public_key = curve_public_key
        self._ready_timeout = ready_timeout
        self._ready_deadline = (
            math.inf if ready_timeout is None else trio.current_time() + ready_timeout
        )

    @property
    def back_publish_address(self) -> str:
        """Where engines connect their XSUB (vLLM's back-pub; READY and START_DP_WAVE)."""
        return self._back_publish_address

    @property
    def back_output_address(self) -> str:
        """Where engines connect their PUSH (vLLM's back-out; stats and wave reports)."""
        return self._back_output_address

    @property
    def front_address(self) -> str | None:
        """Where front-ends connect their XSUB (vLLM's front publish socket), if bound."""
        return self._front_address

    @property
    def curve_public_key(self) -> bytes | None:
        """The CURVE server key peers need, when ``curve_secret_key`` was given."""
        return self._curve_public_key

    @property
    def ready_timeout(self) -> float | None:
        return self._ready_timeout

    @property
    def wave_coordination(self) -> bool:
        """Whether waves are coordinated (fixed at start, as in vLLM)."""
        return self._core.wave_coordination

    @property
    def wake_confirm_timeout(self) -> float:
        return self._core.wake_confirm_timeout

    @property
    def engine_count(self) -> int:
        """How many engines the load table holds (changes only with SCALE_ELASTIC_EP)."""
        with self._lock:
            return self._core.engine_count()

    @property
    def chooser(self) -> EngineChooser:
        """The engine chooser :meth:`route` asks (its policy, :meth:`~EngineChooser.statistics`
        and, with ``routing="prefix"``, ``receive_kv_events`` for the exact feed)."""
        return self._chooser

    def snapshot(self) -> WaveSnapshot:
        """The wave to stamp on a new request, and whether the engines run."""
        with self._lock:
            return self._core.snapshot()

    def engine_loads(self) -> tuple[EngineLoad, ...]:
        """Every engine's latest :class:`EngineLoad`, in rank order."""
        with self._lock:
            return self._core.engine_loads()

    def notify_first_request(self, engine_index: int) -> None:
        """A request is being routed to ``engine_index``: wake the engines if they sleep.

        Synchronous and non-blocking; call it from a trio task. If the snapshot says
        paused, it flips to running at once and the first-request notice is applied in
        the same critical section (vLLM PR #46833's rule), its START_DP_WAVE handed to the
        broadcaster's channel. If the engines already run
        (or a wake-up is already claimed) nothing happens, so concurrent callers coalesce
        behind one broadcast. ``TypeError`` for a non-int, ``ValueError`` for an index
        outside the table, :class:`CoordinatorClosedError` once stopped.
        """
        self._pumps.notify_first_request(engine_index)

    def route(self, prompt_token_ids: Sequence[int] | None = None) -> Route:
        """Route one new request: the rank :attr:`chooser` picks from the live loads
        (``prompt_token_ids`` serve ``routing="prefix"``), the wave to stamp on it, and
        the wake of paused engines (:meth:`notify_first_request`), in one call, in that
        order and with no checkpoint between. The request counts in flight on that rank
        until :meth:`finished`. :class:`CoordinatorClosedError` once stopped."""
        if self._pumps.closed:
            raise CoordinatorClosedError("the coordinator has stopped")
        loads = self.engine_loads()
        rank = self._chooser.choose(loads, prompt_token_ids, now=trio.current_time())
        return Route(rank, self._pumps.notify_first_request(rank))

    def observe(self, engine_index: int, prompt_token_ids: Sequence[int]) -> bool:
        """A request went to ``engine_index`` without :meth:`route` (pinned; its wave and
        wake: :meth:`snapshot`, :meth:`notify_first_request`): the prefix policy learns it
        (no-op with vLLM's). True if it now counts in flight (then :meth:`finished`)."""
        return self._chooser.observe(engine_index, prompt_token_ids, now=trio.current_time())

    def finished(self, engine_index: int) -> None:
        """A request :meth:`route` sent to ``engine_index`` (or :meth:`observe` counted
        there) finished (vLLM's ``finished_requests``): its in-flight count is released."""
        self._chooser.finished(engine_index)

    def subscriptions(self) -> SubscriptionView:
        """The engines' subscriptions as seen on the broadcast socket."""
        with self._lock:
            return self._core.subscriptions()

    def silent_engines(self) -> list[int]:
        """Ranks that never sent anything on the engine output socket (subscriptions carry
        no identity, so this is how a stuck start-up gate names who is missing)."""
        with self._lock:
            return self._core.silent_engines()

    def expect_shutdown(self) -> None:
        """The engines are being stopped on purpose (call it just before stopping them):
        from now on an engine leaving, its lost connections and its unsubscription, is
        logged at INFO instead of WARNING (still counted, still summed up in a burst), so
        that a normal shutdown does not read like an outage."""
        with self._lock:
            self._core.expect_shutdown()
            for monitor in self._pumps.monitors:
                monitor.shutdown_expected = True

    def statistics(self) -> CoordinatorCounters:
        """What was received, decided, sent and rejected since the start: a frozen copy."""
        with self._lock:
            return self._core.counters()

    async def wait_ready(self) -> None:
        """Return once READY has been broadcast (every expected engine subscribed).

        Raises :class:`ReadyTimeoutError` if that did not happen within
        ``ready_timeout`` seconds of the coordinator's start.
        """
        with trio.move_on_at(self._ready_deadline):
            await self._pumps.ready.wait()
            return
        view = self.subscriptions()
        expected = self._core.expected_engines
        raise ReadyTimeoutError(
            f"start-up gate still closed after {self._ready_timeout} s: "
            f"{view.current} of {expected} engines subscribed to "
            f"{self._back_publish_address} ({expected - view.current} missing); "
            f"ranks never heard from on {self._back_output_address}: {self.silent_engines()}"
        )

    async def wait_for(self, predicate: Callable[[Coordinator], bool]) -> None:
        """Wait until ``predicate(self)`` holds; re-checked after every observable change
        (wave transitions, subscriptions, applied stats, rejected inputs, sends). Combine
        with ``trio.fail_after`` to bound the wait."""
        while not predicate(self):
            await self._pumps.observers.park()


def _curve_server(curve_secret_key: bytes | None) -> tuple[bytes | None, dict[int, int | bytes]]:
    """The public key and socket options of a CURVE server, or no security at all."""
    if curve_secret_key is None:
        return None, {}
    if not zmq.has("curve"):
        raise CoordinatorError("this libzmq was built without CURVE support")
    try:
        public_key = zmq.curve_public(curve_secret_key)
    except (zmq.ZMQError, ValueError, TypeError) as exc:
        raise CoordinatorError(f"bad CURVE secret key: {exc}") from exc
    return public_key, {zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: curve_secret_key}


@dataclass(frozen=True, slots=True)
class _Bound:
    """The coordinator's sockets, bound, with the addresses peers connect to."""

    back_publish: AsyncSocket
    back_output: AsyncSocket
    front: AsyncSocket | None
    addresses: dict[str, str | None]


def _requested_sockets(
    back_publish_address: str | None, back_output_address: str | None, front_address: str | None
) -> dict[str, str | None]:
    """Each socket's bind address by its key: the engine sockets always (None becomes
    ``""``, a private ``ipc://`` path), the front socket only when asked for."""
    return {
        "back_publish": back_publish_address or "",
        "back_output": back_output_address or "",
        "front": front_address,
    }


@asynccontextmanager
async def _open_bound_sockets(
    pumps: _Pumps,
    requested: dict[str, str | None],
    curve_options: dict[int, int | bytes],
    liveness: Liveness,
    allow_remote: bool,
) -> AsyncIterator[_Bound]:
    """The sockets bound for the block; the private ``ipc://`` directory goes once every
    socket is closed."""
    async with AsyncExitStack() as sockets:
        private_dir = PrivateIpcDirectory()
        sockets.callback(private_dir.cleanup)
        yield await _bind_sockets(
            sockets, pumps, requested, private_dir, curve_options, liveness, allow_remote
        )


async def _bind_sockets(
    sockets: AsyncExitStack,
    pumps: _Pumps,
    requested: dict[str, str | None],
    private_dir: PrivateIpcDirectory,
    curve_options: dict[int, int | bytes],
    liveness: Liveness,
    allow_remote: bool,
) -> _Bound:
    """Open, monitor and bind each socket ``requested`` names (None: not wanted, ``""``:
    a private ``ipc://`` path); each monitor is entered before its bind, so that no
    connection goes unseen. Heartbeats where they help (``Liveness.for_address``)."""
    context = await sockets.enter_async_context(open_context())
    bound: dict[str, AsyncSocket] = {}
    addresses: dict[str, str | None] = dict.fromkeys(requested)
    for key, address in requested.items():
        if address is None:
            continue
        spec = _SOCKETS[key]
        address = address or private_dir.address(spec.ipc_name)
        socket_liveness = liveness.for_address(address)
        options = {**spec.options, **curve_options, **socket_liveness.socket_options()}
        socket = await sockets.enter_async_context(
            open_socket(context, spec.socket_type, options=options, exclusive=spec.exclusive)
        )
        monitor = await sockets.enter_async_context(
            open_peer_monitor(context, socket, key, spec.role, socket_liveness)
        )
        pumps.monitors.append(monitor)
        monitor.address = bind_socket(socket, address, allow_remote=allow_remote, what=spec.role)
        bound[key], addresses[key] = socket, monitor.address
    return _Bound(bound["back_publish"], bound["back_output"], bound.get("front"), addresses)


@asynccontextmanager
async def _running_pumps(pumps: _Pumps, bound: _Bound) -> AsyncIterator[None]:
    """Every pump running on the bound sockets for the block; their failure comes out as
    one :class:`CoordinatorError`."""
    async with open_task_nursery(
        on_exit=pumps.close,
        failure=lambda group: CoordinatorError(f"coordinator task failed: {group!r}"),
    ) as nursery:
        await _start_pumps(nursery, pumps, bound)
        yield


async def _start_pumps(nursery: trio.Nursery, pumps: _Pumps, bound: _Bound) -> None:
    await nursery.start(pumps.broadcaster, bound.back_publish, bound.front)
    await nursery.start(pumps.timer)
    await nursery.start(pumps.subscription_watcher, bound.back_publish)
    await nursery.start(pumps.engine_output_listener, bound.back_output)
    for monitor in pumps.monitors:
        await nursery.start(pumps.peer_watcher, monitor)
    if bound.front is not None:
        await nursery.start(pumps.command_receiver, bound.front)
    logger.info(
        "coordinator for %d engines: broadcast %s, outputs %s, front %s",
        pumps.core.expected_engines,
        *bound.addresses.values(),
    )


@asynccontextmanager
async def open_coordinator(
    engine_count: int,
    *,
    back_publish_address: str | None = None,
    back_output_address: str | None = None,
    front_address: str | None = None,
    ready_timeout: float | None = 60.0,
    wave_coordination: bool = True,
    stats_interval: float = 0.1,
    allow_remote: bool = False,
    wake_confirm_timeout: float = 30.0,
    curve_secret_key: bytes | None = None,
    liveness: Liveness = DEFAULT_LIVENESS,
    routing: Routing = "vllm",
    prefix_routing: PrefixRouting | None = None,
) -> AsyncIterator[Coordinator]:
    """Run a DP wave coordinator for ``engine_count`` engines for the duration of the block.

    Binds the engine broadcast socket (XPUB, vLLM's back-pub: ``back_publish_address``),
    the engine output socket (PULL, back-out: ``back_output_address``) and, with
    ``front_address``, vLLM's front publish socket (XPUB) as the standalone process does.
    None (or ``""``; for the front socket only ``""``) means an ``ipc://`` path in a
    private directory removed on exit; ``tcp://127.0.0.1:0`` is resolved to its port.
    Yields the :class:`Coordinator` once every socket is bound and every task runs;
    engines get READY when ``engine_count`` of them have subscribed. Leaving the block
    stops every task and closes every socket; a failure inside the service raises
    :class:`CoordinatorError` (the original exceptions as its cause), an exception from
    the block itself propagates unchanged.

    ``wake_confirm_timeout``: a first-request start no engine confirms within it (rank 0
    reports every start it joins) was dropped by paused engines, so ``engines_running``
    goes back to False instead of staying latched. ``curve_secret_key`` (Z85; off by
    default, vLLM's engines cannot use it): every socket a CURVE server, encrypted, only
    peers that know :attr:`Coordinator.curve_public_key` connect. ``liveness``: ZMTP
    heartbeats and TCP keepalive, so a silent peer (a partition, a dead node) is dropped
    within about ``liveness.notice_within`` seconds, counted in ``connections_lost``,
    logged, and given READY again when it comes back and subscribes. ``routing`` and
    ``prefix_routing``: the policy of :meth:`Coordinator.route` (see :class:`EngineChooser`).
    """
    chooser = EngineChooser(engine_count, routing=routing, prefix_routing=prefix_routing)
    core = CoordinatorCore(
        engine_count,
        wave_coordination=wave_coordination,
        stats_interval=stats_interval,
        wake_confirm_timeout=wake_confirm_timeout,
        publish_to_front_ends=front_address is not None,
    )
    curve_public_key, curve_options = _curve_server(curve_secret_key)
    pumps = _Pumps(core)
    requested = _requested_sockets(back_publish_address, back_output_address, front_address)
    async with _open_bound_sockets(
        pumps, requested, curve_options, liveness, allow_remote
    ) as bound:
        handle = Coordinator(
            pumps, bound.addresses, chooser, curve_public_key, ready_timeout=ready_timeout
        )
        async with _running_pumps(pumps, bound):
            yield handle
