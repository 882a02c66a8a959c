"""Rate-limited WARNINGs for refused input: one shape for every room that refuses it.

Bad input is logged, counted and dropped, never fatal; but a peer that sends nothing
but bad input must not flood the log either. A room counts each refusal itself (its
counters are the exact record) and hands the message to a :class:`RejectLog`, which
writes at most one line per reason per :attr:`RejectLog.INTERVAL` and says how many it
held back. Only the standard library: the sans-IO rooms, the trio shell and the asyncio
vLLM plugin all use it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from typing import Final

__all__ = ["CountedRejectLog", "RejectLog"]


class RejectLog:
    """Logs refused input at WARNING, at most once per reason every ``INTERVAL`` seconds
    (the caller counts every refusal: the coordinator's core, the front-end's
    ``rejected()``, the router's counters)."""

    INTERVAL: Final = 5.0

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._last_logged: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def __call__(self, reason: str, detail: str, now: float | None = None) -> None:
        """Log ``detail`` under ``reason`` unless that reason was logged less than
        ``INTERVAL`` seconds before ``now`` (a clock reading; ``time.monotonic()`` if
        None: sans-IO callers pass the time they were given)."""
        if now is None:
            now = time.monotonic()
        if now - self._last_logged.get(reason, -math.inf) >= self.INTERVAL:
            suppressed = self._suppressed.pop(reason, 0)
            more = f" ({suppressed} more since last report)" if suppressed else ""
            self._logger.warning("rejected input [%s]: %s%s", reason, detail, more)
            self._last_logged[reason] = now
        else:
            self._suppressed[reason] += 1


class CountedRejectLog(RejectLog):
    """A :class:`RejectLog` that also counts every refusal, by reason (:attr:`counts`),
    for a room whose statistics report them (the engine client's)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger)
        self.counts: Counter[str] = Counter()

    def __call__(self, reason: str, detail: str, now: float | None = None) -> None:
        self.counts[reason] += 1
        super().__call__(reason, detail, now)
