"""The ``routing_fleet`` section: engine-choice policies on the process fleet, with the
engines' own prefix-cache counters, next to the lock-step model on the same trace (see
``benchmarks/README.md``, section 10).

Each (trace, policy) is one :func:`trio_dpcoord.sim.run_cluster`: an embedded coordinator,
the simulated front-end and 8 ``python -m trio_dpcoord.sim engine`` processes with real
sockets, each with a prefix cache (``EngineConfig.prefix_cache_blocks``) and the lock-step
model's step cost (``a + b * tokens``, :data:`~trio_dpcoord.sim.prefix.STEP_FIXED_S` and
:data:`~trio_dpcoord.sim.prefix.STEP_PER_TOKEN_S`). The trace is replayed on the wall
clock at its arrival times. The hit rate is what the engines report in their scheduler
stats (vLLM's ``prefix_cache_stats``: hits over queries, in prompt tokens), not what the
router believes. Round-robin pins request ``k`` to rank ``k mod 8``; the exact feed gets
the engines' KV events over ZeroMQ.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import trio

from benchmarks.sections import routing as rt
from benchmarks.shared.suite import SPEED_FIGURES, Row, Suite
from trio_dpcoord.sim import ClusterConfig, LoadPlan, run_cluster
from trio_dpcoord.sim.cluster_config import percentile
from trio_dpcoord.sim.frontend import SimFrontend
from trio_dpcoord.sim.prefix import STEP_FIXED_S, STEP_PER_TOKEN_S
from trio_dpcoord.sim.traces import Request, reuse_bound

logger = logging.getLogger("benchmarks.routing_fleet")

FLEET_RANKS = 8
FLEET_POLICIES = ("round-robin", "vllm", "approximate", "exact")


@dataclass(frozen=True)
class FleetSizes:
    traces: tuple[tuple[str, float], ...]
    """(trace name, offered requests/s per rank): the model benchmark's 600 saturates
    the fleet (the whole trace arrives in 80 ms, before most load reports); 100 spreads
    the arrivals over about a second, so the routing follows the engines' reports."""
    seeds: int
    repeats: int
    """Runs of every (trace, seed, policy): the fleet's figures carry the machine's noise
    (the model's do not); the policies take turns, so noise falls on all of them."""
    trace_sizes: rt.RoutingSizes
    """The model benchmark's sizes the traces are made with (and the caches' size)."""
    token_budget: int = 2048
    """Tokens per engine step: the model's default ``token_budget``."""


FLEET_QUICK = FleetSizes(
    traces=(("multi-turn", 600.0), ("multi-turn", 100.0), ("no reuse", 600.0)),
    seeds=1,
    repeats=3,
    trace_sizes=rt.ROUTING_QUICK,
)
FLEET_FULL = FleetSizes(
    traces=(
        ("multi-turn", 600.0),
        ("multi-turn", 100.0),
        ("shared docs", 600.0),
        ("no reuse", 600.0),
        ("no reuse", 100.0),
    ),
    seeds=2,
    repeats=3,
    trace_sizes=rt.ROUTING_QUICK,
)


def trace_label(name: str, rate_per_rank: float) -> str:
    return f"{name} @{rate_per_rank:g}/s/rank"


@dataclass(frozen=True)
class FleetFigures:
    """One (trace, policy) on the process fleet."""

    hit_rate: float
    """The engines' reported prefix-cache hits over queries (prompt tokens)."""
    throughput: float
    """Output tokens per second of wall clock, from the first arrival to the last finish."""
    ttft_p50_s: float
    ttft_p99_s: float
    busiest_over_mean: float
    """Per rank, its work over the run (uncached prompt tokens plus output tokens, from
    the engines' reports): the busiest rank's over the mean."""
    requests: int
    completed: int
    ok: bool
    kv_event_batches: int
    guard_fallbacks: int


class _Replay:
    """Sends a trace at its arrival times and records each request's time to first token."""

    def __init__(self, trace: list[Request], pin_round_robin: int | None) -> None:
        self.trace = sorted(trace, key=lambda r: r.arrival_s)
        self.pin_round_robin = pin_round_robin
        self.ttft_s: list[float] = []
        self.makespan_s = 0.0

    def _listener(self, due: float) -> Callable[[tuple[int, ...], int | None], None]:
        first = True

        def on_output(tokens: tuple[int, ...], finish: int | None) -> None:
            nonlocal first
            if first and tokens:
                first = False
                self.ttft_s.append(trio.current_time() - due)

        return on_output

    async def __call__(self, frontend: SimFrontend) -> None:
        start = trio.current_time()
        for index, request in enumerate(self.trace):
            due = start + request.arrival_s
            await trio.sleep_until(due)
            pinned = None if self.pin_round_robin is None else index % self.pin_round_robin
            await frontend.submit(
                max_tokens=request.output_len,
                engine=pinned,
                on_output=self._listener(due),
                prompt_token_ids=request.token_ids,
            )
        await frontend.wait_for(lambda f: f.pending == 0)
        self.makespan_s = trio.current_time() - start


