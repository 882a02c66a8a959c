"""The coordinator service: the sans-IO core wired to ZeroMQ by a handful of trio pumps.

One nursery runs, per the design card::

    handle.notify_first_request (claim and apply, in the caller's task) ────────────┐
    front receiver (FIRST_REQ, SCALE) ─► [command channel] ─► command receiver ─────┤
    engine PUSH ─► PULL ─► engine-output listener (batch receive) ──────────────────┤
    back XPUB subscriptions ─► subscription watcher ────────────────────────────────┤
    wake deadlines ─► wake watchdog ────────────────────────────────────────────────┤
    socket monitors (peers connected, lost) ─► peer watchers ───────────────────────┤
                 every pump: core.<input>(..., now) under the lock, effects dispatched
                                         in the same critical section
          [broadcast channel] ─► broadcaster ─┬► back XPUB ─► engines  (READY, START_DP_WAVE)
                                              └► front XPUB ─► front-ends (publishes)

Every rule lives in :class:`~trio_dpcoord._core.CoordinatorCore`; the pumps only move
bytes. Data flows one way and every socket has exactly one sending task (the
broadcaster sends on both XPUBs: what one wave decides, START_DP_WAVE then the publish
of the new state, leaves in one scheduler pass, engines first). The core is
called under a plain :class:`threading.Lock`, never held across an ``await``, and its
effects are enqueued in the same critical section, so broadcasts and publishes leave in
the order they were decided, and other threads may read the snapshot.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Final, TypeAlias, final

import trio
import zmq

from ._core import (
    ArmWakeDeadline,
    Broadcast,
    Command,
    CoordinatorCore,
    CoordinatorCounters,
    Effect,
    Publish,
    Reject,
    RescheduleTimedPublish,
    SubscriptionView,
)
from ._endpoints import DEFAULT_LIVENESS, Liveness, PrivateIpcDirectory, check_bind_address
from ._errors import CoordinatorClosedError, CoordinatorError, ReadyTimeoutError
from ._monitor import PeerMonitor, open_peer_monitor
from ._state import WaveSnapshot
from ._tasks import RejectLog, open_task_nursery
from .protocol import EngineLoad
from .trio_zmq import AsyncSocket, open_context, open_socket

__all__ = ["Coordinator", "open_coordinator"]

logger = logging.getLogger(__name__)

_LISTENER_BATCH: Final = 64
"""Engine outputs taken per receive. A wave start that arrives while a batch is applied
waits for all of it: with 1,000 per batch, wake-ups under stats load (N = 8, 52,000
reports/s, next to vLLM's coordinator under the same load) took 23 ms at the median,
21x vLLM's; with 64, 4 ms (1.4x) and a p99 below vLLM's. Ingest throughput stayed
within the noise of interleaved rounds."""

Outgoing: TypeAlias = Broadcast | Publish | RescheduleTimedPublish
"""What the broadcaster carries out: the core's effects that go out on a socket."""

_XPUB_OPTIONS: Final[dict[int, int | bytes]] = {
    # Verbose: every engine's subscription reaches the gate (vLLM's setting); verboser:
    # every unsubscription too, so a vanished peer shows.
    zmq.XPUB_VERBOSE: 1,
    zmq.XPUB_VERBOSER: 1,
    zmq.LINGER: 0,
}


class _Pumps:
    """The core, its lock, and the tasks that feed it and carry out what it returns."""

    def __init__(self, core: CoordinatorCore) -> None:
        self.core = core
        self.lock = threading.Lock()
        self.closed = False
        self.ready = trio.Event()
        self.observers = trio.lowlevel.ParkingLot()
        # The listener waits here after a wave start under load (see engine_output_listener)
        self.drained = trio.lowlevel.ParkingLot()
        self.reject_log = RejectLog(logger)
        self.broadcasts, self._broadcast_queue = trio.open_memory_channel[Sequence[Outgoing]](
            math.inf
        )
        self.commands, self._command_queue = trio.open_memory_channel[Command](math.inf)
        self._deadlines, self._deadline_queue = trio.open_memory_channel[ArmWakeDeadline](
            math.inf
        )

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
            if isinstance(effect, (Broadcast, Publish, RescheduleTimedPublish)):
                outgoing.append(effect)
                broadcast = broadcast or type(effect) is Broadcast
            elif isinstance(effect, ArmWakeDeadline):
                self._deadlines.send_nowait(effect)
            elif isinstance(effect, Reject):
                self.reject_log(effect.reason, effect.detail)
            else:
                self.commands.send_nowait(effect)
        if outgoing:
            self.broadcasts.send_nowait(outgoing)
        return broadcast

    # --- the pumps ------------------------------------------------------------------------

    async def broadcaster(
        self,
        xpub: AsyncSocket,
        front: AsyncSocket | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The only code that sends: on the engine broadcast socket and, in standalone
        mode, on the front socket (the publishes the core decided, in order with the
        broadcasts, and a timed publish whenever one is due).

        One task for both sockets: a wave's START_DP_WAVE and its publish take one task
        step, not two, and the engines' message always goes first (two tasks woken in one
        scheduler pass run in either order). Each send is first tried synchronously:
        the channel's receive is the loop's checkpoint. One cancel scope per *timed*
        publish, not per item: its deadline follows the core's schedule.
        """
        task_status.started()
        while True:
            with self.lock:
                due = self.core.next_publish_due()
            with trio.CancelScope(deadline=due) as timer:
                async for items in self._broadcast_queue:
                    due = await self._send_queued(items, xpub, front, timer)
                    if due != timer.deadline:
                        # (trio re-registers a scope's deadline on every assignment)
                        timer.deadline = due
            # The deadline passed: the timed publish (only ever due with a front socket).
            # It carries the state as of when it is built, so what was decided before it
            # and is still queued goes out first (a receive past its deadline does not
            # look at the queue): otherwise a queued wave publish would follow it with an
            # older wave, and front-ends would see the wave go back or a stale "paused".
            await self._send_queued((), xpub, front, None)
            assert front is not None
            with self.lock:
                payload = self.core.timed_publish(trio.current_time())
            await front.send(payload)
            with self.lock:
                self.core.publish_sent()

    async def _send_queued(
        self,
        items: Sequence[Outgoing],
        xpub: AsyncSocket,
        front: AsyncSocket | None,
        timer: trio.CancelScope | None,
    ) -> float:
        """Send ``items`` and whatever is already queued behind them, in this task step (a
        second receive would cost a scheduler pass of its own), then tell the core what
        went out, under the lock once. Returns when the next timed publish is due.

        Each send is first tried synchronously; one that must wait is not cut short by
        ``timer`` (the timed publish's scope): a decided send always completes.
        """
        sent_broadcasts: list[Broadcast] = []
        publishes = 0
        while True:
            for item in items:
                if type(item) is Broadcast:
                    if not xpub.send_nowait(item.frames):
                        if timer is not None:
                            timer.deadline = math.inf
                        await xpub.send_multipart(item.frames)
                    sent_broadcasts.append(item)
                elif type(item) is Publish:
                    assert front is not None, "publishes need a front socket"
                    if not front.send_nowait((item.payload,)):
                        if timer is not None:
                            timer.deadline = math.inf
                        await front.send(item.payload)
                    publishes += 1
                # a RescheduleTimedPublish only asks for the schedule to be read again
            try:
                items = self._broadcast_queue.receive_nowait()
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
            due = self.core.next_publish_due()
        if sent_broadcasts:
            if not self.ready.is_set() and any(b.wave_start is None for b in sent_broadcasts):
                logger.info("READY sent to %d engines", self.core.subscriptions().current)
                self.ready.set()
            self.changed()
        return due

    async def subscription_watcher(
        self, xpub: AsyncSocket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Engines (un)subscribing on the broadcast socket: the start-up gate (§5.2)."""
        task_status.started()
        try:
            while True:
                frames: Sequence[bytes] = ()
                with trio.move_on_at(self.core.log_summary_due()):  # a burst's summary line
                    frames = await xpub.recv_batch()
                with self.lock:
                    now = trio.current_time()
                    for frame in frames:
                        self.dispatch(self.core.receive_engine_subscription(frame, now))
                    self.core.log_summaries(now)
                if frames:
                    self.changed()
        finally:
            with self.lock:
                self.core.log_summaries(trio.current_time(), final=True)

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
        matters any more.
        """
        task_status.started()
        receive = self.core.receive_engine_output
        while True:
            batch = await pull.recv_multipart_batch(_LISTENER_BATCH)
            count = len(batch)
            index = 0
            while index < count:
                urgent = False
                with self.lock:
                    now = trio.current_time()
                    while index < count:
                        effects = receive(batch[index], now)
                        index += 1
                        if effects and self.dispatch(effects):
                            urgent = True
                            break
                self.changed()
                if urgent and count > 1:
                    await self.drained.park()

    async def command_receiver(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """First-request notices and resizes, in order."""
        task_status.started()
        async for command in self._command_queue:
            with self.lock:
                self.dispatch(self.core.receive_command(command, trio.current_time()))
            self.changed()

    async def wake_watchdog(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Tells the core when a wake-confirmation deadline passes. Deadlines arrive in
        order (one timeout for all), so one sleep at a time serves."""
        task_status.started()
        async for deadline in self._deadline_queue:
            await trio.sleep_until(deadline.deadline)
            with self.lock:
                self.dispatch(self.core.wake_deadline_passed(deadline.wave, trio.current_time()))
            self.changed()

    async def peer_watcher(
        self, peers: PeerMonitor, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Peers connecting to and lost by one bound socket (the monitor logs each loss)."""
        task_status.started()
        async for opened in peers.changes():
            with self.lock:
                now = trio.current_time()
                if opened:
                    self.dispatch(self.core.connection_opened(peers.key, now))
                else:
                    self.dispatch(self.core.connection_lost(peers.key, now))
            self.changed()

    async def front_receiver(
        self, front: AsyncSocket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Front-end subscriptions and messages (§5.3, §5.8, §4.9)."""
        task_status.started()
        while True:
            frames = await front.recv_batch()
            with self.lock:
                now = trio.current_time()
                for frame in frames:
                    self.dispatch(self.core.receive_front_frame(frame, now))
            self.changed()

    def close(self) -> None:
        # The channels stay open: a task that already holds received frames when the
        # nursery is cancelled still enqueues what they cause (the cancel stops it at its
        # next checkpoint); a closed channel would fail it with ClosedResourceError.
        with self.lock:
            self.closed = True


@final
class Coordinator:
    """The handle :func:`open_coordinator` yields: what an embedding front-end uses.

    Built complete by :func:`open_coordinator` once every socket is bound. Every method is
    synchronous and cheap, safe from any trio task; :meth:`snapshot`,
    :meth:`engine_loads`, :meth:`subscriptions` and :attr:`counters` may also be called
    from other threads.
    """

    def __init__(
        self,
        pumps: _Pumps,
        *,
        engine_input_address: str,
        engine_output_address: str,
        front_address: str | None,
        curve_public_key: bytes | None,
        ready_timeout: float | None,
    ) -> None:
        self._pumps = pumps
        self._core = pumps.core
        self._lock = pumps.lock
        self._engine_input_address = engine_input_address
        self._engine_output_address = engine_output_address
        self._front_address = front_address
        self._curve_public_key = curve_public_key
        self._ready_timeout = ready_timeout
        self._ready_deadline = (
            math.inf if ready_timeout is None else trio.current_time() + ready_timeout
        )

    @property
    def engine_input_address(self) -> str:
        """Where engines connect their XSUB (vLLM's back-pub; READY and START_DP_WAVE)."""
        return self._engine_input_address

    @property
    def engine_output_address(self) -> str:
        """Where engines connect their PUSH (vLLM's back-out; stats and wave reports)."""
        return self._engine_output_address

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
        """How many engines the load table holds (changes with SCALE_ELASTIC_EP)."""
        with self._lock:
            return self._core.engine_count

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
        broadcaster's channel: one scheduler pass less than through the command receiver,
        which still takes the front-ends' FIRST_REQ and SCALE. If the engines already run
        (or a wake-up is already claimed) nothing happens, so concurrent callers coalesce
        behind one broadcast. ``TypeError`` for a non-int, ``ValueError`` for an index
        outside the table, :class:`CoordinatorClosedError` once stopped.
        """
        if type(engine_index) is not int:
            raise TypeError(f"engine_index must be an int, got {type(engine_index).__name__}")
        with self._lock:
            if self._pumps.closed:
                raise CoordinatorClosedError("the coordinator has stopped")
            claim = self._core.claim_first_request(engine_index)
            if claim is not None:
                self._pumps.dispatch(self._core.receive_command(claim, trio.current_time()))
        if claim is not None:
            self._pumps.changed()

    def subscriptions(self) -> SubscriptionView:
        """The engines' subscriptions as seen on the broadcast socket."""
        with self._lock:
            return self._core.subscriptions()

    def silent_engines(self) -> list[int]:
        """Ranks that never sent anything on the engine output socket (subscriptions carry
        no identity, so this is how a stuck start-up gate names who is missing)."""
        with self._lock:
            return self._core.silent_engines()

    @property
    def counters(self) -> CoordinatorCounters:
        """A copy of the counters of received, decided, sent and rejected messages."""
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
            f"{self._engine_input_address} ({expected - view.current} missing); "
            f"ranks never heard from on {self._engine_output_address}: {self.silent_engines()}"
        )

    async def wait_for(self, predicate: Callable[[Coordinator], bool]) -> None:
        """Wait until ``predicate(self)`` holds; re-checked after every observable change
        (wave transitions, subscriptions, applied stats, rejected inputs, sends). Combine
        with ``trio.fail_after`` to bound the wait."""
        while not predicate(self):
            await self._pumps.observers.park()


def _bind(socket: AsyncSocket, address: str, *, allow_remote: bool, what: str) -> str:
    check_bind_address(address, allow_remote=allow_remote)
    try:
        if address.startswith("tcp://["):
            socket.setsockopt(zmq.IPV6, 1)  # an IPv6 host, as vLLM's make_zmq_socket does
        return socket.bind(address)
    except zmq.ZMQError as exc:
        raise CoordinatorError(f"cannot bind the {what} socket to {address!r}: {exc}") from exc


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


@asynccontextmanager
async def open_coordinator(
    engine_count: int,
    *,
    engine_input_address: str | None = None,
    engine_output_address: str | None = None,
    front_address: str | None = None,
    ready_timeout: float | None = 60.0,
    wave_coordination: bool = True,
    stats_interval: float = 0.1,
    allow_remote: bool = False,
    wake_confirm_timeout: float = 30.0,
    curve_secret_key: bytes | None = None,
    liveness: Liveness = DEFAULT_LIVENESS,
) -> AsyncIterator[Coordinator]:
    """Run a DP wave coordinator for ``engine_count`` engines for the duration of the block.

    Binds the engine broadcast socket (XPUB, vLLM's "back-pub", what engines connect
    their XSUB to: ``engine_input_address``) and the engine output socket (PULL,
    "back-out", ``engine_output_address``). Both default to ``ipc://`` paths in a
    private directory removed on exit; ``tcp://127.0.0.1:0`` is resolved to its port.
    With ``front_address`` it also binds vLLM's front-end publish socket (XPUB), as the
    standalone process does (``""`` means a private ``ipc://`` path, like the others).
    Yields the :class:`Coordinator` handle once every socket is bound and every task
    runs; the engines get READY when ``engine_count`` of them have subscribed.

    Leaving the block, normally, by an error or by cancellation, stops every task and
    closes every socket. A failure inside the service raises :class:`CoordinatorError`
    (with the original exceptions as its cause); an exception from the block itself
    propagates unchanged.

    ``wake_confirm_timeout``: a wave started by a first-request notice that no engine
    confirms within this many seconds (rank 0 reports every start it joins) is taken as
    dropped by paused engines, and ``engines_running`` goes back to False rather than
    staying latched (vLLM issues #51476/#51481). Real engines confirm within one step.

    ``curve_secret_key`` (Z85, e.g. from ``zmq.curve_keypair()``; off by default, since
    vLLM's engines cannot use it): every socket becomes a CURVE server, so only peers
    that know :attr:`Coordinator.curve_public_key` can connect, and the traffic is
    encrypted. For our own simulated engines and front-ends.

    ``liveness``: ZMTP heartbeats and TCP keepalive on every socket, so that a peer that
    goes silent without closing its connection (a partition, a node that lost power) is
    dropped within about ``liveness.notice_within`` seconds (4 s by default) instead of
    staying subscribed for good; vLLM's engines answer heartbeats without any setting of
    their own. A dropped peer shows in :meth:`Coordinator.subscriptions` (an
    unsubscription, a lost connection) and ``counters.connections_lost``, and is logged
    with its socket and address; when it comes back it subscribes again and gets READY.
    """
    if stats_interval <= 0:
        raise ValueError(f"stats_interval must be positive, got {stats_interval!r}")
    core = CoordinatorCore(
        engine_count,
        wave_coordination=wave_coordination,
        stats_interval=stats_interval,
        wake_confirm_timeout=wake_confirm_timeout,
        publish_to_front_ends=front_address is not None,
    )
    curve_public_key, curve_options = _curve_server(curve_secret_key)
    private_dir = PrivateIpcDirectory()
    pumps = _Pumps(core)
    try:
        async with AsyncExitStack() as sockets:
            context = await sockets.enter_async_context(open_context())
            monitors: list[PeerMonitor] = []

            async def bound_socket(
                socket_type: int,
                options: dict[int, int | bytes],
                address: str,
                key: str,
                exclusive: bool = False,
            ) -> tuple[AsyncSocket, str]:
                # heartbeats where they help (Liveness.for_address); the monitor is entered
                # before the bind, so that no connection goes unseen
                socket_liveness = liveness.for_address(address)
                options = {**options, **curve_options, **socket_liveness.socket_options()}
                socket = await sockets.enter_async_context(
                    open_socket(context, socket_type, options=options, exclusive=exclusive)
                )
                monitor = await sockets.enter_async_context(
                    open_peer_monitor(context, socket, key, socket_liveness)
                )
                monitors.append(monitor)
                what = key.replace("_", " ")
                monitor.address = _bind(socket, address, allow_remote=allow_remote, what=what)
                return socket, monitor.address

            back_pub, bound_input = await bound_socket(
                zmq.XPUB,
                dict(_XPUB_OPTIONS),
                engine_input_address or private_dir.address("engine-input"),
                "engine_broadcast",
            )
            back_out, bound_output = await bound_socket(
                zmq.PULL,
                {zmq.RCVHWM: 0, zmq.LINGER: 0},
                engine_output_address or private_dir.address("engine-output"),
                "engine_output",
                exclusive=True,  # the listener alone receives on it
            )
            front: AsyncSocket | None = None
            bound_front: str | None = None
            if front_address is not None:
                front, bound_front = await bound_socket(
                    zmq.XPUB,
                    dict(_XPUB_OPTIONS),
                    front_address or private_dir.address("front"),
                    "front",
                )
            handle = Coordinator(
                pumps,
                engine_input_address=bound_input,
                engine_output_address=bound_output,
                front_address=bound_front,
                curve_public_key=curve_public_key,
                ready_timeout=ready_timeout,
            )
            async with open_task_nursery(
                on_exit=pumps.close,
                failure=lambda group: CoordinatorError(f"coordinator task failed: {group!r}"),
            ) as nursery:
                await nursery.start(pumps.broadcaster, back_pub, front)
                await nursery.start(pumps.subscription_watcher, back_pub)
                await nursery.start(pumps.command_receiver)
                await nursery.start(pumps.wake_watchdog)
                await nursery.start(pumps.engine_output_listener, back_out)
                for monitor in monitors:
                    await nursery.start(pumps.peer_watcher, monitor)
                if front is not None:
                    await nursery.start(pumps.front_receiver, front)
                logger.info(
                    "coordinator for %d engines: broadcast %s, outputs %s, front %s",
                    engine_count,
                    bound_input,
                    bound_output,
                    bound_front,
                )
                yield handle
    finally:
        pumps.close()
        private_dir.cleanup()
