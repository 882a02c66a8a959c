"""A coordinator that takes over from one that died: what it is told, and its extra rules.

A restart is an input of the core (:meth:`CoordinatorCore.restarted`): the engines and
front-ends lived on while no coordinator listened, so the new one knows only what the
caller hands over (:class:`Recovery`) and what the engines tell it from then on. The
rules (docs/protocol.md §16):

* **The wave never goes back.** The dead coordinator's wave (kept by the caller: the
  failed core in place, a file a standalone worker keeps up to date) is a floor: the new
  one starts there, paused, and everything the dead one broadcast or published was at
  most that. An engine's load report of a newer wave is adopted (the engines ended waves
  unobserved).
* **No request stranded.** A request that reached an engine while nobody listened may
  have woken it alone: its ``start_wave`` went to the dead coordinator, or was decided
  on and never broadcast. So the new coordinator, once its gate is open (at once when it
  was carried over), wakes every engine once at its wave (START_DP_WAVE with nobody
  excluded), unless a start it decided already runs: a stranded engine's peers join it,
  and idle engines run one wave of dummy steps and end it (rank 0 reports that).
* **Engines running are believed.** Until an engine's wave report settles the wave, a
  load report showing work (or a step past 0) while the coordinator believes the
  engines paused is a start too: its wave goes to everyone, nobody excluded. An idle
  engine's report of a newer wave moves the coordinator there, paused.
* **No wake twice for nothing.** The recovery wake is the only one a restart adds, and
  both kinds of recovery start wait for an engine's word like a first request's: if none
  comes within ``wake_confirm_timeout`` (paused engines drop START_DP_WAVE, engines
  already past that wave ignore it), the coordinator believes them paused again.
* **The engines settle it.** The first ``wave_complete`` or ``start_wave`` not older than
  the coordinator's wave ends the load-report rule: from then on §5.5 alone applies.

* **An unanswered wake is a probe's cue.** A process killed after it *read* rank 0's
  ``wave_complete(W)`` and a ``start_wave(W + 1)`` and before it applied them leaves a
  floor of W, and the engines are at W + 1: the recovery wake at W is stale for all of
  them (none answers), while the engine a request woke runs W + 1 alone, waiting for its
  peers, and reports nothing more (vLLM's engines report counts only when they change).
  So when the recovery wake's confirmation deadline passes unanswered (rank 0 mirrors
  every start it joins), the core wakes everyone once more at W + 1, nobody excluded
  (:meth:`RecoveryRules.unanswered`): at most one more wake, only after a silence.

What is still not covered (docs/protocol.md §16.4; ``tests/test_model_check.py`` shows
the trace): when only engine 1's ``start_wave(W + 1)`` was read and lost, rank 0's
leftover reports of W, read after it, settle the wave (no wake goes unanswered), and the
engine running W + 1 alone reports nothing more; a further request reaching any other
engine wakes it.

Loads are published again as soon as the gate is open (at once when it was carried
over), within one publish interval.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..protocol import EngineLoad, StatsReport
from ._wave import LoadTable, WaveStart, WaveState

__all__ = ["Recovery", "RecoveryRules"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Recovery:
    """What survived of a coordinator that died, for the one taking over from it.

    A restart in place (the same sockets, the failed core still readable) hands over
    all of it; a new process on the same addresses only ``wave`` (the engines connect
    again, subscribe again and go through the start-up gate); a restart with nothing
    known is ``Recovery()``.
    """

    wave: int | None = None
    """The wave the dead coordinator had reached (a floor; no broadcast or publish of it
    was newer). None: unknown, the restart starts at 0 and wakes nobody on its own (a
    front-end may then see the wave go back until the engines report)."""
    subscriptions: int = 0
    """Engine subscriptions still live on the broadcast socket when it is kept (the XPUB
    does not report them again)."""
    gate_open: bool = False
    """READY already went out on the kept broadcast socket: the gate is open at once, and
    nothing is sent again."""
    front_ends: int = 0
    """Front-ends subscribed on the kept front socket."""
    loads: tuple[EngineLoad, ...] = ()
    """The dead coordinator's load table (its size too, after an elastic resize); empty:
    unknown, every engine idle until it reports."""


class RecoveryRules:
    """The rules of a core that restarted, until an engine's wave report settles the
    wave (then the core drops this object). Takes over ``wave_state`` and ``loads``
    from a :class:`Recovery`; returns the starts the core broadcasts with cause
    ``recovery``."""

    __slots__ = ("_settled", "_wake_owed", "_waves", "_woke_at")

    def __init__(
        self, recovery: Recovery, wave_state: WaveState, loads: LoadTable, *, waves: bool
    ) -> None:
        if recovery.wave is not None:
            wave_state.recover(recovery.wave)
        if recovery.loads:
            loads.restore(recovery.loads)
        self._waves = waves
        self._wake_owed = waves and recovery.wave is not None
        self._settled = False
        self._woke_at: int | None = None
        """The wave of the recovery wake once it went out, until its probe went."""

    @property
    def wake_owed(self) -> bool:
        """The recovery wake has not gone out yet (it goes as the gate opens)."""
        return self._wake_owed

    def settled(self) -> RecoveryRules | None:
        """An engine's wave report, not older than the coordinator's wave: the load reports
        are loads only from now on. The rules are still needed (returned) while the wake is
        owed: a report delivered after a lost one (a start of the next wave, read and never
        applied by the dead coordinator) may settle the wave while an engine runs alone."""
        self._settled = True
        return self if self._wake_owed else None

    def wake(self, wave_state: WaveState) -> WaveStart | bool:
        """The gate is open: the one recovery wake, at the current wave, unless the engines
        already run (a start decided from their reports went out, or goes, behind READY).
        False: no wake."""
        if not self._wake_owed:
            return False
        self._wake_owed = False
        start = wave_state.recovery_start(wave_state.snapshot.current_wave)
        if start is None:
            return False
        self._woke_at = start.wave
        return start

    def unanswered(self, wave_state: WaveState, wave: int) -> WaveStart | None:
        """The recovery wake at ``wave`` passed its confirmation deadline with no engine's
        word (the core has just taken it back): every engine ignored it, so every engine
        is past ``wave``, paused, or one runs ``wave + 1`` alone, woken by a request whose
        ``start_wave(wave + 1)`` the dead process read with rank 0's
        ``wave_complete(wave)`` and never applied. The one probe: ``wave + 1`` to
        everyone, nobody excluded (paused peers join the lone engine; if none is alone,
        they run one wave of dummy steps and end it). None when this is not the recovery
        wake's deadline or the probe already went."""
        if wave != self._woke_at:  # (None: no wake went out, or its probe did)
            return None
        self._woke_at = None
        logger.warning(
            "no engine answered the recovery wake of wave %d: the engines are past it; "
            "waking every engine at wave %d",
            wave,
            wave + 1,
        )
        return wave_state.recovery_start(wave + 1)

    def stats(self, wave_state: WaveState, report: StatsReport) -> WaveStart | bool:
        """An engine's load report: an engine with work, or past step 0, runs its wave
        (all ranks step together, so its peers must too); an idle one is at its wave.
        Returns the start to broadcast, else whether the wave moved (to publish)."""
        if self._settled or not self._waves:
            return False
        load = report.load
        if report.step > 0 or load.running > 0 or load.waiting > 0:
            start = wave_state.recovery_start(report.wave)
            if start is None:
                return False
            self._wake_owed = False  # this start wakes everyone already
            return start
        return wave_state.recovery_paused_at(report.wave)
