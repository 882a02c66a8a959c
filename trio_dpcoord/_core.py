"""The coordinator's sans-IO core: every rule in one object, no I/O, no clock of its own.

:class:`CoordinatorCore` is to the coordinator what h11's ``Connection`` is to HTTP: it
takes what arrived (raw frames from a socket, a command, a clock reading) and returns
the *effects* that must follow, in order; it never awaits, never touches a socket and
never reads a clock. The trio service (``_service.py``) only moves bytes: each pump
reads one socket or channel, calls the core under the coordinator's lock and hands each
effect to the one task that owns where it goes:

===========================  =======================================================
effect                       owner
===========================  =======================================================
:class:`Broadcast`           the broadcaster, the only sender on the engine XPUB
:class:`Publish`             the broadcaster too, the only sender on the front XPUB
:class:`RescheduleTimedPublish`  the broadcaster (its next timed publish moved earlier)
:class:`ArmWakeDeadline`     the wake watchdog (call :meth:`CoordinatorCore.wake_deadline_passed`)
:class:`Reject`              the log (the core has already counted it)
:class:`FirstRequest`, :class:`ScaleRequest`  the command receiver (call
                             :meth:`CoordinatorCore.receive_command`)
===========================  =======================================================

The rules it owns (docs/protocol.md §5 and §13): the start-up gate and READY, late
subscriptions, the wave state machine with vLLM PR #46833's rule, the wave-coordination
mode, the load table and its lock-step snapshot, every bounds check on what peers send,
the wake-confirmation rule (a first-request start no engine confirms goes back to
paused), publish timing, and the counters. Everything the core returns before the gate
opens waits inside it and comes out behind READY, in the order it was decided.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, final

from . import protocol
from ._pacing import BurstSummary
from ._state import (
    HEARTBEAT_INTERVAL,
    FirstRequest,
    LoadTable,
    PublishSchedule,
    StatsOutcome,
    WaveSnapshot,
    WaveStart,
    WaveState,
)
from .protocol import EngineLoad

__all__ = [
    "HEARTBEAT_INTERVAL",
    "MAX_ENGINES",
    "ArmWakeDeadline",
    "Broadcast",
    "Command",
    "CoordinatorCore",
    "CoordinatorCounters",
    "Effect",
    "HistogramSnapshot",
    "Publish",
    "Reject",
    "RescheduleTimedPublish",
    "ScaleRequest",
    "SubscriptionView",
    "WaveStartCause",
]

logger = logging.getLogger(__name__)

MAX_WAVE: Final = (1 << 64) - 1
"""Waves travel as msgpack uint64: a wave_complete for this one has no next wave to send."""
MAX_ENGINES: Final = 1 << 16
"""Engine ranks are 2-byte identities (§6.1): a larger SCALE_ELASTIC_EP cannot be real."""
WAKE_LATENCY_BOUNDS: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
"""Upper bounds (seconds) of the wake decision-to-send latency histogram's buckets."""


class WaveStartCause:
    """Why a START_DP_WAVE went out: the keys of ``CoordinatorCounters.wave_starts_by_cause``."""

    ENGINE_START_WAVE: Final = "engine_start_wave"
    """An engine got a request while paused and reported ``start_wave`` (vLLM >= 0.33)."""
    FIRST_REQUEST: Final = "first_request"
    """The embedded handle's :meth:`~Coordinator.notify_first_request`."""
    LEGACY_FIRST_REQUEST: Final = "legacy_first_request"
    """A pre-0.33 front-end's FIRST_REQ on the front socket."""
    LATE_SUBSCRIPTION: Final = "late_subscription"
    """An engine (re)subscribed while a wave runs: it missed that wave's START_DP_WAVE."""


@dataclass(frozen=True, slots=True)
class ScaleRequest:
    """Elastic EP: resize the load table to ``engine_count`` engines (§5.8)."""

    engine_count: int


Command = FirstRequest | ScaleRequest
"""What the command receiver applies, in order, with :meth:`CoordinatorCore.receive_command`."""


