"""Who is subscribed where, counted and told: the coordinator core's bookkeeping of its
peers (docs/protocol.md §5.2, §5.3).

:class:`Subscriptions` counts the engines' (un)subscriptions on the broadcast socket and
the late ones, the front-ends subscribed to the front socket and every socket's
connections, and logs them: the first few of a burst (a mass disconnect or reconnect)
one by one, the rest in one summary line (``_pacing.py``). It decides nothing: the
start-up gate and READY are the core's rules (``_coordinator.py``), read from
:attr:`Subscriptions.current`.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Final, final

from ._counters import SubscriptionView
from ._pacing import BurstSummary

__all__ = ["BROADCAST_SOCKET", "Subscriptions"]

logger = logging.getLogger(__name__)

BROADCAST_SOCKET: Final = "back_publish"


@final
class Subscriptions:
    """The core's count of its peers' subscriptions and connections (module docstring)."""

    __slots__ = (
        "_connections",
        "_connections_lost",
        "_last_connection_lost_at",
        "_late_subscription_burst",
        "_shutdown_expected",
        "_unsubscription_burst",
        "front_ends",
        "late_subscriptions",
        "subscribed",
        "unsubscribed",
    )

    def __init__(self) -> None:
        self.subscribed = 0
        self.unsubscribed = 0
        self.late_subscriptions = 0
        self.front_ends = 0
        self._unsubscription_burst = BurstSummary()
        self._late_subscription_burst = BurstSummary()
        self._shutdown_expected = False
        self._connections: Counter[str] = Counter()
        self._connections_lost: Counter[str] = Counter()
        self._last_connection_lost_at: dict[str, float] = {}

    @property
    def current(self) -> int:
        """Engines subscribed now."""
        return self.subscribed - self.unsubscribed

    def view(self, *, gate_open: bool) -> SubscriptionView:
        return SubscriptionView(
            current=self.current,
            subscribed=self.subscribed,
            unsubscribed=self.unsubscribed,
            late_subscriptions=self.late_subscriptions,
            gate_open=gate_open,
            front_ends=self.front_ends,
            connections=self._connections[BROADCAST_SOCKET],
            connections_lost=self._connections_lost[BROADCAST_SOCKET],
            last_connection_lost_at=self._last_connection_lost_at.get(BROADCAST_SOCKET),
        )

    def connections_lost(self) -> dict[str, int]:
        """Connections lost so far, by socket."""
        return dict(self._connections_lost)

    def restored(self, subscriptions: int, front_ends: int) -> None:
        """Take over the counts of a coordinator that died (``_recovery.py``)."""
        self.subscribed = subscriptions
        self.front_ends = front_ends

    def expect_shutdown(self) -> None:
        """Engines unsubscribing from now on are told at INFO, not WARNING."""
        self._shutdown_expected = True

    @property
    def _unsubscription_level(self) -> int:
        return logging.INFO if self._shutdown_expected else logging.WARNING

    def engine_unsubscribed(self, now: float) -> None:
        self.unsubscribed += 1
        self.log_summaries(now)
        if self._unsubscription_burst.admit(now):
            level = self._unsubscription_level
        else:
            level = logging.DEBUG
        logger.log(
            level,
            "an engine unsubscribed (%d still subscribed); "
            "it will get READY again when it comes back",
            self.current,
        )

    def engine_subscribed(self) -> int:
        """An engine subscribed before the gate opened; returns how many are now."""
        self.subscribed += 1
        return self.current

    def late_engine_subscribed(self, now: float) -> int:
        """An engine subscribed after the gate opened (it gets READY again); returns the
        level to tell what follows at (DEBUG within a burst)."""
        self.subscribed += 1
        self.late_subscriptions += 1
        self.log_summaries(now)
        level = logging.INFO if self._late_subscription_burst.admit(now) else logging.DEBUG
        logger.log(level, "late engine subscription (%d subscribed): READY again", self.current)
        return level

    def front_end(self, *, subscribe: bool) -> None:
        self.front_ends += 1 if subscribe else -1
        logger.info(
            "front-end %s (%d subscribed)",
            "subscribed" if subscribe else "unsubscribed",
            self.front_ends,
        )

    def connection_opened(self, socket: str) -> None:
        self._connections[socket] += 1

    def connection_lost(self, socket: str, now: float) -> None:
        self._connections[socket] = max(0, self._connections[socket] - 1)
        self._connections_lost[socket] += 1
        self._last_connection_lost_at[socket] = now

    def summary_due(self) -> float:
        """When the next burst summary line is due (``inf``: none)."""
        return min(
            self._unsubscription_burst.summary_due(), self._late_subscription_burst.summary_due()
        )

    def log_summaries(self, now: float, *, final: bool = False) -> None:
        """Sum up in one line each the unsubscriptions and the late subscriptions of a
        burst that were logged at DEBUG only (the first few are told one by one).
        ``final``: stopping."""
        summary = self._unsubscription_burst.take_summary(now, final=final)
        if summary is not None:
            held, first, last = summary
            logger.log(
                self._unsubscription_level,
                "%d more engines unsubscribed in %.1f s (each logged at DEBUG); "
                "%d still subscribed",
                held,
                last - first,
                self.current,
            )
        summary = self._late_subscription_burst.take_summary(now, final=final)
        if summary is not None:
            held, first, last = summary
            logger.info(
                "%d more late engine subscriptions in %.1f s, each sent READY again "
                "(logged at DEBUG); %d subscribed",
                held,
                last - first,
                self.current,
            )