def run_fleet_policy(
    trace: list[Request], policy: str, sizes: FleetSizes, ranks: int = FLEET_RANKS
) -> FleetFigures:
    """One policy of :data:`FLEET_POLICIES` on the process fleet, a fresh cluster."""
    if policy not in FLEET_POLICIES:
        raise ValueError(f"policy must be one of {FLEET_POLICIES}, got {policy!r}")
    config = ClusterConfig(
        engines=ranks,
        load=LoadPlan(requests=len(trace)),
        routing="prefix" if policy in ("approximate", "exact") else "vllm",
        kv_events=policy == "exact",
        prefix_cache_blocks=sizes.trace_sizes.capacity_blocks,
        token_budget=sizes.token_budget,
        step_time=STEP_FIXED_S,
        step_per_token=STEP_PER_TOKEN_S,
        max_running=len(trace),  # the model has no cap on running requests, only the budget
        engine_log_level="ERROR",
        collective_timeout=30.0,
    )
    replay = _Replay(trace, ranks if policy == "round-robin" else None)
    report = trio.run(
        functools.partial(
            run_cluster, config, drive=replay, log_line=lambda line: logger.warning("%s", line)
        )
    )
    work = [
        queries - hits + tokens
        for queries, hits, tokens in zip(
            report.prefix_queries, report.prefix_hits, report.engine_tokens, strict=True
        )
    ]
    mean_work = sum(work) / len(work) if work else 0.0
    counters = report.routing_counters or {}
    return FleetFigures(
        hit_rate=report.prefix_hit_rate or 0.0,
        throughput=sum(report.engine_tokens) / replay.makespan_s if replay.makespan_s else 0.0,
        ttft_p50_s=percentile(replay.ttft_s, 50),
        ttft_p99_s=percentile(replay.ttft_s, 99),
        busiest_over_mean=max(work) / mean_work if mean_work else 1.0,
        requests=report.requests,
        completed=report.completed,
        ok=report.ok,
        kv_event_batches=report.kv_event_batches,
        guard_fallbacks=int(counters.get("guard_fallbacks", 0)),
    )


def mean_over(
    entries: list[dict[str, Any]], policy: str, attr: str, scale: float, key: str = "fleet"
) -> float:
    """The mean of one figure of ``policy`` over ``entries`` and their runs (``key``:
    "fleet" or "model")."""
    return rt.mean([getattr(f, attr) * scale for e in entries for f in e[key][policy]])


def ratio_range(
    entries: list[dict[str, Any]], policy: str, attr: str, base: str = "vllm"
) -> tuple[float, float]:
    """The lowest and highest ratio of ``policy``'s figure to ``base``'s in the same
    (trace, seed, run): how much of a mean ratio is the machine's noise."""
    ratios = [
        getattr(ours, attr) / getattr(theirs, attr)
        for e in entries
        for ours, theirs in zip(e["fleet"][policy], e["fleet"][base], strict=True)
        if getattr(theirs, attr)
    ]
    return (min(ratios), max(ratios)) if ratios else (math.nan, math.nan)


RANKING_TOLERANCE = 0.05
"""Figures within 5 % of each other rank as a tie: run-to-run noise on the shared
machine moves the fleet's throughput by about that much (the model has no noise)."""


def ranking(figures: dict[str, float], tolerance: float = RANKING_TOLERANCE) -> str:
    """Policies from the best to the worst by one figure (higher is better), as
    ``"a = b > c"``: a policy within ``tolerance`` of its group's best joins the group."""
    groups: list[list[str]] = []
    best = 0.0
    for name in sorted(figures, key=lambda n: -figures[n]):
        if groups and figures[name] >= best * (1.0 - tolerance):
            groups[-1].append(name)
        else:
            groups.append([name])
            best = figures[name]
    return " > ".join(" = ".join(sorted(group)) for group in groups)


