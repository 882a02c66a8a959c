"""The ``routing`` section's measurements: policies on the lock-step prefix model, and the
cost and memory of one prefix decision (see ``benchmarks/README.md``, section 10).

No processes and no sockets: :func:`trio_dpcoord.sim.routing.run_policy` runs a trace on
the deterministic model of lock-step ranks (:mod:`trio_dpcoord.sim.prefix`), so every
figure is reproducible for its seed. The one exception is the decision's baseline, vLLM's
own engine choice, which runs in a process of the vLLM world (:func:`vllm_choice_us`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks.sections import routing_decision
from benchmarks.shared.suite import SPEED_FIGURES, Row, Suite
from trio_dpcoord import PrefixRouting
from trio_dpcoord.sim.cluster_config import percentile
from trio_dpcoord.sim.prefix import STEP_PER_TOKEN_S
from trio_dpcoord.sim.routing import POLICIES, make_policy, run_policy
from trio_dpcoord.sim.traces import (
    Request,
    multi_turn_chat,
    no_reuse,
    reuse_bound,
    shared_documents,
)

logger = logging.getLogger("benchmarks.routing")

TRACES = ("multi-turn", "shared docs", "no reuse")
POLICY_LABELS = {
    "round-robin": "round-robin",
    "vllm": "vLLM 0.33.0 score",
    "approximate": "ours approximate",
    "exact": "ours exact",
}


@dataclass(frozen=True)
class RoutingSizes:
    ranks: tuple[int, ...]
    seeds: dict[int, int]
    """Seeds per rank count (the larger fleets take longer per run)."""
    sessions_per_rank: int
    """Multi-turn: sessions per rank (6 turns each); the other traces send 6x as many
    requests per rank, so every trace has the same number of requests."""
    rate_per_rank: float
    """Offered requests/s per rank: above what the fleet serves without prefix hits, so
    the makespan, hence throughput, measures the fleet's capacity, not the arrivals."""
    capacity_blocks: int
    """Each rank's prefix cache (and the router's per-rank bound), in 16-token blocks."""


ROUTING_QUICK = RoutingSizes(
    ranks=(8, 64),
    seeds={8: 2, 64: 1},
    sessions_per_rank=8,
    rate_per_rank=600.0,
    capacity_blocks=512,
)
ROUTING_FULL = RoutingSizes(
    ranks=(8, 64),
    seeds={8: 4, 64: 2},
    sessions_per_rank=16,
    rate_per_rank=600.0,
    capacity_blocks=1024,
)


