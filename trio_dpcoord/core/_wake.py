"""The wake-confirmation clock: every first-request (or recovery) start must be confirmed
by an engine within a timeout (docs/protocol.md §6.8).

Paused engines drop a START_DP_WAVE; rank 0 mirrors every start it joins. A start nobody
reported on by its deadline was dropped, and the core puts its wave back to paused
(vLLM #51476/#51481). :class:`WakeDeadlines` keeps the deadlines, in order (one timeout
for all); the rule that follows is the core's (``_coordinator.py``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import final

__all__ = ["WakeDeadlines"]


@final
class WakeDeadlines:
    """The (deadline, wave) of each start no engine confirmed yet, in order."""

    __slots__ = ("_deadlines", "timeout")

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"wake_confirm_timeout must be positive, got {timeout!r}")
        self.timeout = timeout
        self._deadlines: deque[tuple[float, int]] = deque()

    def started(self, wave: int, now: float) -> None:
        """A start of ``wave`` went out at ``now``: an engine must confirm it in time."""
        self._deadlines.append((now + self.timeout, wave))

    def next_due(self) -> float:
        """The earliest deadline (``inf``: none pending)."""
        return self._deadlines[0][0] if self._deadlines else math.inf

    def passed(self, now: float) -> list[int]:
        """The waves whose deadline ``now`` reached, in order; forgotten from here on."""
        waves = []
        while self._deadlines and self._deadlines[0][0] <= now:
            waves.append(self._deadlines.popleft()[1])
        return waves
