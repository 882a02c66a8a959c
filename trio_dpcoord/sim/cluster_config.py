"""What a run of the simulated cluster is given and what it gives back.

:class:`ClusterConfig` (how to run it), :class:`ClusterReport` (its outcome),
:class:`Progress` (a live view), :func:`log_to_stderr` (where child processes' lines go
by default) and :func:`percentile` (the report's latency figures): shared by the
in-process run (:mod:`.cluster`), the process supervision (:mod:`.fleet`), the run
through the engine client (:mod:`.engine_core`) and the soak (:mod:`.soak`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .. import EngineChooser, PrefixRouting, Routing
from .frontend import WakePath
from .load import LoadPlan
from .timeline import Timeline

__all__ = [
    "ClusterConfig",
    "ClusterReport",
    "Mode",
    "Progress",
    "log_to_stderr",
    "percentile",
]

Mode = Literal["inproc", "standalone"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """How to run the cluster; the defaults are the launcher's."""

    engines: int = 4
    mode: Mode = "inproc"
    wake_path: WakePath = "both"
    load: LoadPlan = field(default_factory=LoadPlan)
    step_time: float = 0.002
    max_running: int = 8
    sync_interval: int = 16
    collective_timeout: float = 10.0
    ready_timeout: float = 30.0
    stall_timeout: float | None = None
    """Fail when requests are pending and none finished for this long (default: twice
    the collective timeout plus 5 s)."""
    engine_log_level: str = "WARNING"
    restart_vanished: bool = False
    """Restart an engine process that exits unexpectedly (after reporting it) and resubmit
    its in-flight requests, the whole DP group when its collective timed out, and a
    standalone coordinator on the same addresses, instead of ending the run."""
    host: str | None = None
    """Bind the front-end's sockets (and the coordinator's, with ``--allow-remote``) on
    ``tcp://HOST`` instead of private ipc paths: engines may run on other hosts."""
    engine_prefix: tuple[tuple[str, ...], ...] = ()
    """Per rank, a command prefix for its engine process (e.g. ``("ip", "netns", "exec",
    "node1")``); ranks beyond the tuple run directly."""
    coordinator_prefix: tuple[str, ...] = ()
    """A command prefix for the standalone coordinator's process."""
    collective_address: str | None = None
    """Where rank 0 hosts the collective (default: a private ipc path)."""
    coordinator_args: tuple[str, ...] = ()
    """Extra options for ``trio-dpcoord serve`` in standalone mode (they come last)."""
    record_timeline: bool = False
    """Record engine states, wake-ups and requests in flight (:attr:`ClusterReport.timeline`)."""
    routing: Routing = "vllm"
    """The front-end's engine choice: vLLM's score or ``"prefix"`` (see
    :class:`~trio_dpcoord.EngineChooser`); give the load ``sessions`` for prompts that
    share prefixes."""
    prefix_cache_blocks: int = 0
    """Each engine's prefix cache, in 16-token blocks; 0 (the default) runs the
    fixed-step toy engines. With a cache, engines compute only uncached prompt tokens,
    their steps grow with ``step_per_token`` and they report prefix-cache queries and
    hits (:attr:`ClusterReport.prefix_hits`); see :class:`~trio_dpcoord.sim.EngineConfig`."""
    token_budget: int = 2048
    """Tokens per engine step (vLLM's ``max_num_batched_tokens``), with a prefix cache."""
    step_per_token: float = 0.0
    """Seconds each processed token adds to a step, with a prefix cache."""
    kv_events: bool = False
    """Engines publish vLLM KV-cache events, the front-end subscribes; with the prefix
    routing, the chooser is then fed exactly (``feed="exact"``). Needs a prefix cache
    and private ipc addresses (no ``host``)."""
    prefix: PrefixRouting | None = None
    """The prefix routing's settings; by default ``PrefixRouting`` sized to the engines'
    caches (``capacity_blocks``), exact with ``kv_events``, approximate without."""

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("engines must be >= 1")
        if self.mode not in ("inproc", "standalone"):
            raise ValueError(f"mode must be inproc or standalone, got {self.mode!r}")
        EngineChooser.check_routing(self.routing)
        if self.prefix_cache_blocks < 0 or self.token_budget < 1 or not self.step_per_token >= 0:
            raise ValueError(
                "need prefix_cache_blocks >= 0, token_budget >= 1, step_per_token >= 0"
            )
        if self.kv_events and (not self.prefix_cache_blocks or self.host is not None):
            raise ValueError("kv_events needs prefix_cache_blocks > 0 and no host")

    def prefix_routing(self) -> PrefixRouting | None:
        """The front-end's prefix settings: :attr:`prefix`, or the default for the run."""
        if self.prefix is not None or self.routing != "prefix":
            return self.prefix
        if not self.prefix_cache_blocks:
            return PrefixRouting(feed="exact" if self.kv_events else "approximate")
        return PrefixRouting(
            capacity_blocks=self.prefix_cache_blocks,
            feed="exact" if self.kv_events else "approximate",
        )