# --- effects -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Broadcast:
    """Send ``frames`` on the engine broadcast socket, then call ``broadcast_sent``.

    ``wave_start`` is None for READY. ``decided_at`` is the clock reading of the decision,
    so the send's latency can be measured; ``cause`` is a :class:`WaveStartCause` value.
    """

    frames: list[bytes]
    wave_start: WaveStart | None
    decided_at: float
    cause: str | None = None


@dataclass(frozen=True, slots=True)
class Publish:
    """Send ``payload`` (an encoded front publish) on the front socket."""

    payload: bytes


@final
class RescheduleTimedPublish:
    """The next timed publish is due sooner than the publisher last asked: ask again."""

    __slots__ = ()


RESCHEDULE: Final = RescheduleTimedPublish()


@dataclass(frozen=True, slots=True)
class ArmWakeDeadline:
    """Call :meth:`CoordinatorCore.wake_deadline_passed` for ``wave`` at clock ``deadline``."""

    wave: int
    deadline: float


@dataclass(frozen=True, slots=True)
class Reject:
    """An input was rejected (already counted under ``reason``); log ``detail``."""

    reason: str
    detail: str


Effect = Broadcast | Publish | RescheduleTimedPublish | ArmWakeDeadline | Reject | Command

_NOTHING: Final[tuple[Effect, ...]] = ()


# --- what the core reports -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A latency histogram: ``counts[i]`` samples fell at or below ``bounds[i]`` seconds
    (and above the previous bound); the last count is above every bound (+Inf)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int


@dataclass(frozen=True, slots=True)
class CoordinatorCounters:
    """What the coordinator received, decided, sent and rejected, since it started."""

    engine_messages: int
    """Messages received on the engine-output socket (accepted or not)."""
    stats_applied: int
    waves_completed: int
    """Accepted ``wave_complete`` reports (each moved the wave on)."""
    wave_starts: int
    """START_DP_WAVE broadcasts sent."""
    wave_starts_by_cause: dict[str, int]
    """START_DP_WAVE broadcasts sent, by :class:`WaveStartCause`."""
    ready_broadcasts: int
    front_publishes: int
    commands: int
    """Commands applied: first-request notices and elastic-EP resizes."""
    unconfirmed_expiries: int
    """First-request starts no engine confirmed in time, so paused again."""
    rejected: dict[str, int]
    """Rejected inputs by reason, e.g. ``{"undecodable_engine_output": 2}``."""
    wake_latency: HistogramSnapshot
    """Seconds from a START_DP_WAVE decision until it was handed to ZeroMQ."""
    connections_lost: dict[str, int] = field(default_factory=dict)
    """Peer connections lost, by socket (``engine_broadcast``, ``engine_output``,
    ``front``): closed by the peer, or silent past the heartbeat timeout."""

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
    connections: int = 0
    """Peer connections open on the engine broadcast socket now."""
    connections_lost: int = 0
    """Connections the engine broadcast socket lost: a peer that dies or stays silent
    past the heartbeat timeout shows here, and as an unsubscription."""
    last_connection_lost_at: float | None = None
    """The clock reading (``now``) of the latest such loss."""


