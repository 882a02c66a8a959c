"""What the coordinator's core counts and shows: its counters, the wake-latency histogram,
the engines' subscription view; plain values, read under the coordinator's lock."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass
from typing import Final, final

from ._effects import Reject

__all__ = ["WAKE_LATENCY_BOUNDS", "CoordinatorStatistics", "HistogramSnapshot", "SubscriptionView"]

WAKE_LATENCY_BOUNDS: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
"""Upper bounds (seconds) of the wake decision-to-send latency histogram's buckets."""


# --- what the core reports -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A latency histogram: ``counts[i]`` samples fell at or below ``bounds[i]`` seconds
    (and above the previous bound); the last count is above every bound (+Inf)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int


@dataclass(frozen=True, slots=True)
class CoordinatorStatistics:
    """What the coordinator received, decided, sent and rejected, since it started."""

    engine_messages: int
    """Messages received on the engine-output socket (accepted or not)."""
    stats_applied: int
    """Valid load reports taken in (each engine's newest in a batch reaches the table)."""
    stats_coalesced: int
    """Of those, reports superseded in the same batch by a newer one of their engine, so
    never written to the load table (the state is the same as if they had been)."""
    engine_output_backlog: float
    """Seconds the engine-output socket's queue had not been empty when the listener last
    read a batch: 0 while the coordinator keeps up, growing while it falls behind."""
    waves_completed: int
    """Accepted ``wave_complete`` reports (each moved the wave on)."""
    wave_starts: int
    """START_DP_WAVE broadcasts sent."""
    wave_starts_by_cause: dict[str, int]
    """START_DP_WAVE broadcasts sent, by :class:`WaveStartCause`."""
    ready_broadcasts: int
    front_publishes: int
    commands: int
    """Commands applied: first-request notices and elastic-EP resizes."""
    unconfirmed_expiries: int
    """First-request starts no engine confirmed in time, so paused again."""
    rejected: dict[str, int]
    """Rejected inputs by reason, e.g. ``{"undecodable_engine_output": 2}``."""
    wake_latency: HistogramSnapshot
    """Seconds from a START_DP_WAVE decision until it was handed to ZeroMQ."""
    connections_lost: dict[str, int]
    """Peer connections lost, by socket (``back_publish``, ``back_output``,
    ``front``): closed by the peer, or silent past the heartbeat timeout."""

    @property
    def errors(self) -> int:
        """Total rejected inputs."""
        return sum(self.rejected.values())


@dataclass(frozen=True, slots=True)
class SubscriptionView:
    """The engines' subscriptions to the broadcast socket, as the XPUB reported them.

    Subscription frames carry no engine identity, so this counts them: ``current`` is
    how many engines are subscribed now; an engine that dies or restarts shows as an
    unsubscription (the socket is verbose about both) and, when it is back, a late
    subscription answered with READY.
    """

    current: int
    subscribed: int
    unsubscribed: int
    late_subscriptions: int
    gate_open: bool
    front_ends: int
    """Front-ends subscribed to the front socket (standalone mode)."""
    connections: int
    """Peer connections open on the engine broadcast socket now."""
    connections_lost: int
    """Connections the engine broadcast socket lost: a peer that dies or stays silent
    past the heartbeat timeout shows here, and as an unsubscription."""
    last_connection_lost_at: float | None
    """The clock reading (``now``) of the latest such loss."""


class LatencyHistogram:
    __slots__ = ("_counts", "_sum")

    def __init__(self) -> None:
        self._counts = [0] * (len(WAKE_LATENCY_BOUNDS) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(WAKE_LATENCY_BOUNDS, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(
            WAKE_LATENCY_BOUNDS, tuple(self._counts), self._sum, sum(self._counts)
        )


@final
class Tally:
    """The core's running counts (what :meth:`CoordinatorCore.counters` copies out)."""

    __slots__ = (
        "commands",
        "engine_messages",
        "front_publishes",
        "ready_broadcasts",
        "rejected",
        "stats_applied",
        "stats_coalesced",
        "unconfirmed_expiries",
        "wake_latency",
        "wave_starts",
        "waves_completed",
    )

    def __init__(self) -> None:
        self.engine_messages = 0
        self.stats_applied = 0
        self.stats_coalesced = 0
        self.waves_completed = 0
        self.wave_starts: Counter[str] = Counter()
        self.ready_broadcasts = 0
        self.front_publishes = 0
        self.commands = 0
        self.unconfirmed_expiries = 0
        self.rejected: Counter[str] = Counter()
        self.wake_latency = LatencyHistogram()

    def counters(
        self, *, engine_output_backlog: float, connections_lost: dict[str, int]
    ) -> CoordinatorStatistics:
        """A copy of the counts, with what the core keeps elsewhere."""
        return CoordinatorStatistics(
            engine_messages=self.engine_messages,
            stats_applied=self.stats_applied,
            stats_coalesced=self.stats_coalesced,
            engine_output_backlog=engine_output_backlog,
            waves_completed=self.waves_completed,
            wave_starts=sum(self.wave_starts.values()),
            wave_starts_by_cause=dict(self.wave_starts),
            ready_broadcasts=self.ready_broadcasts,
            front_publishes=self.front_publishes,
            commands=self.commands,
            unconfirmed_expiries=self.unconfirmed_expiries,
            rejected=dict(self.rejected),
            wake_latency=self.wake_latency.snapshot(),
            connections_lost=connections_lost,
        )

    def reject(self, reason: str, detail: str) -> tuple[Reject]:
        """Count a rejected input under ``reason``: the :class:`Reject` effect to return."""
        self.rejected[reason] += 1
        return (Reject(reason, detail),)
