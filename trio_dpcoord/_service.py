"""The coordinator service: the sans-IO core wired to ZeroMQ by a handful of trio tasks.

One nursery runs, per the design card::

    handle.notify_first_request ─┐
    front XPUB (FIRST_REQ, SCALE)─┴─► [command channel] ─► command receiver ─┐
    engine PUSH ─► PULL ─► engine-output listener (batch decode) ─────────────┤ lock: transition
                                                                              │ + enqueue, one step
                                           [broadcast channel] ◄──────────────┘
                                                  └─► broadcaster ─► back XPUB ─► engines
    back XPUB subscriptions ─► subscription watcher (start-up gate, READY via the broadcaster)
    first-request starts ─► wake watchdog (no engine confirmed in time: paused again)
    wave changes, load changes ─► [publish channel] ─► front publisher ─► front XPUB ─► front-ends

Data flows one way. Every socket has exactly one task that sends on it. Transitions run
under a plain :class:`threading.Lock`, never across an ``await``, and enqueue what they
produce in the same critical section, so broadcasts and publishes leave in transition
order.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Final

import trio
import zmq

from . import protocol
from ._endpoints import PrivateIpcDirectory, check_bind_address
from ._errors import CoordinatorClosedError, CoordinatorError, ReadyTimeoutError
from ._state import (
    EngineLoad,
    FirstRequest,
    LoadTable,
    PublishSchedule,
    StatsOutcome,
    WaveSnapshot,
    WaveStart,
    WaveState,
)
from ._tasks import RejectLog, open_task_nursery
from .trio_zmq import AsyncSocket, open_context, open_socket

__all__ = [
    "Coordinator",
    "CoordinatorCounters",
    "ScaleRequest",
    "SubscriptionView",
    "open_coordinator",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScaleRequest:
    """Elastic EP: resize the load table to ``engine_count`` engines (§5.8)."""

    engine_count: int


Command = FirstRequest | ScaleRequest


@dataclass(frozen=True, slots=True)
class CoordinatorCounters:
    """What the coordinator received, sent and rejected, since it started."""

    engine_messages: int
    """Frames received on the engine-output socket (accepted or not)."""
    stats_applied: int
    wave_starts: int
    """START_DP_WAVE broadcasts sent."""
    ready_broadcasts: int
    front_publishes: int
    commands: int
    rejected: dict[str, int]
    """Rejected inputs by reason, e.g. ``{"undecodable_engine_output": 2}``."""

    @property
    def errors(self) -> int:
        """Total rejected inputs."""
        return sum(self.rejected.values())


@dataclass(frozen=True, slots=True)
class SubscriptionView:
    """The engines' subscriptions to the broadcast socket, as the XPUB reported them.

    Subscription frames carry no engine identity, so this counts them: ``current`` is
    how many engines are subscribed now; an engine that dies or restarts shows as an
    unsubscription (the socket is verbose about both) and, when it is back, a late
    subscription answered with READY.
    """

    current: int
    subscribed: int
    unsubscribed: int
    late_subscriptions: int
    gate_open: bool
    front_ends: int = 0
    """Front-ends subscribed to the front socket (standalone mode)."""


_STATS: Final = protocol.OutputKind.STATS
_WAVE_COMPLETE: Final = protocol.OutputKind.WAVE_COMPLETE
_CONTROL: Final = frozenset(
    {protocol.OutputKind.STATS, protocol.OutputKind.WAVE_COMPLETE, protocol.OutputKind.START_WAVE}
)
_MAX_WAVE: Final = (1 << 64) - 1
"""Waves travel as msgpack uint64: a wave_complete for this one has no next wave to send."""
_MAX_ENGINES: Final = 1 << 16
"""Engine ranks are 2-byte identities (§6.1): a larger SCALE_ELASTIC_EP cannot be real."""

_PUBLISH_NOW: Final = "publish-now"
"""Publish channel item: a front-end just subscribed, send it the current counts."""
_RESCHEDULE: Final = "reschedule"
"""Publish channel item: the load table has news, the next timed publish is sooner."""
PublishItem = bytes | str


class Coordinator:
    """The handle ``open_coordinator`` yields: what an embedding front-end uses.

    Every method is synchronous and cheap, safe from any trio task; :meth:`snapshot`
    and :meth:`engine_loads` may also be called from other threads.
    """

    def __init__(
        self,
        *,
        engine_count: int,
        ready_timeout: float | None,
        wave_coordination: bool,
        stats_interval: float,
        front_enabled: bool,
        wake_confirm_timeout: float = 30.0,
    ) -> None:
        self.engine_input_address = ""
        self.wake_confirm_timeout = wake_confirm_timeout
        self._expected_engines = engine_count
        """The start-up gate's count; the load table's size may change later (elastic EP)."""
        self._ready_deadline = math.inf
        self.engine_output_address = ""
        self.front_address: str | None = None
        self.curve_public_key: bytes | None = None
        """The CURVE server key peers need, when ``curve_secret_key`` was given."""
        self.ready_timeout = ready_timeout
        self.wave_coordination = wave_coordination
        self._lock = threading.Lock()
        self._wave = WaveState()
        self._loads = LoadTable(engine_count, lockstep=wave_coordination)
        self._schedule = PublishSchedule(interval=stats_interval)
        self._front_enabled = front_enabled
        self._publisher_idle = False
        self._closed = False
        self._ready = trio.Event()
        self._observers = trio.lowlevel.ParkingLot()
        self._gate_open = trio.Event()
        self._reject = RejectLog(logger)
        self._subscribed = 0
        self._unsubscribed = 0
        self._late_subscriptions = 0
        self._front_ends = 0
        self._heard_from: set[int] = set()
        self._engine_messages = 0
        self._stats_applied = 0
        self._wave_starts = 0
        self._ready_broadcasts = 0
        self._front_publishes = 0
        self._commands = 0
        self._broadcast_send, self._broadcast_receive = trio.open_memory_channel[list[bytes]](
            math.inf
        )
        self._command_send, self._command_receive = trio.open_memory_channel[Command](math.inf)
        self._publish_send, self._publish_receive = trio.open_memory_channel[PublishItem](math.inf)
        self._unconfirmed_send, self._unconfirmed_receive = trio.open_memory_channel[
            tuple[int, float]
        ](math.inf)

    # --- the public contract ------------------------------------------------------------

    @property
    def engine_count(self) -> int:
        """How many engines the load table holds (changes with SCALE_ELASTIC_EP)."""
        return self._loads.engine_count

    async def wait_ready(self) -> None:
        """Return once READY has been broadcast (every expected engine subscribed).

        Raises :class:`ReadyTimeoutError` if that did not happen within
        ``ready_timeout`` seconds of the coordinator's start.
        """
        if self._ready_deadline == math.inf:
            await self._ready.wait()
            return
        with trio.move_on_at(self._ready_deadline):
            await self._ready.wait()
            return
        view = self.subscriptions()
        silent = self.silent_engines()
        raise ReadyTimeoutError(
            f"start-up gate still closed after {self.ready_timeout} s: "
            f"{view.current} of {self._expected_engines} engines subscribed to "
            f"{self.engine_input_address} ({self._expected_engines - view.current} missing); "
            f"ranks never heard from on {self.engine_output_address}: {silent}"
        )

    def silent_engines(self) -> list[int]:
        """Ranks that never sent anything on the engine output socket.

        Subscription frames carry no identity, so this is how a stuck start-up gate can
        name the engines that never showed up, when engines report before READY (the
        simulated engines announce themselves; vLLM's engines first report after it).
        """
        return [i for i in range(self._loads.engine_count) if i not in self._heard_from]

    async def wait_for(self, predicate: Callable[[Coordinator], bool]) -> None:
        """Wait until ``predicate(self)`` holds; re-checked after every observable change.

        Observable changes are wave transitions, subscriptions, applied stats and
        rejected inputs. Combine with ``trio.fail_after`` to bound the wait.
        """
        while not predicate(self):
            await self._observers.park()

    def _changed(self) -> None:
        if self._observers:
            self._observers.unpark_all()

    def snapshot(self) -> WaveSnapshot:
        """The wave to stamp on a new request, and whether the engines run."""
        with self._lock:
            return self._wave.snapshot

    def notify_first_request(self, engine_index: int) -> None:
        """A request is being routed to ``engine_index``: wake the engines if they sleep.

        Synchronous and non-blocking. If the snapshot says paused, it flips to running
        at once and a first-request notice is queued for the command receiver, which
        broadcasts START_DP_WAVE with vLLM PR #46833's rule; if the engines already run
        (or a wake-up is already queued) nothing happens, so concurrent callers
        coalesce behind one broadcast.
        """
        if type(engine_index) is not int:
            raise TypeError(f"engine_index must be an int, got {type(engine_index).__name__}")
        with self._lock:
            if self._closed:
                raise CoordinatorClosedError("the coordinator has stopped")
            count = self._loads.engine_count
            if not 0 <= engine_index < count:
                raise ValueError(f"engine_index {engine_index} out of range for {count} engines")
            if not self.wave_coordination:
                return
            claim = self._wave.claim_first_request(engine_index)
            if claim is not None:
                self._command_send.send_nowait(claim)
        if claim is not None:
            self._changed()

    def engine_loads(self) -> tuple[EngineLoad, ...]:
        """Per engine ``(waiting, running, kv_cache_usage)`` from the latest reports."""
        with self._lock:
            return self._loads.loads()

    def subscriptions(self) -> SubscriptionView:
        """The engines' subscriptions as seen on the broadcast socket."""
        return SubscriptionView(
            current=self._subscribed - self._unsubscribed,
            subscribed=self._subscribed,
            unsubscribed=self._unsubscribed,
            late_subscriptions=self._late_subscriptions,
            gate_open=self._gate_open.is_set(),
            front_ends=self._front_ends,
        )

    @property
    def counters(self) -> CoordinatorCounters:
        """A copy of the counters of received, sent and rejected messages."""
        return CoordinatorCounters(
            engine_messages=self._engine_messages,
            stats_applied=self._stats_applied,
            wave_starts=self._wave_starts,
            ready_broadcasts=self._ready_broadcasts,
            front_publishes=self._front_publishes,
            commands=self._commands,
            rejected=dict(self._reject.counts),
        )

    # --- transitions: under the lock, enqueue in the same step -------------------------

    def _enqueue_wave_start(self, start: WaveStart) -> None:
        self._broadcast_send.send_nowait(protocol.encode_start_dp_wave(start.wave, start.exclude))
        self._enqueue_wave_publish()

    def _enqueue_wave_publish(self) -> None:
        if self._front_enabled:
            snap = self._wave.snapshot
            self._publish_send.send_nowait(
                protocol.encode_front_publish(
                    protocol.FrontPublish(None, snap.current_wave, snap.engines_running)
                )
            )

    def _apply_command(self, command: Command) -> None:
        with self._lock:
            if isinstance(command, ScaleRequest):
                old = self._loads.engine_count
                self._loads.resize(command.engine_count)
                logger.info("elastic EP: load table %d -> %d engines", old, command.engine_count)
                self._nudge_publisher()
                return
            if not self.wave_coordination:
                return
            # _state logs every transition (old and new wave) at DEBUG
            start = self._wave.start_wave_for_first_request(command.wave, command.engine)
            if start is not None:
                self._enqueue_wave_start(start)
                deadline = trio.current_time() + self.wake_confirm_timeout
                self._unconfirmed_send.send_nowait((start.wave, deadline))

    def _apply_engine_output(
        self, kind: protocol.OutputKind, engine_index: int, value: protocol.StatsFields | int
    ) -> None:
        """Apply one control report (§5.4, §5.5); ``value`` as decode_coordinator_output."""
        with self._lock:
            if kind is _STATS:
                assert isinstance(value, tuple)
                running, waiting, step, wave, usage = value
                outcome = self._loads.apply_stats(engine_index, waiting, running, usage, wave, step)
                if outcome is StatsOutcome.APPLIED:
                    self._stats_applied += 1
                    self._nudge_publisher()
                elif outcome is StatsOutcome.UNKNOWN_ENGINE:
                    self._reject(
                        "unknown_engine_index",
                        f"stats from engine {engine_index}, table has "
                        f"{self._loads.engine_count} engines",
                    )
                else:
                    logger.debug(
                        "out-of-order stats from engine %d: wave %d step %d",
                        engine_index,
                        wave,
                        step,
                    )
                    self._stats_applied += 1
                    self._nudge_publisher()
                return
            if not self.wave_coordination:
                return  # §5.7: wave fields are ignored without wave coordination
            assert isinstance(value, int)
            if engine_index >= self._loads.engine_count:
                self._reject(
                    "unknown_engine_index",
                    f"wave report from engine {engine_index}, table has "
                    f"{self._loads.engine_count} engines",
                )
            elif kind is _WAVE_COMPLETE:
                if value >= _MAX_WAVE:
                    self._reject(
                        "wave_out_of_range",
                        f"wave_complete({value}) from engine {engine_index}: "
                        "the next wave does not fit in uint64",
                    )
                elif self._wave.wave_complete(value):
                    self._enqueue_wave_publish()
            else:
                start = self._wave.engine_start_wave(value, engine_index)
                if start is not None:
                    self._enqueue_wave_start(start)

    def _nudge_publisher(self) -> None:
        if self._publisher_idle:
            self._publisher_idle = False
            self._publish_send.send_nowait(_RESCHEDULE)

    # --- the tasks ----------------------------------------------------------------------

    async def _subscription_watcher(
        self,
        xpub: AsyncSocket,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The start-up gate, then READY for every late subscription (§5.2)."""
        task_status.started()
        while True:
            frames = await xpub.recv_batch()
            for frame in frames:
                sub = protocol.decode_subscription(frame)
                if sub is None:
                    self._reject(
                        "unexpected_broadcast_socket_frame",
                        f"{len(frame)}-byte upstream payload on the engine broadcast socket",
                    )
                elif not sub.subscribe:
                    self._unsubscribed += 1
                    logger.warning(
                        "an engine unsubscribed from %s (%d still subscribed); "
                        "it will get READY again when it comes back",
                        self.engine_input_address,
                        self._subscribed - self._unsubscribed,
                    )
                else:
                    self._subscribed += 1
                    current = self._subscribed - self._unsubscribed
                    if self._gate_open.is_set():
                        self._late_subscriptions += 1
                        logger.info(
                            "late engine subscription (%d subscribed): READY again", current
                        )
                        self._broadcast_send.send_nowait([protocol.READY])
                    elif current >= self._expected_engines:
                        logger.info("all %d engines subscribed: opening the gate", current)
                        self._gate_open.set()
                    else:
                        logger.debug(
                            "engine subscribed (%d of %d)", current, self._expected_engines
                        )
            self._changed()

    async def _broadcaster(
        self,
        xpub: AsyncSocket,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The only code that sends on the engine broadcast socket.

        READY goes first, once the gate opens; wave starts decided before that (an
        engine's report may arrive while others are still subscribing) wait behind it.
        """
        task_status.started()
        await self._gate_open.wait()
        await xpub.send(protocol.READY)
        self._ready_broadcasts += 1
        self._ready.set()
        self._changed()
        logger.info("READY sent to %d engines", self.subscriptions().current)
        async for frames in self._broadcast_receive:
            await xpub.send_multipart(frames)
            if frames[0] == protocol.READY:
                self._ready_broadcasts += 1
                self._ready.set()
            else:
                self._wave_starts += 1
            self._changed()

    async def _command_receiver(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Applies front-end commands, in order, once the gate is open."""
        task_status.started()
        await self._gate_open.wait()
        async for command in self._command_receive:
            self._commands += 1
            self._apply_command(command)
            self._changed()

    async def _wake_watchdog(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Un-latches ``engines_running`` when no engine confirms a first-request start.

        Paused engines drop START_DP_WAVE (§6.8); see WaveState.expire_unconfirmed_start.
        Deadlines arrive in order (one timeout for all), so one sleep at a time serves.
        """
        task_status.started()
        async for wave, deadline in self._unconfirmed_receive:
            await trio.sleep_until(deadline)
            with self._lock:
                expired = self._wave.expire_unconfirmed_start(wave)
                if expired:
                    self._enqueue_wave_publish()
            if expired:
                logger.warning(
                    "no engine confirmed wave %d within %.1f s of its START_DP_WAVE (paused "
                    "engines drop it): wave %d is paused again",
                    wave,
                    self.wake_confirm_timeout,
                    wave,
                )
                self._changed()

    async def _engine_output_listener(
        self,
        pull: AsyncSocket,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Decodes engine outputs in batches and applies them (§5.4, §5.5).

        Unlike vLLM it does not wait for the start-up gate: stats and wave reports are
        state, and any broadcast they cause waits behind READY in the broadcaster.
        """
        task_status.started()
        decode = protocol.decode_coordinator_output
        apply = self._apply_engine_output
        heard_from = self._heard_from
        while True:
            batch = await pull.recv_multipart_batch()
            self._engine_messages += len(batch)
            for frames in batch:
                if len(frames) != 1:
                    self._reject(
                        "multipart_engine_output",
                        f"{len(frames)}-frame message on the engine output socket",
                    )
                    continue
                try:
                    kind, engine_index, value = decode(frames[0])
                except protocol.ProtocolError as exc:
                    self._reject("undecodable_engine_output", str(exc))
                    continue
                heard_from.add(engine_index)
                if kind in _CONTROL:
                    assert value is not None
                    apply(kind, engine_index, value)
                else:
                    self._reject(
                        f"non_control_output_{kind.name.lower()}",
                        f"{kind.name} from engine {engine_index} is not for the coordinator",
                    )
            self._changed()

    async def _front_receiver(
        self,
        front: AsyncSocket,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Front-end subscriptions, SCALE_ELASTIC_EP and legacy FIRST_REQ (§5.3, §5.8, §4.9)."""
        task_status.started()
        while True:
            for frame in await front.recv_batch():
                sub = protocol.decode_subscription(frame)
                if sub is not None:
                    self._front_ends += 1 if sub.subscribe else -1
                    logger.info(
                        "front-end %s (%d subscribed)",
                        "subscribed" if sub.subscribe else "unsubscribed",
                        self._front_ends,
                    )
                    if sub.subscribe:
                        # a newcomer gets the current counts now, not at the next heartbeat
                        self._publish_send.send_nowait(_PUBLISH_NOW)
                    continue
                try:
                    message = protocol.decode_front_message(frame)
                except protocol.ProtocolError as exc:
                    self._reject("undecodable_front_message", str(exc))
                    continue
                if isinstance(message, protocol.ScaleElasticEP):
                    if not 1 <= message.new_engine_count <= _MAX_ENGINES:
                        self._reject(
                            "bad_scale_request", f"SCALE_ELASTIC_EP to {message.new_engine_count}"
                        )
                        continue
                    self._command_send.send_nowait(ScaleRequest(message.new_engine_count))
                else:
                    self._command_send.send_nowait(FirstRequest(message.engine, message.wave))
            self._changed()

    async def _front_publisher(
        self,
        front: AsyncSocket,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The only code that sends on the front socket: wave changes at once, loads timed."""
        task_status.started()
        await self._gate_open.wait()
        while True:
            with self._lock:
                due = self._schedule.next_due(self._loads)
                self._publisher_idle = not (
                    self._loads.stats_changed or self._loads.pending_snapshot is not None
                )
            item: PublishItem | None = None
            with trio.move_on_at(due):
                item = await self._publish_receive.receive()
            if isinstance(item, bytes):
                await front.send(item)
                self._front_publishes += 1
            elif item is None or item == _PUBLISH_NOW:
                await front.send(self._take_timed_publish())
                self._front_publishes += 1

    def _take_timed_publish(self) -> bytes:
        with self._lock:
            counts = self._loads.take_publish_counts()
            snap = self._wave.snapshot
            self._schedule.published(trio.current_time())
        if not self.wave_coordination:
            snap = WaveSnapshot()
        return protocol.encode_front_publish(
            protocol.FrontPublish(counts, snap.current_wave, snap.engines_running)
        )

    def _close(self) -> None:
        # The channels stay open: a task that already holds received frames when the
        # nursery is cancelled still enqueues what they cause (the cancel stops it at its
        # next checkpoint); a closed channel would fail it with ClosedResourceError.
        with self._lock:
            self._closed = True


def _bind(socket: AsyncSocket, address: str, *, allow_remote: bool, what: str) -> str:
    check_bind_address(address, allow_remote=allow_remote)
    try:
        return socket.bind(address)
    except zmq.ZMQError as exc:
        raise CoordinatorError(f"cannot bind the {what} socket to {address!r}: {exc}") from exc


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
    """
    if type(engine_count) is not int or engine_count < 1:
        raise ValueError(f"engine_count must be a positive int, got {engine_count!r}")
    if stats_interval <= 0:
        raise ValueError(f"stats_interval must be positive, got {stats_interval!r}")
    if wake_confirm_timeout <= 0:
        raise ValueError(f"wake_confirm_timeout must be positive, got {wake_confirm_timeout!r}")
    handle = Coordinator(
        engine_count=engine_count,
        ready_timeout=ready_timeout,
        wave_coordination=wave_coordination,
        stats_interval=stats_interval,
        front_enabled=front_address is not None,
        wake_confirm_timeout=wake_confirm_timeout,
    )
    security: dict[int, int | bytes] = {}
    if curve_secret_key is not None:
        if not zmq.has("curve"):
            raise CoordinatorError("this libzmq was built without CURVE support")
        try:
            handle.curve_public_key = zmq.curve_public(curve_secret_key)
        except (zmq.ZMQError, ValueError, TypeError) as exc:
            raise CoordinatorError(f"bad CURVE secret key: {exc}") from exc
        security = {zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: curve_secret_key}
    # Verbose: every engine's subscription reaches the gate (vLLM's setting); verboser:
    # every unsubscription too, so a vanished peer shows.
    xpub_options = {zmq.XPUB_VERBOSE: 1, zmq.XPUB_VERBOSER: 1, zmq.LINGER: 0, **security}
    private_dir = PrivateIpcDirectory()
    try:
        async with AsyncExitStack() as sockets:
            context = await sockets.enter_async_context(open_context())
            back_pub = await sockets.enter_async_context(
                open_socket(
                    context,
                    zmq.XPUB,
                    options=xpub_options,
                )
            )
            back_out = await sockets.enter_async_context(
                open_socket(context, zmq.PULL, options={zmq.RCVHWM: 0, zmq.LINGER: 0, **security})
            )
            handle.engine_input_address = _bind(
                back_pub,
                engine_input_address or private_dir.address("engine-input"),
                allow_remote=allow_remote,
                what="engine broadcast",
            )
            handle.engine_output_address = _bind(
                back_out,
                engine_output_address or private_dir.address("engine-output"),
                allow_remote=allow_remote,
                what="engine output",
            )
            front: AsyncSocket | None = None
            if front_address is not None:
                front = await sockets.enter_async_context(
                    open_socket(
                        context,
                        zmq.XPUB,
                        options=xpub_options,
                    )
                )
                handle.front_address = _bind(
                    front,
                    front_address or private_dir.address("front"),
                    allow_remote=allow_remote,
                    what="front",
                )
            if ready_timeout is not None:
                handle._ready_deadline = trio.current_time() + ready_timeout
            async with open_task_nursery(
                on_exit=handle._close,
                failure=lambda group: CoordinatorError(f"coordinator task failed: {group!r}"),
            ) as nursery:
                await nursery.start(handle._broadcaster, back_pub)
                await nursery.start(handle._subscription_watcher, back_pub)
                await nursery.start(handle._command_receiver)
                await nursery.start(handle._wake_watchdog)
                await nursery.start(handle._engine_output_listener, back_out)
                if front is not None:
                    await nursery.start(handle._front_publisher, front)
                    await nursery.start(handle._front_receiver, front)
                logger.info(
                    "coordinator for %d engines: broadcast %s, outputs %s, front %s",
                    engine_count,
                    handle.engine_input_address,
                    handle.engine_output_address,
                    handle.front_address,
                )
                yield handle
    finally:
        handle._close()
        private_dir.cleanup()