class _LatencyHistogram:
    __slots__ = ("_counts", "_sum")

    def __init__(self) -> None:
        self._counts = [0] * (len(WAKE_LATENCY_BOUNDS) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(WAKE_LATENCY_BOUNDS, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(
            WAKE_LATENCY_BOUNDS, tuple(self._counts), self._sum, sum(self._counts)
        )


_STATS: Final = protocol.OutputKind.STATS
_WAVE_COMPLETE: Final = protocol.OutputKind.WAVE_COMPLETE
_START_WAVE: Final = protocol.OutputKind.START_WAVE
_NOT_FOR_COORDINATOR: Final = {
    kind: f"non_control_output_{kind.name.lower()}"
    for kind in protocol.OutputKind
    if kind not in (_STATS, _WAVE_COMPLETE, _START_WAVE)
}
_READY_FRAMES: Final = [protocol.READY]
_BROADCAST_SOCKET: Final = "engine_broadcast"


@final
class CoordinatorCore:
    """Every rule of the DP wave coordinator, as a plain object (see the module docstring).

    Contract:

    * Inputs are method calls with a clock reading ``now`` (any monotonic clock, in
      seconds; the service passes ``trio.current_time()``). Each returns the effects
      that must follow, in the order they must happen; an empty result means nothing
      goes out. No input raises for bad peer input: it becomes a :class:`Reject` effect
      and a count. Only misuse by the caller raises (``ValueError``/``TypeError``).
    * Nothing leaves before the start-up gate opens (``expected_engines`` subscriptions):
      decisions made earlier wait and come out after READY, in order; commands wait too,
      and are applied after READY, as vLLM's coordinator reads nothing before its gate.
      Engine reports are applied at once: they are state.
    * The wave never decreases; an accepted start produces exactly one START_DP_WAVE;
      an ignored input changes nothing but counters.
    * In non-wave mode (``wave_coordination=False``, vLLM's dense models) wave reports
      and first requests are ignored and publishes carry wave 0, not running (§5.7).
    * Not thread-safe: the caller serialises calls (the service holds its lock).
    """

    __slots__ = (
        "_commands",
        "_connections",
        "_connections_lost",
        "_counters_rejected",
        "_deferred",
        "_deferred_commands",
        "_engine_messages",
        "_expected_engines",
        "_front_ends",
        "_front_publishes",
        "_gate_open",
        "_heard_from",
        "_last_connection_lost_at",
        "_late_subscriptions",
        "_loads",
        "_publish_to_front_ends",
        "_publisher_waiting_long",
        "_ready_broadcasts",
        "_schedule",
        "_stats_applied",
        "_subscribed",
        "_unconfirmed_expiries",
        "_unsubscribed",
        "_unsubscription_burst",
        "_wake_confirm_timeout",
        "_wake_latency",
        "_wave",
        "_wave_coordination",
        "_wave_starts",
        "_waves_completed",
    )

    def __init__(
        self,
        engine_count: int,
        *,
        wave_coordination: bool = True,
        stats_interval: float = 0.1,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        wake_confirm_timeout: float = 30.0,
        publish_to_front_ends: bool = False,
        wave_state: WaveState | None = None,
    ) -> None:
        """``wave_state`` starts the core from a known wave (a fresh one by default)."""
        if type(engine_count) is not int or not 1 <= engine_count <= MAX_ENGINES:
            raise ValueError(
                f"engine_count must be a positive int (at most {MAX_ENGINES}), "
                f"got {engine_count!r}"
            )
        if wake_confirm_timeout <= 0:
            raise ValueError(
                f"wake_confirm_timeout must be positive, got {wake_confirm_timeout!r}"
            )
        self._expected_engines = engine_count
        self._wave_coordination = wave_coordination
        self._wake_confirm_timeout = wake_confirm_timeout
        self._publish_to_front_ends = publish_to_front_ends
        self._wave = wave_state if wave_state is not None else WaveState()
        self._loads = LoadTable(engine_count, lockstep=wave_coordination)
        self._schedule = PublishSchedule(interval=stats_interval, heartbeat=heartbeat_interval)
        self._gate_open = False
        self._deferred: list[Effect] = []
        self._deferred_commands: list[Command] = []
        self._publisher_waiting_long = False
        self._heard_from: set[int] = set()
        self._subscribed = 0
        self._unsubscribed = 0
        self._unsubscription_burst = BurstSummary()
        self._late_subscriptions = 0
        self._front_ends = 0
        self._connections: Counter[str] = Counter()
        self._connections_lost: Counter[str] = Counter()
        self._last_connection_lost_at: dict[str, float] = {}
        self._engine_messages = 0
        self._stats_applied = 0
        self._waves_completed = 0
        self._wave_starts: Counter[str] = Counter()
        self._ready_broadcasts = 0
        self._front_publishes = 0
        self._commands = 0
        self._unconfirmed_expiries = 0
        self._counters_rejected: Counter[str] = Counter()
        self._wake_latency = _LatencyHistogram()

    # --- reading it ------------------------------------------------------------------------

    @property
    def wave_coordination(self) -> bool:
        """Whether waves are coordinated (MoE models) or ignored (dense models, §5.7)."""
        return self._wave_coordination

    @property
    def expected_engines(self) -> int:
        """How many subscriptions open the start-up gate (fixed at construction)."""
        return self._expected_engines

    @property
    def engine_count(self) -> int:
        """How many engines the load table holds (changes with SCALE_ELASTIC_EP)."""
        return self._loads.engine_count

    @property
    def gate_open(self) -> bool:
        return self._gate_open

    @property
    def wake_confirm_timeout(self) -> float:
        return self._wake_confirm_timeout

    @property
    def first_request_pending(self) -> bool:
        """A handle's claim is queued and not yet handled (the snapshot says running)."""
        return self._wave.first_request_pending

    @property
    def unconfirmed_wave(self) -> int | None:
        """The wave a first-request start began that no engine has reported on yet."""
        return self._wave.unconfirmed_wave

    def snapshot(self) -> WaveSnapshot:
        """The wave to stamp on a new request, and whether the engines run."""
        return self._wave.snapshot

    def engine_loads(self) -> tuple[EngineLoad, ...]:
        """The latest reported load of every engine, in rank order."""
        return self._loads.loads()

    def silent_engines(self) -> list[int]:
        """Ranks that never sent anything on the engine output socket."""
        return [i for i in range(self._loads.engine_count) if i not in self._heard_from]

    def subscriptions(self) -> SubscriptionView:
        return SubscriptionView(
            current=self._subscribed - self._unsubscribed,
            subscribed=self._subscribed,
            unsubscribed=self._unsubscribed,
            late_subscriptions=self._late_subscriptions,
            gate_open=self._gate_open,
            front_ends=self._front_ends,
            connections=self._connections[_BROADCAST_SOCKET],
            connections_lost=self._connections_lost[_BROADCAST_SOCKET],
            last_connection_lost_at=self._last_connection_lost_at.get(_BROADCAST_SOCKET),
        )

    def counters(self) -> CoordinatorCounters:
        return CoordinatorCounters(
            engine_messages=self._engine_messages,
            stats_applied=self._stats_applied,
            waves_completed=self._waves_completed,
            wave_starts=sum(self._wave_starts.values()),
            wave_starts_by_cause=dict(self._wave_starts),
            ready_broadcasts=self._ready_broadcasts,
            front_publishes=self._front_publishes,
            commands=self._commands,
            unconfirmed_expiries=self._unconfirmed_expiries,
            rejected=dict(self._counters_rejected),
            wake_latency=self._wake_latency.snapshot(),
            connections_lost=dict(self._connections_lost),
        )

    # --- inputs: the embedded handle --------------------------------------------------------

    def claim_first_request(self, engine_index: int) -> FirstRequest | None:
        """The handle routes a request to ``engine_index``: claim the wake-up, synchronously.

        Returns the :class:`FirstRequest` command to queue for the command receiver when
        the engines looked paused (the snapshot says running from now on, so concurrent
        callers coalesce behind one broadcast); None when they already run, a claim is
        pending, or waves are not coordinated. An index outside the table is the
        caller's mistake: ``ValueError``.
        """
        count = self._loads.engine_count
        if not 0 <= engine_index < count:
            raise ValueError(f"engine_index {engine_index} out of range for {count} engines")
        if not self._wave_coordination:
            return None
        return self._wave.claim_first_request(engine_index)

    # --- inputs: the command receiver ------------------------------------------------------

    def receive_command(self, command: Command, now: float) -> Sequence[Effect]:
        """Apply a first-request notice or an elastic-EP resize (after the gate opens)."""
        if not self._gate_open:
            self._deferred_commands.append(command)
            return _NOTHING
        self._commands += 1
        if isinstance(command, ScaleRequest):
            old = self._loads.engine_count
            self._loads.resize(command.engine_count)
            logger.info("elastic EP: load table %d -> %d engines", old, command.engine_count)
            return self._news()
        if not self._wave_coordination:
            return _NOTHING
        # _state logs every transition (old and new wave) at DEBUG
        start = self._wave.start_wave_for_first_request(command.wave, command.engine)
        if start is None:
            return _NOTHING
        cause = (
            WaveStartCause.LEGACY_FIRST_REQUEST if command.legacy else WaveStartCause.FIRST_REQUEST
        )
        return self._emit(
            [
                *self._wave_start(start, cause, now),
                ArmWakeDeadline(start.wave, now + self._wake_confirm_timeout),
            ]
        )

    # --- inputs: the engine sockets ---------------------------------------------------------

    def receive_engine_output(self, frames: Sequence[bytes], now: float) -> Sequence[Effect]:
        """One message from the engine-output socket (a list of frames, §4.5, §5.4, §5.5)."""
        self._engine_messages += 1
        if len(frames) != 1:
            return self._reject(
                "multipart_engine_output",
                f"{len(frames)}-frame message on the engine output socket",
            )
        try:
            kind, engine_index, value = protocol.decode_coordinator_output(frames[0])
        except protocol.ProtocolError as exc:
            return self._reject("undecodable_engine_output", str(exc))
        self._heard_from.add(engine_index)
        if kind is _STATS:
            assert isinstance(value, protocol.StatsReport)
            return self._apply_stats(engine_index, value)
        if kind is _WAVE_COMPLETE or kind is _START_WAVE:
            assert isinstance(value, int)
            return self._apply_wave_report(kind, engine_index, value, now)
        return self._reject(
            _NOT_FOR_COORDINATOR[kind],
            f"{kind.name} from engine {engine_index} is not for the coordinator",
        )

    def log_summary_due(self) -> float:
        """When :meth:`log_summaries` has a summary to write (``inf``: none is held)."""
        return self._unsubscription_burst.summary_due()

    def log_summaries(self, now: float, *, final: bool = False) -> None:
        """Sum up in one line the unsubscriptions of a burst that were logged at DEBUG only
        (a mass disconnect: the first few are told one by one). ``final``: stopping."""
        summary = self._unsubscription_burst.take_summary(now, final=final)
        if summary is not None:
            held, first, last = summary
            logger.warning(
                "%d more engines unsubscribed in %.1f s (each logged at DEBUG); "
                "%d still subscribed",
                held,
                last - first,
                self._subscribed - self._unsubscribed,
            )

    def receive_engine_subscription(self, frame: bytes, now: float) -> Sequence[Effect]:
        """A frame the engine broadcast XPUB read: an engine (un)subscribed (§5.2)."""
        sub = protocol.decode_subscription(frame)
        if sub is None:
            return self._reject(
                "unexpected_broadcast_socket_frame",
                f"{len(frame)}-byte upstream payload on the engine broadcast socket",
            )
        if not sub.subscribe:
            self._unsubscribed += 1
            self.log_summaries(now)
            logger.log(
                logging.WARNING if self._unsubscription_burst.admit(now) else logging.DEBUG,
                "an engine unsubscribed (%d still subscribed); "
                "it will get READY again when it comes back",
                self._subscribed - self._unsubscribed,
            )
            return _NOTHING
        self._subscribed += 1
        current = self._subscribed - self._unsubscribed
        if self._gate_open:
            self._late_subscriptions += 1
            logger.info("late engine subscription (%d subscribed): READY again", current)
            ready = Broadcast(_READY_FRAMES, None, now)
            snap = self._wave.snapshot
            if not (self._wave_coordination and snap.engines_running):
                return (ready,)
            # It missed this wave's START_DP_WAVE (a restart, a healed partition) and its
            # peers wait for it in the collective: the current wave again, nobody excluded.
            # Engines already running it ignore it (docs/protocol.md §6.4).
            logger.info(
                "wave %d runs: START_DP_WAVE again for the late subscriber", snap.current_wave
            )
            start = WaveStart(snap.current_wave, None)
            frames = protocol.encode_start_dp_wave(start.wave, None)
            return (ready, Broadcast(frames, start, now, WaveStartCause.LATE_SUBSCRIPTION))
        if current < self._expected_engines:
            logger.debug("engine subscribed (%d of %d)", current, self._expected_engines)
            return _NOTHING
        logger.info("all %d engines subscribed: opening the gate", current)
        return self._open_gate(now)

    # --- inputs: the sockets' connections ---------------------------------------------------

    def connection_opened(self, socket: str, now: float) -> Sequence[Effect]:
        """A peer connected to ``socket`` (``engine_broadcast``, ``engine_output``,
        ``front``): counted only; its subscription, if any, comes as its own input."""
        self._connections[socket] += 1
        return _NOTHING

    def connection_lost(self, socket: str, now: float) -> Sequence[Effect]:
        """A peer's connection to ``socket`` dropped: it closed it, died, or stayed silent
        past the heartbeat timeout. Counted; on the broadcast socket the XPUB also
        reports the unsubscription, which is the input that matters to the gate."""
        self._connections[socket] = max(0, self._connections[socket] - 1)
        self._connections_lost[socket] += 1
        self._last_connection_lost_at[socket] = now
        return _NOTHING

    # --- inputs: the front socket -----------------------------------------------------------

    def receive_front_frame(self, frame: bytes, now: float) -> Sequence[Effect]:
        """A frame the front XPUB read: a front-end (un)subscribed, SCALE_ELASTIC_EP or a
        legacy FIRST_REQ (§5.3, §5.8, §4.9). Commands come back as effects for the command
        receiver."""
        sub = protocol.decode_subscription(frame)
        if sub is not None:
            self._front_ends += 1 if sub.subscribe else -1
            logger.info(
                "front-end %s (%d subscribed)",
                "subscribed" if sub.subscribe else "unsubscribed",
                self._front_ends,
            )
            if not sub.subscribe or not self._gate_open:
                # before the gate, the first timed publish (due as it opens) serves it
                return _NOTHING
            # a newcomer gets the current counts now, not at the next heartbeat
            return (Publish(self.timed_publish(now)),)
        try:
            message = protocol.decode_front_message(frame)
        except protocol.ProtocolError as exc:
            return self._reject("undecodable_front_message", str(exc))
        if isinstance(message, protocol.ScaleElasticEP):
            if not 1 <= message.new_engine_count <= MAX_ENGINES:
                return self._reject(
                    "bad_scale_request", f"SCALE_ELASTIC_EP to {message.new_engine_count}"
                )
            return (ScaleRequest(message.new_engine_count),)
        return (FirstRequest(message.engine, message.wave, legacy=True),)

    # --- inputs: the passage of time and what was sent --------------------------------------

    def next_publish_due(self) -> float:
        """The clock reading at which :meth:`timed_publish` is due (``inf``: not yet)."""
        if not (self._gate_open and self._publish_to_front_ends):
            return math.inf
        loads = self._loads
        self._publisher_waiting_long = not (loads.stats_changed or loads.pending_snapshot)
        return self._schedule.next_due(loads)

    def timed_publish(self, now: float) -> bytes:
        """The timed publish due now: counts (or the pending lock-step snapshot), wave."""
        counts = self._loads.take_publish_counts()
        self._schedule.published(now)
        snap = self._wave.snapshot if self._wave_coordination else WaveSnapshot()
        return protocol.encode_front_publish_trusted(
            counts, snap.current_wave, snap.engines_running
        )

    def wake_deadline_passed(self, wave: int, now: float) -> Sequence[Effect]:
        """The wake-confirmation deadline of ``wave`` passed (see ArmWakeDeadline).

        If no engine has reported on the wave (rank 0 mirrors every start it joins, or a
        ``wave_complete``), paused engines dropped the START_DP_WAVE (§6.8): believe them
        paused rather than leave ``engines_running`` latched (vLLM #51476/#51481).
        """
        if not self._wave.expire_unconfirmed_start(wave):
            return _NOTHING
        self._unconfirmed_expiries += 1
        logger.warning(
            "no engine confirmed wave %d within %.1f s of its START_DP_WAVE (paused engines "
            "drop it): wave %d is paused again",
            wave,
            self._wake_confirm_timeout,
            wave,
        )
        return self._emit(self._wave_publish())

    def broadcast_sent(self, broadcast: Broadcast, now: float) -> None:
        """The broadcaster handed ``broadcast`` to ZeroMQ at ``now``."""
        if broadcast.wave_start is None:
            self._ready_broadcasts += 1
            return
        self._wave_starts[broadcast.cause or WaveStartCause.ENGINE_START_WAVE] += 1
        self._wake_latency.observe(max(0.0, now - broadcast.decided_at))

    def publish_sent(self) -> None:
        """The broadcaster sent one publish on the front socket."""
        self._front_publishes += 1

    # --- the rules ------------------------------------------------------------------------

    def _apply_stats(self, engine_index: int, report: protocol.StatsReport) -> Sequence[Effect]:
        outcome = self._loads.apply_stats(engine_index, report)
        if outcome is StatsOutcome.UNKNOWN_ENGINE:
            return self._reject(
                "unknown_engine_index",
                f"stats from engine {engine_index}, table has {self._loads.engine_count} engines",
            )
        if outcome is StatsOutcome.OUT_OF_ORDER:
            logger.debug(
                "out-of-order stats from engine %d: wave %d step %d",
                engine_index,
                report.wave,
                report.step,
            )
        self._stats_applied += 1
        return self._news()

    def _apply_wave_report(
        self, kind: protocol.OutputKind, engine_index: int, wave: int, now: float
    ) -> Sequence[Effect]:
        if not self._wave_coordination:
            return _NOTHING  # §5.7: wave fields are ignored without wave coordination
        if engine_index >= self._loads.engine_count:
            return self._reject(
                "unknown_engine_index",
                f"wave report from engine {engine_index}, table has "
                f"{self._loads.engine_count} engines",
            )
        if kind is _WAVE_COMPLETE:
            if wave >= MAX_WAVE:
                return self._reject(
                    "wave_out_of_range",
                    f"wave_complete({wave}) from engine {engine_index}: "
                    "the next wave does not fit in uint64",
                )
            if not self._wave.wave_complete(wave):
                return _NOTHING
            self._waves_completed += 1
            return self._emit(self._wave_publish())
        start = self._wave.engine_start_wave(wave, engine_index)
        if start is None:
            return _NOTHING
        return self._emit(self._wave_start(start, WaveStartCause.ENGINE_START_WAVE, now))

    def _wave_start(self, start: WaveStart, cause: str, now: float) -> list[Effect]:
        frames = protocol.encode_start_dp_wave(start.wave, start.exclude)
        return [Broadcast(frames, start, now, cause), *self._wave_publish()]

    def _wave_publish(self) -> list[Effect]:
        if not self._publish_to_front_ends:
            return []
        snap = self._wave.snapshot
        # the wave is a checked uint64 and the table holds decoded loads: no re-validation
        return [
            Publish(
                protocol.encode_front_publish_trusted(
                    None, snap.current_wave, snap.engines_running
                )
            )
        ]

    def _news(self) -> Sequence[Effect]:
        # The load table changed: a publisher sleeping until the heartbeat must wake sooner.
        if self._publisher_waiting_long:
            self._publisher_waiting_long = False
            return (RESCHEDULE,)
        return _NOTHING

    def _emit(self, effects: list[Effect]) -> Sequence[Effect]:
        # Before the gate opens nothing leaves: decisions wait, in order, behind READY.
        if self._gate_open:
            return effects
        self._deferred.extend(effects)
        return _NOTHING

    def _open_gate(self, now: float) -> list[Effect]:
        self._gate_open = True
        effects: list[Effect] = [Broadcast(_READY_FRAMES, None, now), *self._deferred]
        self._deferred.clear()
        if self._publish_to_front_ends:
            effects.append(RESCHEDULE)  # the first timed publish is due at once
        commands, self._deferred_commands = self._deferred_commands, []
        for command in commands:
            effects.extend(self.receive_command(command, now))
        return effects

    def _reject(self, reason: str, detail: str) -> tuple[Effect, ...]:
        self._counters_rejected[reason] += 1
        return (Reject(reason, detail),)
