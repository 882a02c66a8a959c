"""The wave's decisions and what they send: the core's side that faces the wave.

:class:`WaveRules` takes what :class:`~._coordinator.CoordinatorCore` routed to it once
an input is decoded and checked (an engine's wave report, a wake-confirmation deadline
that passed, a recovering core's verdict, an engine that subscribed late) and returns
the effects that must follow: START_DP_WAVE with the wave's publish to the front-ends,
or the publish alone, behind the start-up gate (docs/protocol.md §5.5, §6.4, §6.8,
§16). A recovery wake, which only an engine's report confirms, gets its deadline here.

The seam: the core reads frames, counts, keeps the gate, the subscriptions and the
timed publishes; this object decides what a wave event sends. Both share the one wave
state, load table, gate, deadlines and tally (the core makes them; nothing here owns a
copy), so splitting them changes no rule and no order of effects.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final, final

from .. import protocol
from ._counters import Tally
from ._effects import MAX_WAVE, Broadcast, Effect, Publish, WaveStartCause
from ._gate import StartupGate
from ._recovery import RecoveryRules
from ._wake import WakeDeadlines
from ._wave import LoadTable, WaveStart, WaveState

logger = logging.getLogger(__name__)

_NOTHING: Final[tuple[Effect, ...]] = ()
_WAVE_COMPLETE: Final = protocol.OutputKind.WAVE_COMPLETE
READY_FRAMES: Final = [protocol.READY]


@final
class WaveRules:
    """What each wave decision sends, in order (see the module docstring).

    ``recovery``: the rules of a core taking over from one that died (``_recovery.py``),
    set by :meth:`CoordinatorCore.restarted`; ``None`` once the engines' word settles it,
    or on a core that never restarted. Not thread-safe: the core's caller serialises.
    """

    __slots__ = (
        "_gate",
        "_loads",
        "_publish_to_front_ends",
        "_tally",
        "_wake_deadlines",
        "_wave",
        "_wave_coordination",
        "recovery",
    )

    def __init__(
        self,
        wave: WaveState,
        loads: LoadTable,
        gate: StartupGate,
        wake_deadlines: WakeDeadlines,
        tally: Tally,
        *,
        wave_coordination: bool,
        publish_to_front_ends: bool,
    ) -> None:
        self._wave = wave
        self._loads = loads
        self._gate = gate
        self._wake_deadlines = wake_deadlines
        self._tally = tally
        self._wave_coordination = wave_coordination
        self._publish_to_front_ends = publish_to_front_ends
        self.recovery: RecoveryRules | None = None

    def report(
        self, kind: protocol.OutputKind, engine_index: int, wave: int, now: float
    ) -> Sequence[Effect]:
        """An engine's ``wave_complete(wave)`` or ``start_wave(wave)`` (§5.5), decoded."""
        if not self._wave_coordination:
            return _NOTHING  # §5.7: wave fields are ignored without wave coordination
        if engine_index >= self._loads.engine_count:
            return self._tally.reject(
                "unknown_engine_index",
                f"wave report from engine {engine_index}, table has "
                f"{self._loads.engine_count} engines",
            )
        if self.recovery is not None and wave >= self._wave.snapshot.current_wave:
            self.recovery = self.recovery.settled()  # the engines' word (_recovery.py)
        if kind is _WAVE_COMPLETE:
            if wave >= MAX_WAVE:
                return self._tally.reject(
                    "wave_out_of_range",
                    f"wave_complete({wave}) from engine {engine_index}: "
                    "the next wave does not fit in uint64",
                )
            if not self._wave.wave_complete(wave):
                return _NOTHING
            self._tally.waves_completed += 1
            return self._gate.emit(self.publish())
        start = self._wave.engine_start_wave(wave, engine_index)
        if start is None:
            return _NOTHING
        return self._gate.emit(self.start(start, WaveStartCause.ENGINE_START_WAVE, now))

    def late_subscriber(self, level: int, now: float) -> tuple[Effect, ...]:
        """An engine subscribed after the gate opened: READY for it, then, if a wave runs,
        that wave's START_DP_WAVE again (logged at ``level``)."""
        ready = Broadcast(READY_FRAMES, None, now)
        snap = self._wave.snapshot
        if not (self._wave_coordination and snap.engines_running):
            return (ready,)
        # It missed this wave's START_DP_WAVE (a restart, a healed partition) and its
        # peers wait for it in the collective: the current wave again, nobody excluded.
        # Engines already running it ignore it (docs/protocol.md §6.4).
        logger.log(
            level,
            "wave %d runs: START_DP_WAVE again for the late subscriber",
            snap.current_wave,
        )
        start = WaveStart(snap.current_wave, None)
        frames = protocol.encode_start_dp_wave(start.wave, None)
        return (ready, Broadcast(frames, start, now, WaveStartCause.LATE_SUBSCRIPTION))

    def start(self, start: WaveStart, cause: str, now: float) -> list[Effect]:
        """START_DP_WAVE for ``start``, decided at ``now``, then the wave's publish."""
        frames = protocol.encode_start_dp_wave_trusted(start.wave, start.exclude)
        return [Broadcast(frames, start, now, cause), *self.publish()]

    def publish(self) -> list[Effect]:
        """The wave's publish to the front-ends (none unless the core publishes)."""
        if not self._publish_to_front_ends:
            return []
        snap = self._wave.snapshot
        # the wave is a checked uint64 and the table holds decoded loads: no re-validation
        return [
            Publish(
                protocol.encode_front_publish_trusted(None, snap.current_wave, snap.engines_running)
            )
        ]

    def deadline_passed(self, wave: int, now: float) -> Sequence[Effect]:
        """No engine confirmed the start of ``wave`` by its deadline (§6.8): paused again
        and published, or, while recovering, the recovery's next wake."""
        if not self._wave.expire_unconfirmed_start(wave):
            return _NOTHING
        self._tally.unconfirmed_expiries += 1
        if self.recovery is not None and (probe := self.recovery.unanswered(self._wave, wave)):
            return self.recovered(probe, now)
        logger.warning(
            "no engine confirmed wave %d within %.1f s of its START_DP_WAVE (paused engines "
            "drop it): wave %d is paused again",
            wave,
            self._wake_deadlines.timeout,
            wave,
        )
        return self._gate.emit(self.publish())

    def recovered(self, outcome: WaveStart | bool, now: float) -> Sequence[Effect]:
        """What a recovery verdict sends: nothing (``False``), the wave's publish
        (``True``: its state changed), or a wake to be confirmed (a :class:`WaveStart`)."""
        if outcome is False:
            return _NOTHING
        if outcome is True:  # the wave's state changed: the front-ends hear of it
            return self._gate.emit(self.publish())
        self._wake_deadlines.started(outcome.wave, now)
        return self._gate.emit(self.start(outcome, WaveStartCause.RECOVERY, now))
