"""Whether the coordinator reads its engine-output socket as fast as engines write to it
(sans-IO: the clock is passed in).

Past its limit a coordinator falls behind without bound: libzmq and the kernel queue what
it has not read (the PULL socket has no high-water mark, so nothing is dropped and memory
grows), the loads it publishes get older, and a ``start_wave`` waits behind every report
queued before it. Nothing in the messages says how old they are (an engine's timestamp is
its own monotonic clock), but the listener knows when the queue was empty: it reads in
batches of at most 64 messages, until the socket has no more, so a shorter batch means
the queue was empty after it, and a receive that had to wait means it was empty before.
Below the limit that happens many times a second; a queue that stays non-empty for
seconds is a backlog that grows.

:class:`IngestBacklog` turns those readings into the gauge (seconds since the queue was
last emptied, 0 right after) and into two log decisions: one WARNING when the backlog
has lasted ``warn_after`` seconds and then at most one per ``warn_every`` while it lasts,
and one INFO when the queue empties again after a warning.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

__all__ = ["BacklogNews", "IngestBacklog"]


class BacklogNews(NamedTuple):
    """A line to log: ``caught_up`` False while behind (WARNING), True once caught up
    (INFO); ``behind_for`` the backlog's age in seconds; ``coalesced`` the load reports
    superseded before they were written since the backlog began."""

    caught_up: bool
    behind_for: float
    coalesced: int

    def log(self, logger: logging.Logger) -> None:
        """Tell it: a WARNING while behind, an INFO once caught up."""
        if self.caught_up:
            logger.info(
                "engine output socket caught up after %.1f s behind (%d load reports "
                "superseded before they were written meanwhile)",
                self.behind_for,
                self.coalesced,
            )
        else:
            logger.warning(
                "engine output socket behind for %.1f s: its queue has not been empty since "
                "(%d load reports superseded before they were written meanwhile). Engines "
                "send faster than the coordinator reads: published loads are that old and "
                "wave reports wait behind the queue (docs/operations.md: past the limit)",
                self.behind_for,
                self.coalesced,
            )


class IngestBacklog:
    """The engine-output socket's backlog, from the batches the listener reads."""

    __slots__ = (
        "_coalesced",
        "_coalesced_total",
        "_last_warned",
        "_since",
        "behind_at_last_read",
        "warn_after",
        "warn_every",
    )

    def __init__(self, warn_after: float = 2.0, warn_every: float = 30.0) -> None:
        if not (warn_after > 0 and warn_every > 0):
            raise ValueError(f"need warn_after and warn_every > 0, got {warn_after}, {warn_every}")
        self.warn_after = warn_after
        self.warn_every = warn_every
        self._since: float | None = None
        """When the queue was last seen empty, while it has not been since (else None)."""
        self._last_warned = -math.inf
        self._coalesced = 0
        self._coalesced_total = 0
        self.behind_at_last_read = 0.0
        """:meth:`behind_for` as of the last :meth:`listener_read`."""

    def behind_for(self, now: float) -> float:
        """Seconds since the queue was last emptied (0 when the last batch emptied it)."""
        return 0.0 if self._since is None else max(0.0, now - self._since)

    def listener_read(
        self, *, drained: bool, coalesced_total: int, now: float
    ) -> BacklogNews | None:
        """:meth:`batch_read` from the running total of coalesced load reports (the
        core's count), remembering how far behind the listener was."""
        coalesced = coalesced_total - self._coalesced_total
        self._coalesced_total = coalesced_total
        if drained and self._since is None:  # keeping up (the wave path): nothing to tell
            self.behind_at_last_read = 0.0
            return None
        news = self.batch_read(drained=drained, coalesced=coalesced, now=now)
        self.behind_at_last_read = self.behind_for(now)
        return news

    def batch_read(self, *, drained: bool, coalesced: int, now: float) -> BacklogNews | None:
        """The listener read a batch at ``now``; ``drained``: the queue was empty as it
        began or once it was read; ``coalesced``: load reports superseded since the last
        reading.
        Returns the line to log, if one is due."""
        if drained:
            if self._since is None:
                return None
            news = None
            if self._last_warned > -math.inf:
                news = BacklogNews(True, now - self._since, self._coalesced + coalesced)
            self._since = None
            self._last_warned = -math.inf
            self._coalesced = 0
            return news
        if self._since is None:
            self._since = now
            self._coalesced = 0
        self._coalesced += coalesced
        behind = now - self._since
        if behind >= self.warn_after and now >= self._last_warned + self.warn_every:
            self._last_warned = now
            return BacklogNews(False, behind, self._coalesced)
        return None
