"""How often a progress reading is worth a log line (sans-IO: the clock is passed in).

A fleet of 2,048 engines subscribing changes the start-up gate's count hundreds of times in
a second; one line per change buries everything else in the log. A :class:`ProgressPacer`
lets the first reading through, then at most one per ``interval``, and says when the
newest unlogged reading becomes due, so that a caller waiting for the next change can
wake at that time and log where things stand instead of keeping it back until they move.
"""

from __future__ import annotations

import math

__all__ = ["ProgressPacer"]


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