@dataclass(slots=True)
class ClusterReport:
    """The outcome of one run; :attr:`ok` decides the launcher's exit status."""

    mode: str
    engines: int
    wake_path: str
    seed: int
    planned: int
    routing: str = "vllm"
    routing_counters: dict[str, int] | None = None
    """With the prefix routing: the router's counters (``RouterStatistics``) at the end."""
    prefix_queries: list[int] = field(default_factory=list)
    """Per engine, the prompt tokens it looked up in its prefix cache, as its scheduler
    stats reported (vLLM's ``prefix_cache_stats.queries``; engines with a cache)."""
    prefix_hits: list[int] = field(default_factory=list)
    """Per engine, the prompt tokens its prefix cache held (``prefix_cache_stats.hits``)."""
    engine_tokens: list[int] = field(default_factory=list)
    """Per engine, the output tokens it sent."""
    kv_event_batches: int = 0
    requests: int = 0
    completed: int = 0
    waves: int = 0
    coordinator_errors: int = 0
    frontend_errors: int = 0
    wave_regressions: int = 0
    notifications: int = 0
    pauses: int = 0
    collective_timeouts: list[str] = field(default_factory=list)
    engine_failures: list[str] = field(default_factory=list)
    engine_restarts: list[str] = field(default_factory=list)
    """Vanished engines that were restarted (``restart_vanished``): reported, not errors."""
    group_restarts: list[str] = field(default_factory=list)
    """With ``restart_vanished``, the collective timeouts that made the whole DP group
    restart (reported, not errors; without it they are in ``collective_timeouts``)."""
    coordinator_restarts: list[str] = field(default_factory=list)
    """A vanished standalone coordinator restarted (``restart_vanished``): not errors."""
    wave_resets: int = 0
    """The front-end saw a restarted coordinator start at a lower wave (not an error)."""
    resubmitted: int = 0
    failures: list[str] = field(default_factory=list)
    wake_latencies: list[float] = field(default_factory=list)
    engine_pids: list[int] = field(default_factory=list)
    coordinator_pid: int | None = None
    duration: float = 0.0
    timeline: Timeline | None = None
    """What the front-end saw over time, with ``ClusterConfig.record_timeline``."""

    @property
    def errors(self) -> int:
        return (
            self.coordinator_errors
            + self.frontend_errors
            + self.wave_regressions
            + len(self.engine_failures)
            + len(self.failures)
        )

    @property
    def prefix_hit_rate(self) -> float | None:
        """Hits over queries, summed over the engines' reports; None without queries."""
        queries = sum(self.prefix_queries)
        return sum(self.prefix_hits) / queries if queries else None

    @property
    def ok(self) -> bool:
        """Every planned request sent, every sent request completed (a fault-injection hook
        may send more), no collective timed out, no error counted."""
        return (
            self.requests >= self.planned
            and self.completed == self.requests
            and not self.collective_timeouts
            and self.errors == 0
        )

    def wake_latency_ms(self) -> dict[str, float | int | None]:
        def ms(q: float) -> float | None:
            value = percentile(self.wake_latencies, q)
            return None if math.isnan(value) else round(value * 1000.0, 3)

        return {
            "p50": ms(50),
            "p99": ms(99),
            "max": ms(100),
            "count": len(self.wake_latencies),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "mode": self.mode,
            "engines": self.engines,
            "wake_path": self.wake_path,
            "routing": self.routing,
            "routing_counters": self.routing_counters,
            "prefix_queries": list(self.prefix_queries),
            "prefix_hits": list(self.prefix_hits),
            "prefix_hit_rate": self.prefix_hit_rate,
            "kv_event_batches": self.kv_event_batches,
            "seed": self.seed,
            "requests": self.requests,
            "completed": self.completed,
            "waves": self.waves,
            "errors": self.errors,
            "coordinator_errors": self.coordinator_errors,
            "collective_timeouts": list(self.collective_timeouts),
            "engine_failures": list(self.engine_failures),
            "engine_restarts": list(self.engine_restarts),
            "group_restarts": list(self.group_restarts),
            "coordinator_restarts": list(self.coordinator_restarts),
            "resubmitted": self.resubmitted,
            "failures": list(self.failures),
            "wave_regressions": self.wave_regressions,
            "wave_resets": self.wave_resets,
            "frontend_notifications": self.notifications,
            "pauses": self.pauses,
            "wake_latency_ms": self.wake_latency_ms(),
            "duration_s": round(self.duration, 3),
        }


@dataclass(frozen=True, slots=True)
class Progress:
    """A live view for progress displays."""

    completed: int
    total: int
    sent: int
    wave: int
    running: bool
    engine_pending: tuple[int, ...]
    engine_running: tuple[bool, ...]
    engine_pids: tuple[int, ...] = ()
    """The engine processes by rank (for tools that inject faults)."""
    coordinator_pid: int | None = None
    """The standalone coordinator process."""


def log_to_stderr(line: str) -> None:
    """The runs' default ``log_line``: a child process's stderr line, written to ours."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