def make_trace(name: str, seed: int, ranks: int, sizes: RoutingSizes) -> list[Request]:
    """One of :data:`TRACES`, scaled to ``ranks``, with the same number of requests."""
    spr = sizes.sessions_per_rank
    rate = sizes.rate_per_rank * ranks
    if name == "multi-turn":
        # ~1,660 tokens (104 blocks) per session by its 6th turn: 16 sessions a rank
        # are ~1,660 blocks, more than a rank's cache.
        return multi_turn_chat(seed, sessions=spr * ranks, turns=6, rate_per_s=rate)
    if name == "shared docs":
        # 4,096-token documents, ranks/2 of them (at least 4): 256 blocks each.
        return shared_documents(
            seed, users=6 * spr * ranks, documents=max(4, ranks // 2), rate_per_s=rate
        )
    if name == "no reuse":
        return no_reuse(seed, requests=6 * spr * ranks, rate_per_s=rate)
    raise ValueError(f"unknown trace {name!r}")


@dataclass(frozen=True)
class PolicyFigures:
    hit_rate: float
    throughput: float
    """Output tokens per second of model time."""
    ttft_p50_s: float
    ttft_p99_s: float
    busiest_over_mean: float
    busiest_tokens: float
    """The busiest rank's tokens summed over the steps (the lock-step cost)."""
    guard_fallbacks: int
    prefill_share: float
    """Share of the run's step time spent on prompt tokens (the model's tally)."""


def run_one(
    trace: list[Request],
    ranks: int,
    policy_name: str,
    capacity_blocks: int,
    prefix: PrefixRouting | None = None,
    **model: Any,
) -> PolicyFigures:
    """One policy on one trace on the model (``prefix``: our policies' settings other
    than the feed and the sizes; ``model``: ``run_fleet``'s cost parameters)."""
    policy = make_policy(policy_name, ranks, capacity_blocks, prefix=prefix)
    result = run_policy(trace, ranks, policy, capacity_blocks, **model)
    chooser = getattr(policy, "chooser", None)
    counters = chooser.statistics().router if chooser is not None else None
    return PolicyFigures(
        hit_rate=result.hit_rate,
        throughput=result.throughput_tokens_per_s,
        ttft_p50_s=percentile(result.ttft_s, 50),
        ttft_p99_s=percentile(result.ttft_s, 99),
        busiest_over_mean=result.busiest_over_mean,
        busiest_tokens=result.busiest_tokens,
        guard_fallbacks=counters.guard_fallbacks if counters else 0,
        prefill_share=result.prefill_time_share,
    )


def measure_policies(
    sizes: RoutingSizes, progress: Callable[[str], None] = logger.info
) -> dict[str, Any]:
    """Every (ranks, trace, seed, policy): its figures, and each trace's reuse bound.

    Returns ``{ranks: {trace: {"bound": [per seed], policy: [PolicyFigures per seed]}}}``.
    """
    out: dict[str, Any] = {}
    for ranks in sizes.ranks:
        by_trace: dict[str, Any] = {}
        for trace_name in TRACES:
            cell: dict[str, Any] = {"bound": []}
            for name in POLICIES:
                cell[name] = []
            for seed in range(sizes.seeds[ranks]):
                trace = make_trace(trace_name, seed, ranks, sizes)
                cell["bound"].append(reuse_bound(trace))
                for policy_name in POLICIES:
                    started = time.perf_counter()
                    figures = run_one(trace, ranks, policy_name, sizes.capacity_blocks)
                    cell[policy_name].append(figures)
                    progress(
                        f"routing: {ranks} ranks, {trace_name}, seed {seed}, {policy_name}: "
                        f"hit {figures.hit_rate:.3f}, {time.perf_counter() - started:.1f} s"
                    )
            by_trace[trace_name] = cell
        out[str(ranks)] = by_trace
    return out


PREFILL_SWEEP_PER_TOKEN_S = (1e-6, 5e-6, 2e-5, 1e-4)
"""The sweep's per-token step cost ``b`` (the model's default ``STEP_PER_TOKEN_S`` is
2e-5 s): with the fixed 5 ms a step, prompt tokens take from a few percent to most of
the step time."""
SWEEP_RANKS = 8
SWEEP_TRACES = ("multi-turn", "no reuse")
SWEEP_POLICIES = ("vllm", "approximate", "exact")


def measure_prefill_sweep(
    sizes: RoutingSizes, progress: Callable[[str], None] = logger.info
) -> list[dict[str, Any]]:
    """The policies at :data:`SWEEP_RANKS` ranks under every per-token cost of
    :data:`PREFILL_SWEEP_PER_TOKEN_S`: where prefix affinity pays, and where it cannot.

    The offered rate grows as the per-token cost shrinks (``rate_per_rank x STEP_PER_TOKEN_S / b``,
    never less than ``rate_per_rank``), so the fleet stays saturated and throughput
    measures its capacity, not the arrivals. One entry per (cost, trace):
    ``{"step_per_token_s", "trace", policy: [PolicyFigures per seed]}``.
    """
    out: list[dict[str, Any]] = []
    for per_token_s in PREFILL_SWEEP_PER_TOKEN_S:
        scaled = replace(
            sizes, rate_per_rank=sizes.rate_per_rank * max(1.0, STEP_PER_TOKEN_S / per_token_s)
        )
        for trace_name in SWEEP_TRACES:
            entry: dict[str, Any] = {"step_per_token_s": per_token_s, "trace": trace_name}
            for seed in range(sizes.seeds[SWEEP_RANKS]):
                trace = make_trace(trace_name, seed, SWEEP_RANKS, scaled)
                for policy_name in SWEEP_POLICIES:
                    figures = run_one(
                        trace,
                        SWEEP_RANKS,
                        policy_name,
                        sizes.capacity_blocks,
                        step_per_token_s=per_token_s,
                    )
                    entry.setdefault(policy_name, []).append(figures)
            progress(f"routing sweep: b = {per_token_s:g} s/token, {trace_name} done")
            out.append(entry)
    return out


GUARD_SETTINGS: tuple[tuple[float, float], ...] = (
    (math.inf, 3.0),
    (32768.0, 2.0),
    (8192.0, 3.0),
    (4096.0, 3.0),
    (4096.0, 2.0),
    (2048.0, 1.5),
)
"""The guard sweep's (``imbalance_abs``, ``imbalance_rel``): never, SGLang's 32,768
tokens and 2x, and tighter down to 2,048 tokens and 1.5x. The default is 4,096 and 3x."""
GUARD_SWEEP_TRACES = ("multi-turn", "shared docs")
"""With no reuse every policy is the least loaded one, whatever the guard."""


def measure_guard_sweep(
    sizes: RoutingSizes, progress: Callable[[str], None] = logger.info
) -> list[dict[str, Any]]:
    """Ours (approximate) under every guard setting of :data:`GUARD_SETTINGS`, on the
    same traces and fleets as :func:`measure_policies`, beside vLLM's score: how the
    default thresholds were chosen. One entry per (ranks, trace, setting):
    ``{"ranks", "trace", "imbalance_abs", "imbalance_rel", "ours": [PolicyFigures per
    seed], "vllm": [PolicyFigures per seed]}``.
    """
    out: list[dict[str, Any]] = []
    for ranks in sizes.ranks:
        for trace_name in GUARD_SWEEP_TRACES:
            traces = [
                make_trace(trace_name, seed, ranks, sizes) for seed in range(sizes.seeds[ranks])
            ]
            baseline = [run_one(t, ranks, "vllm", sizes.capacity_blocks) for t in traces]
            for absolute, relative in GUARD_SETTINGS:
                settings = PrefixRouting(imbalance_abs=absolute, imbalance_rel=relative)
                ours = [
                    run_one(t, ranks, "approximate", sizes.capacity_blocks, prefix=settings)
                    for t in traces
                ]
                out.append(
                    {
                        "ranks": ranks,
                        "trace": trace_name,
                        "imbalance_abs": absolute,
                        "imbalance_rel": relative,
                        "ours": ours,
                        "vllm": baseline,
                    }
                )
            progress(f"routing guard sweep: {ranks} ranks, {trace_name} done")
    return out


def mean(values: list[float]) -> float:
    return statistics.fmean(values)


# --- the section's rows ----------------------------------------------------------------


def run_section(suite: Suite) -> None:
    """Engine-choice policies on the lock-step prefix model, as ratios to vLLM 0.33.0's
    score in the same run, then the prefix decision's cost and memory
    (:mod:`benchmarks.sections.routing_decision`)."""
    sizes = ROUTING_QUICK if suite.env.quick else ROUTING_FULL
    figures = measure_policies(sizes)
    suite.details["routing"] = {
        ranks: {
            trace: {
                key: [asdict(f) if not isinstance(f, float) else f for f in values]
                for key, values in cell.items()
            }
            for trace, cell in by_trace.items()
        }
        for ranks, by_trace in figures.items()
    }
    base_label = POLICY_LABELS["vllm"]
    targets: dict[tuple[str, str], tuple[str, Callable[[float], bool] | None]] = {
        ("multi-turn", "hit rate"): (">= 2x", lambda r: r >= 2.0),
        ("multi-turn", "throughput"): (">= 1.5x", lambda r: r >= 1.5),
        ("multi-turn", "TTFT p99"): ("<= 0.5x", lambda r: r <= 0.5),
        ("no reuse", "throughput"): (">= 0.98x", lambda r: r >= 0.98),
        ("no reuse", "busiest/mean work per step"): ("<= 1.0x", lambda r: r <= 1.0 + 1e-9),
    }
    fields = (
        ("hit rate", "hit_rate", "%", 100.0),
        *SPEED_FIGURES,
        ("busiest/mean work per step", "busiest_over_mean", "", 1.0),
        ("busiest-rank work, whole run", "busiest_tokens", "tokens", 1.0),
    )
    for ranks, by_trace in figures.items():
        seeds = sizes.seeds[int(ranks)]
        for trace, cell in by_trace.items():
            section = f"10 routing N={ranks}"
            bound = mean(cell["bound"]) * 100
            for policy in ("round-robin", "approximate", "exact"):
                label = POLICY_LABELS[policy]
                for figure, attr, unit, scale in fields:
                    if policy == "round-robin" and figure not in ("hit rate", "throughput"):
                        continue
                    ours = [getattr(f, attr) * scale for f in cell[policy]]
                    base = [getattr(f, attr) * scale for f in cell["vllm"]]
                    ratios = [o / b for o, b in zip(ours, base, strict=True) if b]
                    target, check = targets.get((trace, figure), ("", None))
                    value, baseline = mean(ours), mean(base)
                    met = None
                    if check is not None and policy != "round-robin" and baseline:
                        met = check(value / baseline)
                    note = f"{seeds} seeds"
                    if len(ratios) > 1:
                        note += f", ratio {min(ratios):.2f}..{max(ratios):.2f}"
                    if figure == "hit rate" and policy != "round-robin":
                        fallbacks = sum(f.guard_fallbacks for f in cell[policy])
                        note += f", guard fallbacks {fallbacks / seeds:.0f}/run"
                    suite.rows.append(
                        Row(
                            section,
                            f"{trace}: {label}, {figure}",
                            value,
                            unit,
                            baseline,
                            base_label,
                            "" if policy == "round-robin" else target,
                            met,
                            note=note,
                        )
                    )
                if policy != "round-robin" and bound > 0:
                    hit = mean([f.hit_rate for f in cell[policy]]) * 100
                    wants = trace == "multi-turn"
                    suite.rows.append(
                        Row(
                            section,
                            f"{trace}: {label}, hit rate vs reuse bound",
                            hit,
                            "%",
                            bound,
                            "reuse bound",
                            ">= 0.9x" if wants else "",
                            hit / bound >= 0.9 if wants else None,
                        )
                    )
    _routing_sweep(suite, sizes, base_label)
    _routing_guard_sweep(suite, sizes, base_label)
    routing_decision.run_section(suite)


def _routing_sweep(suite: Suite, sizes: RoutingSizes, base_label: str) -> None:
    """The prefill-share sweep: the same policies as the per-token cost ``b`` grows
    (benchmarks/sections/routing.py ``measure_prefill_sweep``), as ratios to vLLM's score."""
    sweep = measure_prefill_sweep(sizes)
    suite.details["routing_sweep"] = [
        {k: v if not isinstance(v, list) else [asdict(f) for f in v] for k, v in e.items()}
        for e in sweep
    ]
    for entry in sweep:
        per_token_us = entry["step_per_token_s"] * 1e6
        section = f"10 routing sweep N={SWEEP_RANKS} b={per_token_us:g}us/token"
        share = mean([f.prefill_share for f in entry["vllm"]]) * 100
        for policy in ("approximate", "exact"):
            _figure_rows(
                suite,
                section,
                f"{entry['trace']}: {POLICY_LABELS[policy]}",
                entry[policy],
                entry["vllm"],
                base_label,
                _SWEEP_FIGURES,
                f"prompt tokens {share:.0f}% of step time under vLLM's score",
            )


def _figure_rows(
    suite: Suite,
    section: str,
    label: str,
    ours: list[Any],
    base: list[Any],
    base_label: str,
    figures: tuple[tuple[str, str, str, float], ...],
    note: str,
) -> None:
    """One row per figure: ours and the baseline's means over the seeds
    (``figures``: name, ``PolicyFigures`` attribute, unit, scale)."""
    for figure, attr, unit, scale in figures:
        suite.rows.append(
            Row(
                section,
                f"{label}, {figure}",
                mean([getattr(f, attr) * scale for f in ours]),
                unit,
                mean([getattr(f, attr) * scale for f in base]),
                base_label,
                "",
                None,
                note=note,
            )
        )


def _routing_guard_sweep(suite: Suite, sizes: RoutingSizes, base_label: str) -> None:
    """Ours (approximate) under each guard setting (benchmarks/sections/routing.py
    ``measure_guard_sweep``), as ratios to vLLM's score: the default's evidence."""
    sweep = measure_guard_sweep(sizes)
    suite.details["routing_guard_sweep"] = [
        {k: v if not isinstance(v, list) else [asdict(f) for f in v] for k, v in e.items()}
        for e in sweep
    ]
    for entry in sweep:
        section = f"10 routing guard N={entry['ranks']}"
        setting = f"abs {entry['imbalance_abs']:g} rel {entry['imbalance_rel']:g}"
        fallbacks = mean([float(f.guard_fallbacks) for f in entry["ours"]])
        _figure_rows(
            suite,
            section,
            f"{entry['trace']}: ours approximate, {setting}",
            entry["ours"],
            entry["vllm"],
            base_label,
            _SWEEP_FIGURES[1:],
            f"guard fallbacks {fallbacks:.0f}/run",
        )


_SWEEP_FIGURES = (
    ("hit rate", "hit_rate", "%", 100.0),
    ("throughput", "throughput", "tok/s", 1.0),
    ("TTFT p99", "ttft_p99_s", "ms", 1000.0),
    ("busiest/mean work per step", "busiest_over_mean", "", 1.0),
)
"""The sweeps' figures (name, ``PolicyFigures`` attribute, unit, scale)."""
