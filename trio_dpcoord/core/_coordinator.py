"""The coordinator's sans-IO core: every rule in one object, no I/O, no clock of its own.

:class:`CoordinatorCore` is to the coordinator what h11's ``Connection`` is to HTTP: it
takes what arrived (raw frames from a socket, a command, a clock reading) and returns
the *effects* that must follow, in order; it never awaits, never touches a socket and
never reads a clock. The trio service (``_shell/coordinator.py``) only moves bytes: each pump
reads one socket, calls the core under the coordinator's lock and hands each effect to
the one task that owns where it goes. The names that go in and come out, and who owns
each effect, are documented in the public :mod:`trio_dpcoord.core`.

The rules it owns (docs/protocol.md §5 and §13): the start-up gate and READY (what waits
behind it: ``_gate.py``), late subscriptions (their counts and log lines:
``_subscriptions.py``), the wave state machine with vLLM PR #46833's rule, the
wave-coordination mode, the load table and its lock-step snapshot, every bounds check on
what peers send, the wake-confirmation rule (a first-request start no engine confirms
goes back to paused; its deadlines: ``_wake.py``), publish timing, and the counters.
What a wave decision sends (START_DP_WAVE, the wave's publish, behind the gate) is
decided in ``_wave_rules.py``, beside the recovery's verdicts.
Everything the core returns before the gate opens waits inside it and comes out behind
READY, in the order it was decided.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final, final

from .. import protocol
from ..protocol import EngineLoad
from ..protocol._output_decoder import decode_coordinator_output
from ._backlog import IngestBacklog
from ._counters import (
    CoordinatorStatistics,
    HistogramSnapshot,
    SubscriptionView,
    Tally,
)
from ._effects import (
    MAX_ENGINES,
    MAX_WAVE,
    Broadcast,
    Command,
    Effect,
    Publish,
    Reject,
    ScaleRequest,
    WaveStartCause,
)
from ._gate import StartupGate
from ._ingest import HeldStats, log_out_of_order
from ._recovery import Recovery, RecoveryRules
from ._subscriptions import Subscriptions
from ._wake import WakeDeadlines
from ._wave import (
    HEARTBEAT_INTERVAL,
    FirstRequest,
    LoadTable,
    PublishSchedule,
    StatsOutcome,
    WaveSnapshot,
    WaveState,
    check_engine_index,
)
from ._wave_rules import READY_FRAMES, WaveRules

__all__ = [
    "MAX_ENGINES",
    "MAX_WAVE",
    "Broadcast",
    "Command",
    "CoordinatorCore",
    "CoordinatorStatistics",
    "Effect",
    "HistogramSnapshot",
    "Publish",
    "Reject",
    "ScaleRequest",
    "SubscriptionView",
    "WaveStartCause",
]

logger = logging.getLogger(__name__)

_NOTHING: Final[tuple[Effect, ...]] = ()


_STATS: Final = protocol.OutputKind.STATS
_WAVE_COMPLETE: Final = protocol.OutputKind.WAVE_COMPLETE
_START_WAVE: Final = protocol.OutputKind.START_WAVE
_NOT_FOR_COORDINATOR: Final = {
    kind: f"non_control_output_{kind.name.lower()}"
    for kind in protocol.OutputKind
    if kind not in (_STATS, _WAVE_COMPLETE, _START_WAVE)
}


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
        "_backlog",
        "_expected_engines",
        "_gate",
        "_heard_from",
        "_held",
        "_loads",
        "_publish_to_front_ends",
        "_rules",
        "_schedule",
        "_subscriptions",
        "_tally",
        "_wake_deadlines",
        "_wave",
        "_wave_coordination",
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
    ) -> None:
        if type(engine_count) is not int or not 1 <= engine_count <= MAX_ENGINES:
            raise ValueError(
                f"engine_count must be a positive int (at most {MAX_ENGINES}), got {engine_count!r}"
            )
        if not stats_interval > 0:
            raise ValueError(f"stats_interval must be positive, got {stats_interval!r}")
        self._expected_engines = engine_count
        self._wave_coordination = wave_coordination
        self._publish_to_front_ends = publish_to_front_ends
        self._wave = WaveState()
        self._loads = LoadTable(engine_count, lockstep=wave_coordination)
        self._schedule = PublishSchedule(interval=stats_interval, heartbeat=heartbeat_interval)
        self._gate = StartupGate()
        self._wake_deadlines = WakeDeadlines(wake_confirm_timeout)
        self._heard_from: set[int] = set()
        self._subscriptions = Subscriptions()
        self._backlog = IngestBacklog()
        self._tally = Tally()
        self._held = HeldStats(self._loads, self._tally, self._heard_from)
        self._rules = WaveRules(
            self._wave,
            self._loads,
            self._gate,
            self._wake_deadlines,
            self._tally,
            wave_coordination=wave_coordination,
            publish_to_front_ends=publish_to_front_ends,
        )

    # --- reading it ------------------------------------------------------------------------

    @property
    def wave_coordination(self) -> bool:
        """Whether waves are coordinated (MoE models) or ignored (dense models, §5.7)."""
        return self._wave_coordination

    @property
    def expected_engines(self) -> int:
        """How many subscriptions open the start-up gate (fixed at construction)."""
        return self._expected_engines

    def engine_count(self) -> int:
        """How many engines the load table holds (changes with SCALE_ELASTIC_EP)."""
        return self._loads.engine_count

    def gate_open(self) -> bool:
        """Whether the start-up gate has opened (READY went out to the engines)."""
        return self._gate.is_open

    @property
    def wake_confirm_timeout(self) -> float:
        return self._wake_deadlines.timeout

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
        return self._subscriptions.view(gate_open=self._gate.is_open)

    def counters(self) -> CoordinatorStatistics:
        return self._tally.counters(
            engine_output_backlog=self._backlog.behind_at_last_read,
            connections_lost=self._subscriptions.connections_lost(),
        )

    # --- inputs: commands ----------------------------------------------------------------

    def claim_first_request(self, engine_index: int) -> FirstRequest | None:
        """The embedding front-end routes a request to ``engine_index``: claim the
        wake-up, synchronously, then apply the claim with :meth:`receive_command`.

        Returns the :class:`FirstRequest` to apply when the engines looked paused (the
        snapshot says running from now on, so concurrent callers coalesce behind one
        broadcast); None when they already run, a claim is pending, or waves are not
        coordinated. An index that is not an int in the table is the caller's mistake:
        ``TypeError`` or ``ValueError``.
        """
        check_engine_index(engine_index, self._loads.engine_count)
        if not self._wave_coordination:
            return None
        return self._wave.claim_first_request(engine_index)

    def receive_command(self, command: Command, now: float) -> Sequence[Effect]:
        """Apply a first-request notice or an elastic-EP resize: the one path of every
        command, from the handle or decoded off the front socket. Before the gate opens
        it waits, and is applied behind READY (vLLM's coordinator reads nothing earlier)."""
        if self._gate.hold_command(command):
            return _NOTHING
        self._tally.commands += 1
        if isinstance(command, ScaleRequest):
            old = self._loads.engine_count
            self._loads.resize(command.engine_count)
            logger.info("elastic EP: load table %d -> %d engines", old, command.engine_count)
            return _NOTHING
        if not self._wave_coordination:
            return _NOTHING
        # _state logs every transition (old and new wave) at DEBUG
        start = self._wave.start_wave_for_first_request(command.wave, command.engine)
        if start is None:
            return _NOTHING
        # rank 0 reports every start it joins: one nobody confirms in time was dropped
        self._wake_deadlines.started(start.wave, now)
        cause = (
            WaveStartCause.LEGACY_FIRST_REQUEST if command.legacy else WaveStartCause.FIRST_REQUEST
        )
        return self._rules.start(start, cause, now)

    # --- inputs: the engine sockets ---------------------------------------------------------

    def engine_output_batch_read(self, *, drained: bool, now: float) -> None:
        """The listener read a batch off the engine-output socket at ``now``; ``drained``:
        its queue was empty as the batch began (the receive waited) or after it (it was
        short). Logs a backlog lasting seconds, and its end (``_backlog.py``)."""
        coalesced = self._tally.stats_coalesced
        news = self._backlog.listener_read(drained=drained, coalesced_total=coalesced, now=now)
        if news is not None:
            news.log(logger)

    def engine_output_backlog(self, now: float) -> float:
        """Seconds the engine-output socket's queue has not been empty (0: keeping up)."""
        return self._backlog.behind_for(now)

    def receive_engine_output(
        self, frames: Sequence[bytes], now: float, *, hold_stats: bool = False
    ) -> Sequence[Effect]:
        """One message from the engine-output socket (a list of frames, §4.5, §5.4, §5.5).

        ``hold_stats``: a valid load report is checked and counted now, written to the table
        by :meth:`apply_held_stats`, called before any other input or read (the shell does):
        as if applied at once, wave reports behind need not wait."""
        self._tally.engine_messages += 1
        if len(frames) != 1:
            detail = f"{len(frames)}-frame message on the engine output socket"
            return self._tally.reject("multipart_engine_output", detail)
        try:
            kind, engine_index, value = decode_coordinator_output(frames[0])
        except protocol.ProtocolError as exc:
            return self._tally.reject("undecodable_engine_output", str(exc))
        self._heard_from.add(engine_index)
        if kind is _STATS:
            assert isinstance(value, protocol.StatsReport)
            if hold_stats:
                rejected = self._hold_stats(engine_index, value)
            else:
                rejected = self._apply_stats(engine_index, value)
            if rejected:
                return rejected
            if (recovery := self._rules.recovery) is None:
                return _NOTHING
            return self._rules.recovered(recovery.stats(self._wave, value), now)
        if kind is _WAVE_COMPLETE or kind is _START_WAVE:
            assert isinstance(value, int)
            return self._rules.report(kind, engine_index, value, now)
        return self._tally.reject(
            _NOT_FOR_COORDINATOR[kind],
            f"{kind.name} from engine {engine_index} is not for the coordinator",
        )

    def receive_engine_outputs(
        self, messages: Sequence[Sequence[bytes]], start: int, now: float
    ) -> tuple[int, list[Effect]]:
        """``messages[start:]`` as ``receive_engine_output(m, now, hold_stats=True)`` one
        by one then :meth:`apply_held_stats` (effects in that order), up to the first
        message whose effects hold a :class:`Broadcast`; returns the position after it (or
        the end) and the effects. Stats reports take the hot path (``_ingest.py``)."""
        held = self._held
        # while recovering, every report takes the full path (the recovery reads it)
        engines = self._loads.engine_count if self._rules.recovery is None else 0
        effects: list[Effect] = []
        index, end = start, len(messages)
        while (index := held.take(messages, index, engines)) < end:
            held.failed_message = index  # a bug raising in there: the shell skips it
            taken = self.receive_engine_output(messages[index], now, hold_stats=True)
            index += 1
            if taken:
                effects.extend(taken)
                if Broadcast in map(type, taken):  # no generator frame per message
                    break
        effects.extend(self.apply_held_stats())
        held.failed_message = None
        return index, effects

    @property
    def failed_message(self) -> int | None:
        """The message :meth:`receive_engine_outputs` raised on (a bug), by position."""
        return self._held.failed_message

    def expect_shutdown(self) -> None:
        """The fleet is being stopped on purpose: engines unsubscribing from now on are
        told at INFO (still counted, still summed up in a burst), not WARNING."""
        self._subscriptions.expect_shutdown()

    def log_summaries(self, now: float, *, final: bool = False) -> None:
        """Sum up in one line each the unsubscriptions and the late subscriptions of a
        burst that were logged at DEBUG only (a mass disconnect or reconnect: the first
        few are told one by one). ``final``: stopping."""
        self._subscriptions.log_summaries(now, final=final)

    def receive_engine_subscription(self, frame: bytes, now: float) -> Sequence[Effect]:
        """A frame the engine broadcast XPUB read: an engine (un)subscribed (§5.2)."""
        sub = protocol.decode_subscription(frame)
        if sub is None:
            return self._tally.reject(
                "unexpected_broadcast_socket_frame",
                f"{len(frame)}-byte upstream payload on the engine broadcast socket",
            )
        subscriptions = self._subscriptions
        if not sub.subscribe:
            subscriptions.engine_unsubscribed(now)
            return _NOTHING
        if self._gate.is_open:
            return self._rules.late_subscriber(subscriptions.late_engine_subscribed(now), now)
        current = subscriptions.engine_subscribed()
        if current < self._expected_engines:
            logger.debug("engine subscribed (%d of %d)", current, self._expected_engines)
            return _NOTHING
        logger.info("all %d engines subscribed: opening the gate", current)
        return self._open_gate(now)

    # --- inputs: the sockets' connections ---------------------------------------------------

    def connection_opened(self, socket: str, now: float) -> None:
        """A peer connected to ``socket`` (``back_publish``, ``back_output``,
        ``front``): counted only; its subscription, if any, comes as its own input."""
        self._subscriptions.connection_opened(socket)

    def connection_lost(self, socket: str, now: float) -> None:
        """A peer's connection to ``socket`` dropped: it closed it, died, or stayed silent
        past the heartbeat timeout. Counted; on the broadcast socket the XPUB also
        reports the unsubscription, which is the input that matters to the gate."""
        self._subscriptions.connection_lost(socket, now)

    # --- inputs: the front socket -----------------------------------------------------------

    def receive_front_frame(self, frame: bytes, now: float) -> Sequence[Effect]:
        """A frame the front XPUB read: a front-end (un)subscribed, SCALE_ELASTIC_EP or a
        legacy FIRST_REQ (§5.3, §5.8, §4.9); a command is applied with
        :meth:`receive_command`."""
        sub = protocol.decode_subscription(frame)
        if sub is not None:
            self._subscriptions.front_end(subscribe=sub.subscribe)
            if not sub.subscribe or not self._gate.is_open:
                # before the gate, the first timed publish (due as it opens) serves it
                return _NOTHING
            # a newcomer gets the current counts now, not at the next heartbeat
            return (self._timed_publish(now),)
        try:
            message = protocol.decode_front_message(frame)
        except protocol.ProtocolError as exc:
            return self._tally.reject("undecodable_front_message", str(exc))
        if isinstance(message, protocol.ScaleElasticEP):
            if not 1 <= message.new_engine_count <= MAX_ENGINES:
                return self._tally.reject(
                    "bad_scale_request", f"SCALE_ELASTIC_EP to {message.new_engine_count}"
                )
            return self.receive_command(ScaleRequest(message.new_engine_count), now)
        return self.receive_command(FirstRequest(message.engine, message.wave, legacy=True), now)

    # --- inputs: the passage of time and what was sent --------------------------------------

    def next_deadline(self) -> float:
        """The clock reading at which :meth:`tick` has something to do (``inf``: nothing
        is scheduled): the next timed publish, wake-confirmation deadline or burst summary
        line. A pure query; any input may move it earlier, so the shell asks again after
        each one."""
        due = self._subscriptions.summary_due()
        due = min(due, self._wake_deadlines.next_due())
        if self._gate.is_open and self._publish_to_front_ends:
            due = min(due, self._schedule.next_due(self._loads))
        return due

    def tick(self, now: float) -> Sequence[Effect]:
        """The clock reached ``now``: whatever :meth:`next_deadline` scheduled up to it.

        A first-request (or recovery) start no engine reported on by its deadline (rank
        0 mirrors every start it joins) was dropped by paused engines (§6.8): paused
        again, not latched running (vLLM #51476/#51481), and published. Then the timed
        publish if due (counts or the lock-step snapshot, and the wave), behind the rest.
        """
        effects: list[Effect] = []
        for wave in self._wake_deadlines.passed(now):
            effects.extend(self._rules.deadline_passed(wave, now))
        if self._subscriptions.summary_due() <= now:
            self.log_summaries(now)
        if (
            self._gate.is_open
            and self._publish_to_front_ends
            and self._schedule.next_due(self._loads) <= now
        ):
            effects.append(self._timed_publish(now))
        return effects if effects else _NOTHING

    def _timed_publish(self, now: float) -> Publish:
        counts = self._loads.take_publish_counts()
        self._schedule.published(now)
        snap = self._wave.snapshot if self._wave_coordination else WaveSnapshot()
        return Publish(
            protocol.encode_front_publish_trusted(counts, snap.current_wave, snap.engines_running)
        )

    def ready_sent(self) -> bool:
        """Whether READY has been handed to ZeroMQ (see :meth:`broadcast_sent`)."""
        return self._tally.ready_broadcasts > 0

    def broadcast_sent(self, broadcast: Broadcast, now: float) -> None:
        """The broadcaster handed ``broadcast`` to ZeroMQ at ``now``."""
        if broadcast.wave_start is None:
            self._tally.ready_broadcasts += 1
            return
        self._tally.wave_starts[broadcast.cause or WaveStartCause.ENGINE_START_WAVE] += 1
        self._tally.wake_latency.observe(max(0.0, now - broadcast.decided_at))

    def publish_sent(self, count: int = 1) -> None:
        """The broadcaster sent ``count`` publishes on the front socket."""
        self._tally.front_publishes += count

    # --- the load reports (wave reports: _wave_rules.py) ---------------------------------

    def _apply_stats(self, engine_index: int, report: protocol.StatsReport) -> Sequence[Effect]:
        outcome = self._loads.apply_stats(engine_index, report)
        if outcome is StatsOutcome.UNKNOWN_ENGINE:
            return self._unknown_engine_stats(engine_index)
        if outcome is StatsOutcome.OUT_OF_ORDER:
            log_out_of_order(engine_index, report.wave, report.step)
        self._tally.stats_applied += 1
        return _NOTHING

    def _hold_stats(self, engine_index: int, report: protocol.StatsReport) -> Sequence[Effect]:
        if not 0 <= engine_index < self._loads.engine_count:
            return self._unknown_engine_stats(engine_index)
        waiting, running, kv = report.load
        self._held.hold((engine_index, waiting, running, kv, report.wave, report.step))
        self._tally.stats_applied += 1
        return _NOTHING

    def apply_held_stats(self) -> Sequence[Effect]:
        """Write the held load reports, the newest of each engine (``HeldStats.write``);
        those beyond the table (a resize came between) are rejected."""
        dropped = self._held.write()
        return tuple(self._unknown_engine_stats(e)[0] for e in dropped) if dropped else _NOTHING

    def _unknown_engine_stats(self, engine_index: int) -> tuple[Effect, ...]:
        return self._tally.reject(
            "unknown_engine_index",
            f"stats from engine {engine_index}, table has {self._loads.engine_count} engines",
        )

    # --- the gate, and taking over from a core that died -----------------------------------

    def _open_gate(self, now: float) -> list[Effect]:
        deferred, commands = self._gate.open()
        effects: list[Effect] = [Broadcast(READY_FRAMES, None, now), *deferred]
        for command in commands:
            effects.extend(self.receive_command(command, now))
        if (recovery := self._rules.recovery) is not None:
            effects.extend(self._rules.recovered(recovery.wake(self._wave), now))
        return effects

    def restarted(self, recovery: Recovery, now: float) -> Sequence[Effect]:
        """Take over from a coordinator that died: a fresh core's first input (_recovery.py)."""
        fresh = self._subscriptions.subscribed == 0 and self._tally.engine_messages == 0
        if self._rules.recovery is not None or not fresh:
            raise ValueError("restarted() must be the first input of a fresh core")
        rules = RecoveryRules(recovery, self._wave, self._loads, waves=self._wave_coordination)
        self._rules.recovery = rules
        if recovery.gate_open:
            self._gate.open()
        self._subscriptions.restored(recovery.subscriptions, recovery.front_ends)
        if not self._gate.is_open:
            return _NOTHING
        return self._rules.recovered(rules.wake(self._wave), now)