def measure_fleet(
    sizes: FleetSizes, progress: Callable[[str], None] = logger.info
) -> list[dict[str, Any]]:
    """Every (trace, seed): each policy on the fleet (``repeats`` runs) and on the model,
    and the reuse bound.

    One entry per (trace, seed): ``{"trace", "seed", "bound", "fleet": {policy:
    [FleetFigures per run]}, "model": {policy: [rt.PolicyFigures]}}``.
    """
    out: list[dict[str, Any]] = []
    model_cost: dict[str, Any] = {
        "token_budget": sizes.token_budget,
        "step_fixed_s": STEP_FIXED_S,
        "step_per_token_s": STEP_PER_TOKEN_S,
    }
    capacity = sizes.trace_sizes.capacity_blocks
    for trace_name, rate in sizes.traces:
        label = trace_label(trace_name, rate)
        trace_sizes = replace(sizes.trace_sizes, rate_per_rank=rate)
        for seed in range(sizes.seeds):
            trace = rt.make_trace(trace_name, seed, FLEET_RANKS, trace_sizes)
            entry: dict[str, Any] = {
                "trace": label,
                "seed": seed,
                "bound": reuse_bound(trace),
                "fleet": {},
                "model": {},
            }
            for policy in FLEET_POLICIES:
                entry["fleet"][policy] = []
                entry["model"][policy] = [
                    rt.run_one(trace, FLEET_RANKS, policy, capacity, **model_cost)
                ]
            for run in range(sizes.repeats):
                for policy in FLEET_POLICIES:
                    started = time.perf_counter()
                    fleet = run_fleet_policy(trace, policy, sizes)
                    entry["fleet"][policy].append(fleet)
                    progress(
                        f"routing fleet: {label}, seed {seed}, run {run}, {policy}: "
                        f"engines' hit rate {fleet.hit_rate:.3f}, busiest/mean "
                        f"{fleet.busiest_over_mean:.2f}, {fleet.completed}/{fleet.requests} "
                        f"requests, {time.perf_counter() - started:.1f} s"
                    )
            out.append(entry)
    return out


# --- the section's rows ----------------------------------------------------------------


def run_section(suite: Suite) -> None:
    """Engine-choice policies on the process fleet (8 simulated engines with prefix
    caches, real sockets), the hit rate as the engines report it, as ratios to vLLM
    0.33.0's score in the same run, beside the lock-step model on the same trace
    (this module)."""
    sizes = FLEET_QUICK if suite.env.quick else FLEET_FULL
    entries = measure_fleet(sizes)
    suite.details["routing_fleet"] = [
        {
            **{k: v for k, v in e.items() if k not in ("fleet", "model")},
            "fleet": {p: [asdict(f) for f in runs] for p, runs in e["fleet"].items()},
            "model": {p: [asdict(f) for f in runs] for p, runs in e["model"].items()},
        }
        for e in entries
    ]
    base_label = rt.POLICY_LABELS["vllm"]
    fields = (
        ("engines' hit rate", "hit_rate", "%", 100.0),
        *SPEED_FIGURES,
        ("busiest/mean work (run)", "busiest_over_mean", "", 1.0),
    )
    for name, rate in sizes.traces:
        trace = trace_label(name, rate)
        cells = [e for e in entries if e["trace"] == trace]
        section = f"10 routing fleet N={FLEET_RANKS}"
        bound = rt.mean([e["bound"] for e in cells]) * 100
        fleet_mean = functools.partial(mean_over, cells)

        for policy in ("round-robin", "approximate", "exact"):
            label = rt.POLICY_LABELS[policy]
            done = sum(f.completed for e in cells for f in e["fleet"][policy])
            sent = sum(f.requests for e in cells for f in e["fleet"][policy])
            for figure, attr, unit, scale in fields:
                low, high = ratio_range(cells, policy, attr)
                note = f"{len(cells) * sizes.repeats} runs, ratio {low:.2f}..{high:.2f}"
                if attr == "hit_rate":
                    note += f", reuse bound {bound:.1f} %, {done}/{sent} requests"
                elif attr == "busiest_over_mean":
                    worst = max(f.busiest_over_mean for e in cells for f in e["fleet"][policy])
                    note += f", worst run {worst:.2f}"
                suite.rows.append(
                    Row(
                        section,
                        f"{trace}: {label}, {figure}",
                        fleet_mean(policy, attr, scale),
                        unit,
                        fleet_mean("vllm", attr, scale),
                        base_label,
                        note=note,
                    )
                )
            for figure, attr, unit, scale in (fields[0], fields[1], fields[3]):
                model_figure = "hit rate" if attr == "hit_rate" else figure
                suite.rows.append(
                    Row(
                        section,
                        f"{trace}: {label}, model's {model_figure}",
                        fleet_mean(policy, attr, scale, "model"),
                        unit,
                        fleet_mean("vllm", attr, scale, "model"),
                        f"{base_label} (model)",
                    )
                )
        for figure, attr, sign in (
            ("hit rate", "hit_rate", 1),
            ("throughput", "throughput", 1),
            ("TTFT p99 (lower first)", "ttft_p99_s", -1),
        ):
            orders = {
                key: ranking({p: fleet_mean(p, attr, 1.0, key) ** sign for p in FLEET_POLICIES})
                for key in ("fleet", "model")
            }
            same = orders["fleet"] == orders["model"]
            suite.rows.append(
                Row(
                    section,
                    f"{trace}: ranking by {figure}, fleet vs model",
                    None,
                    "",
                    note=f"fleet {orders['fleet']}; model {orders['model']}: "
                    f"{'same' if same else 'DIFFERENT'} (ties within "
                    f"{RANKING_TOLERANCE:.0%})",
                )
            )
