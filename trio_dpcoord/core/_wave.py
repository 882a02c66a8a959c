"""The parts of the sans-IO core: the wave state machine, the load table, publish timing.

Nothing here does I/O, knows trio or ZeroMQ, or reads a clock. :class:`CoordinatorCore`
(``_core.py``) composes these three objects with the rest of the coordinator's rules;
each rule of docs/protocol.md §5 is one method whose result says what must go out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final

from ..protocol import IDLE_LOAD, EngineLoad, StatsReport

__all__ = [
    "HEARTBEAT_INTERVAL",
    "FirstRequest",
    "LoadTable",
    "PublishSchedule",
    "StatsOutcome",
    "StatsRecord",
    "WaveSnapshot",
    "WaveStart",
    "WaveState",
    "check_engine_index",
]

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL: Final = 5.0
"""Front-ends get a publish at least this often, news or not (vLLM's heartbeat)."""


def check_engine_index(engine_index: int, engine_count: int | None) -> None:
    """A caller's engine index: ``TypeError`` if not an int, ``ValueError`` if outside
    ``0 <= engine_index < engine_count`` (only below 0 while the count is unknown, None).
    The embedded handle and a front-end check the same way."""
    if type(engine_index) is not int:
        raise TypeError(f"engine_index must be an int, got {type(engine_index).__name__}")
    if engine_index < 0 or (engine_count is not None and engine_index >= engine_count):
        raise ValueError(f"engine_index {engine_index} out of range for {engine_count} engines")


@dataclass(frozen=True, slots=True)
class WaveSnapshot:
    """What a front-end stamps on each request: the current wave and whether it runs."""

    current_wave: int = 0
    engines_running: bool = False


@dataclass(frozen=True, slots=True)
class WaveStart:
    """A ``START_DP_WAVE`` broadcast: every engine except ``exclude`` joins ``wave``.

    ``exclude`` is ``None`` when every engine must wake (a stale first request), an
    engine index otherwise, or the raw identity bytes a legacy front-end sent.
    """

    wave: int
    exclude: int | bytes | None


@dataclass(frozen=True, slots=True)
class FirstRequest:
    """A front-end routed a request to ``engine`` while it believed ``wave`` was paused.

    ``legacy`` marks a FIRST_REQ that came over the front socket (pre-0.33 front-ends)
    rather than from the embedded handle; the rule is the same, only the counters differ.
    """

    engine: int | bytes | None
    wave: int
    legacy: bool = False


class WaveState:
    """The coordinator's view of the global wave: ``(current_wave, engines_running)``.

    Invariants: the wave never decreases; an accepted start produces exactly one
    :class:`WaveStart`; an ignored input changes nothing.

    Three inputs move it (docs/protocol.md §5.5 and vLLM PR #46833):

    * :meth:`wave_complete` from DP rank 0,
    * :meth:`engine_start_wave` when a request reached an idle engine (vLLM >= 0.33),
    * :meth:`start_wave_for_first_request` for a front-end's first-request notice
      (the embedded handle, or a legacy front-end's FIRST_REQ).

    The embedded handle claims a first request synchronously with
    :meth:`claim_first_request`, which flips ``engines_running`` at once so that
    concurrent requests coalesce behind one broadcast; the claim stays *pending* until
    the queued :class:`FirstRequest` is handled, so that handling still wakes the
    engines even though the snapshot already says running.
    """

    __slots__ = ("_first_request_pending", "_snapshot", "_unconfirmed_wave")

    def __init__(self, snapshot: WaveSnapshot | None = None) -> None:
        self._snapshot = snapshot if snapshot is not None else WaveSnapshot()
        self._first_request_pending = False
        self._unconfirmed_wave: int | None = None

    @property
    def snapshot(self) -> WaveSnapshot:
        return self._snapshot

    @property
    def first_request_pending(self) -> bool:
        """True between a handle's claim and the handling of its first request (or an
        engine's accepted start_wave, which wakes everyone and makes the notice moot)."""
        return self._first_request_pending

    def claim_first_request(self, engine: int | bytes | None) -> FirstRequest | None:
        """The handle's synchronous half: claim the wake-up if the engines look paused.

        Returns the :class:`FirstRequest` to queue, or ``None`` when the engines already
        run (or another claim is pending), so concurrent callers coalesce.
        """
        if self._snapshot.engines_running:
            return None
        wave = self._snapshot.current_wave
        self._snapshot = WaveSnapshot(wave, True)
        self._first_request_pending = True
        logger.debug("first request for engine %r claimed at wave %d", engine, wave)
        return FirstRequest(engine, wave)

    def start_wave_for_first_request(
        self, request_wave: int, target_engine_index: int | bytes | None
    ) -> WaveStart | None:
        """Handle a first-request notice with PR #46833's rule.

        Acts while the engines are paused, or when this notice was claimed by
        :meth:`claim_first_request` and not yet handled; otherwise the engines already
        run and nothing is sent. When it acts it sets ``engines_running`` and broadcasts
        the **current** wave (never the request's: no rewind), excluding the target
        engine only if the request's wave is current; a stale request wakes everyone,
        because its target may have served it in the older wave and gone back to sleep.
        """
        pending = self._first_request_pending
        self._first_request_pending = False
        current = self._snapshot.current_wave
        if self._snapshot.engines_running and not pending:
            logger.debug(
                "first request (wave %d, engine %r) ignored: wave %d already running",
                request_wave,
                target_engine_index,
                current,
            )
            return None
        exclude = target_engine_index if request_wave >= current else None
        self._snapshot = WaveSnapshot(current, True)
        self._unconfirmed_wave = current
        logger.debug(
            "first request (wave %d, engine %r): wave %d running, exclude %r",
            request_wave,
            target_engine_index,
            current,
            exclude,
        )
        return WaveStart(current, exclude)

    def wave_complete(self, wave: int) -> bool:
        """Rank 0 finished ``wave``: move to ``wave + 1``, paused. Older waves are ignored.

        Returns whether the snapshot changed.
        """
        old = self._snapshot
        self._confirm(wave)
        if old.current_wave > wave:
            logger.debug(
                "wave_complete(%d) ignored: current wave %d is newer", wave, old.current_wave
            )
            return False
        self._snapshot = WaveSnapshot(wave + 1, False)
        logger.debug("wave_complete(%d): wave %d -> %d, paused", wave, old.current_wave, wave + 1)
        return self._snapshot != old

    def engine_start_wave(self, wave: int, engine_index: int) -> WaveStart | None:
        """An idle engine got a request and started ``wave`` itself: wake the others.

        Accepted when ``wave`` is newer than the current wave, or equal to it while
        paused; then the engines run ``wave`` and every engine but the reporter is woken.
        A stale wave, or the wave already running, is ignored.
        """
        old = self._snapshot
        self._confirm(wave)
        if wave > old.current_wave or (wave == old.current_wave and not old.engines_running):
            self._snapshot = WaveSnapshot(wave, True)
            # This broadcast wakes every engine but the (awake) reporter: a pending claim
            # has nothing left to do, and handling it would re-broadcast a running wave.
            self._first_request_pending = False
            logger.debug(
                "start_wave(%d) from engine %d: wave %d -> %d, running",
                wave,
                engine_index,
                old.current_wave,
                wave,
            )
            return WaveStart(wave, engine_index)
        logger.debug(
            "start_wave(%d) from engine %d ignored: current wave %d, running=%s",
            wave,
            engine_index,
            old.current_wave,
            old.engines_running,
        )
        return None

    # --- after a restart (docs/protocol.md §16; the rules are ``_recovery.py``'s) ---------------

    def recover(self, wave: int) -> None:
        """A fresh state taking over from a coordinator that died at ``wave``: that wave,
        paused, until the engines say otherwise (what the dead one broadcast or published
        was never newer, so nobody sees the wave go back)."""
        self._snapshot = WaveSnapshot(wave, False)

    def recovery_start(self, wave: int) -> WaveStart | None:
        """After a restart: the engines may run ``wave`` while the coordinator believes
        otherwise (its one recovery wake, or an engine's load report showing work).

        Accepted as :meth:`engine_start_wave` accepts a start (a newer wave, or the
        current one while paused), but it excludes nobody (an engine already running
        the wave ignores it) and, like a first request's, waits for an engine's word:
        :meth:`expire_unconfirmed_start` takes it back if none comes.
        """
        old = self._snapshot
        if wave < old.current_wave or (wave == old.current_wave and old.engines_running):
            return None
        self._snapshot = WaveSnapshot(wave, True)
        self._first_request_pending = False
        self._unconfirmed_wave = wave
        logger.debug("recovery: wave %d -> %d, running", old.current_wave, wave)
        return WaveStart(wave, None)

    def recovery_paused_at(self, wave: int) -> bool:
        """After a restart: an engine reports itself idle at ``wave``. A newer wave than
        the coordinator's is adopted, paused (the engines ended the waves between
        unobserved); returns whether the snapshot changed."""
        if wave <= self._snapshot.current_wave:
            return False
        logger.debug("recovery: an idle engine at wave %d: adopted, paused", wave)
        self._confirm(wave)
        self._snapshot = WaveSnapshot(wave, False)
        return True

    @property
    def unconfirmed_wave(self) -> int | None:
        """The wave a first-request notice started that no engine has reported on yet."""
        return self._unconfirmed_wave

    def _confirm(self, wave: int) -> None:
        # Any engine report for the wave (or a later one) shows the engines got the start.
        if self._unconfirmed_wave is not None and wave >= self._unconfirmed_wave:
            self._unconfirmed_wave = None

    def expire_unconfirmed_start(self, wave: int) -> bool:
        """No engine confirmed the start of ``wave`` in time: believe them paused again.

        A first-request notice sets ``engines_running`` on the strength of a broadcast
        alone, and engines that agreed on a two-phase pause drop START_DP_WAVE (§6.8).
        Without an engine's word (rank 0 mirrors every start it joins, R8; or a
        ``wave_complete``) the flag would stay latched True while every engine sleeps
        (vLLM issues #51476/#51481), and each later ``start_wave`` for this wave would be
        ignored as a duplicate, stranding its request. Returns whether the snapshot
        changed (back to ``(wave, paused)``).
        """
        if self._unconfirmed_wave != wave or self._snapshot != WaveSnapshot(wave, True):
            return False
        self._unconfirmed_wave = None
        self._first_request_pending = False
        self._snapshot = WaveSnapshot(wave, False)
        logger.debug("start of wave %d unconfirmed: wave %d running -> paused", wave, wave)
        return True


class StatsOutcome(Enum):
    """What :meth:`LoadTable.apply_stats` did with a report."""

    APPLIED = "applied"
    OUT_OF_ORDER = "out_of_order"
    """Applied, but older than this engine's previous report (docs/protocol.md §5.4, R10)."""
    UNKNOWN_ENGINE = "unknown_engine"
    """Dropped: the engine index is beyond the table (e.g. after a scale-down)."""


_NO_STEP = (-1, -1)
_new_tuple: Final = tuple.__new__

StatsRecord = tuple[int, int, int, float, int, int]
"""One load report, flat: ``(engine_index, waiting, running, kv_cache_usage, wave,
step)`` (the coordinator decoder's ``IngestStats``)."""


class LoadTable:
    """Per-engine ``(waiting, running, kv_cache_usage)`` and the lock-step snapshot.

    In wave mode (``lockstep=True``), the first report of a newer ``(wave, step)``
    captures the counts as they stood at the end of the previous step, so front-ends
    see all engines as of one step boundary (docs/protocol.md §5.4). Unlike vLLM, the
    out-of-order check uses a cursor per engine: a slower engine's report for a step
    the others already left is normal, not out of order (R10).
    """

    __slots__ = (
        "_cursors",
        "_loads",
        "_lockstep",
        "_step_cursor",
        "pending_snapshot",
        "stats_changed",
    )

    def __init__(self, engine_count: int, *, lockstep: bool = True) -> None:
        if engine_count < 1:
            raise ValueError(f"engine_count must be >= 1, got {engine_count}")
        self._lockstep = lockstep
        self._loads: list[EngineLoad] = [IDLE_LOAD] * engine_count
        self._cursors: list[tuple[int, int]] = [_NO_STEP] * engine_count
        self._step_cursor = _NO_STEP
        self.stats_changed = False
        self.pending_snapshot: tuple[EngineLoad, ...] | None = None

    @property
    def engine_count(self) -> int:
        return len(self._loads)

    def loads(self) -> tuple[EngineLoad, ...]:
        """The live per-engine loads, in rank order."""
        return tuple(self._loads)

    def apply_stats(self, engine_index: int, report: StatsReport) -> StatsOutcome:
        """Record one engine's load report (docs/protocol.md §5.4)."""
        if not 0 <= engine_index < len(self._loads):
            return StatsOutcome.UNKNOWN_ENGINE
        outcome = StatsOutcome.APPLIED
        if self._lockstep:
            position = (report.wave, report.step)
            if position > self._step_cursor:
                if self.stats_changed:
                    self.pending_snapshot = tuple(self._loads)
                self._step_cursor = position
            if position < self._cursors[engine_index]:
                outcome = StatsOutcome.OUT_OF_ORDER
            else:
                self._cursors[engine_index] = position
        self._loads[engine_index] = report.load
        self.stats_changed = True
        return outcome

    def apply_stats_batch(
        self, reports: Sequence[tuple[int, StatsReport]]
    ) -> tuple[int, list[tuple[int, StatsReport]]]:
        """:meth:`apply_records` for ``(engine_index, report)`` pairs; returns how many
        were superseded and the out-of-order pairs."""
        records = [
            (e, r.load.waiting, r.load.running, r.load.kv_cache_usage, r.wave, r.step)
            for e, r in reports
        ]
        superseded, out_of_order = self.apply_records(records)
        return superseded, [reports[i] for i in out_of_order]

    def apply_records(self, records: Sequence[StatsRecord]) -> tuple[int, list[int]]:
        """Record reports received together, in order, as :meth:`apply_stats` one by one
        would, but write only the newest load of each engine: the others are superseded
        before anyone could read them (nobody reads the table while a batch is applied).
        Each report is a flat :data:`StatsRecord`, as the coordinator's decoder gives it:
        an :class:`EngineLoad` is built only for each engine's newest.

        Returns how many reports were superseded (coalesced) and the positions of the
        out-of-order ones. Every engine index must be in the table (the core rejects the
        others first).

        The lock-step snapshot is the one thing that needs an older report: a report of
        a newer ``(wave, step)`` captures the counts as they stood before it, which within
        the batch are the newest of each engine *before* that report. So at each step
        advance the newest loads seen so far are kept (a copy of at most one entry per
        engine of the batch); only the last advance's copy survives, as one by one.
        Cursors are per engine maxima and are written as they go, as one by one.
        """
        loads = self._loads
        newest: dict[int, StatsRecord] = {}
        out_of_order: list[int] = []
        if self._lockstep:
            cursors = self._cursors
            top = self._step_cursor
            changed = self.stats_changed
            before_advance: dict[int, StatsRecord] | None = None
            for index, record in enumerate(records):
                engine_index = record[0]
                position = record[4:]
                if position > top:
                    if changed:
                        before_advance = dict(newest)
                    top = position
                if position < cursors[engine_index]:
                    out_of_order.append(index)
                else:
                    cursors[engine_index] = position
                newest[engine_index] = record
                changed = True
            if before_advance is not None:
                snapshot = list(loads)
                for engine_index, record in before_advance.items():
                    snapshot[engine_index] = _new_tuple(EngineLoad, record[1:4])
                self.pending_snapshot = tuple(snapshot)
            self._step_cursor = top
        else:
            for record in records:
                newest[record[0]] = record
        for engine_index, record in newest.items():
            loads[engine_index] = _new_tuple(EngineLoad, record[1:4])
        if records:
            self.stats_changed = True
        return len(records) - len(newest), out_of_order

    def resize(self, engine_count: int) -> None:
        """Elastic EP: grow with zero loads or truncate (docs/protocol.md §5.8)."""
        if engine_count < 1:
            raise ValueError(f"engine_count must be >= 1, got {engine_count}")
        current = len(self._loads)
        if engine_count > current:
            self._loads.extend([IDLE_LOAD] * (engine_count - current))
            self._cursors.extend([_NO_STEP] * (engine_count - current))
        else:
            del self._loads[engine_count:]
            del self._cursors[engine_count:]
        # front-ends should see the new table size within one publish interval
        self.pending_snapshot = None
        self.stats_changed = True

    def restore(self, loads: Sequence[EngineLoad]) -> None:
        """Take over the load table of a coordinator that died (its size and loads); the
        next timed publish carries them."""
        self.resize(len(loads))
        self._loads[:] = loads

    def take_publish_counts(self) -> tuple[EngineLoad, ...]:
        """The counts a timed publish carries, and the flags that publish clears (§5.6).

        A pending lock-step snapshot goes first and ``stats_changed`` stays set, so the
        live counts follow one interval later; otherwise the live counts go and
        ``stats_changed`` is cleared.
        """
        if self.pending_snapshot is not None:
            counts = self.pending_snapshot
            self.pending_snapshot = None
            return counts
        self.stats_changed = False
        return tuple(self._loads)

    @property
    def cursors(self) -> tuple[tuple[int, int], ...]:
        """Each engine's newest ``(wave, step)`` reported, in rank order (``(-1, -1)``
        before its first report, and always outside lock-step): what a report is checked
        against to be out of order (R10). Read-only, a copy."""
        return tuple(self._cursors)

    @property
    def step_cursor(self) -> tuple[int, int]:
        """The newest ``(wave, step)`` any engine reported (``(-1, -1)`` before the first
        and outside lock-step): a report past it takes the lock-step snapshot."""
        return self._step_cursor


class PublishSchedule:
    """When the next timed front publish is due, given a clock reading passed in.

    About ``interval`` seconds after the previous timed publish while the load table has
    news (changed stats or a pending snapshot), a heartbeat every ``heartbeat`` seconds
    otherwise. The first publish is due at once. Unlike vLLM (§5.6), a steady stream of
    incoming messages does not postpone a due publish: the deadline is absolute.
    """

    __slots__ = ("_last_publish", "heartbeat", "interval")

    def __init__(self, interval: float = 0.1, heartbeat: float = HEARTBEAT_INTERVAL) -> None:
        if interval <= 0 or heartbeat <= 0:
            raise ValueError("publish interval and heartbeat must be positive")
        self.interval = interval
        self.heartbeat = heartbeat
        self._last_publish = -math.inf

    def next_due(self, table: LoadTable) -> float:
        """The clock reading at which the next timed publish is due."""
        has_news = table.stats_changed or table.pending_snapshot is not None
        return self._last_publish + (self.interval if has_news else self.heartbeat)

    def published(self, now: float) -> None:
        """Record that a timed publish went out at ``now``."""
        self._last_publish = now
