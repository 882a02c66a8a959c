"""How often a progress reading is worth a log line (sans-IO: the clock is passed in).

A fleet of 2,048 engines subscribing changes the start-up gate's count hundreds of times in
a second; one line per change buries everything else in the log. A :class:`ProgressPacer`
lets the first reading through, then at most one per ``interval``, and says when the
newest unlogged reading becomes due, so that a caller waiting for the next change can
wake at that time and log where things stand instead of keeping it back until they move.
"""

from __future__ import annotations

import math

__all__ = ["BurstSummary", "ProgressPacer"]


class ProgressPacer:
    """Paces log lines about a changing value: the first reading, then one per ``interval``
    seconds at most, always the newest; a reading equal to the last logged is never due.
    ``logged``: a value already told some other way (a count of 0 in a "waiting for" line)."""

    __slots__ = ("_last_logged_at", "_logged", "interval")

    def __init__(self, interval: float, *, logged: object = None) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        self.interval = interval
        self._last_logged_at: float | None = None
        self._logged = logged

    def should_log(self, value: object, now: float) -> bool:
        """Whether ``value``, read at ``now``, gets a line now; if so it counts as logged."""
        if value == self._logged:
            return False
        if self._last_logged_at is not None and now < self._last_logged_at + self.interval:
            return False
        self._last_logged_at = now
        self._logged = value
        return True

    def next_due(self, value: object) -> float:
        """When ``value`` (the newest reading) will be due; ``inf`` if it never needs a line."""
        if value == self._logged:
            return math.inf
        if self._last_logged_at is None:
            return -math.inf
        return self._last_logged_at + self.interval


class BurstSummary:
    """Which events of a burst get a line of their own, and when the rest are summed up.

    A mass disconnect of 2,000 engines is one event for an operator, not 4,000 lines. In
    each window of ``interval`` seconds (opened by its first event) the first
    ``individually`` events are told one by one; the others are only counted, and once the
    window has ended :meth:`take_summary` returns how many were held back, with the first
    and last event's moments, for one summary line. The caller asks :meth:`summary_due`
    when to wake if nothing else happens, so the summary is never left unsaid. A burst that
    goes on past its window (the next event within ``interval`` of the summed-up window's
    end) is told by summaries only, one a window: a flood slowed down by a loaded machine
    costs a line a second, not ``individually + 1``.
    """

    __slots__ = (
        "_held",
        "_held_since",
        "_held_until",
        "_quiet_after",
        "_told",
        "_window_start",
        "individually",
        "interval",
    )

    def __init__(self, interval: float = 1.0, individually: int = 5) -> None:
        if not interval > 0 or individually < 0:
            raise ValueError(
                f"need interval > 0 and individually >= 0, got {interval!r}, {individually!r}"
            )
        self.interval = interval
        self.individually = individually
        self._window_start: float | None = None
        self._told = 0
        self._held = 0
        self._held_since = 0.0
        self._held_until = 0.0
        self._quiet_after = -math.inf

    def admit(self, now: float) -> bool:
        """An event at ``now``: True if it gets its own line, False if it is held back.
        Call :meth:`take_summary` first, so that a finished window is summed up before a
        new one opens."""
        if self._window_start is None or now >= self._window_start + self.interval:
            if self._held:  # the caller skipped take_summary: never lose the count
                return True
            self._window_start = now
            # a burst still going on: its first events were told in an earlier window
            self._told = self.individually if now < self._quiet_after else 0
        if self._told < self.individually:
            self._told += 1
            return True
        if not self._held:
            self._held_since = now
        self._held += 1
        self._held_until = now
        return False

    def summary_due(self) -> float:
        """When the held-back events can be summed up (``inf`` when none are held)."""
        if not self._held or self._window_start is None:
            return math.inf
        return self._window_start + self.interval

    def take_summary(self, now: float, *, final: bool = False) -> tuple[int, float, float] | None:
        """``(held, first, last)`` for one summary line once the window has ended (or
        ``final``: the caller is stopping), else None; the count starts again from 0."""
        if not self._held or (not final and now < self.summary_due()):
            return None
        summary = (self._held, self._held_since, self._held_until)
        self._quiet_after = self.summary_due() + self.interval
        self._held = 0
        self._window_start = None
        return summary
