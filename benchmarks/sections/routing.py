"""The ``routing`` section's measurements: policies on the lock-step prefix model, and the
cost and memory of one prefix decision (see ``benchmarks/README.md``, section 10).

No processes and no sockets: :func:`trio_dpcoord.sim.routing.run_policy` runs a trace on
the deterministic model of lock-step ranks (:mod:`trio_dpcoord.sim.prefix`), so every
figure is reproducible for its seed. The one exception is the decision's baseline, vLLM's
own engine choice, which runs in a process of the vLLM world (:func:`vllm_choice_us`).
"""

from __future__ import annotations

import json
import logging
import math
import random
import statistics
import subprocess
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trio_dpcoord import EngineChooser, PrefixRouting
from trio_dpcoord.protocol import EngineLoad
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
BYTES_PER_BLOCK_BOUND = 250
"""PrefixRouting's documented index cost per remembered block ("about 250 bytes")."""


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
    decision_ranks: tuple[int, ...]
    decision_calls: int
    decision_capacity_blocks: int


ROUTING_QUICK = RoutingSizes(
    ranks=(8, 64),
    seeds={8: 2, 64: 1},
    sessions_per_rank=8,
    rate_per_rank=600.0,
    capacity_blocks=512,
    decision_ranks=(8, 64, 256),
    decision_calls=2_000,
    decision_capacity_blocks=1024,
)
ROUTING_FULL = RoutingSizes(
    ranks=(8, 64),
    seeds={8: 4, 64: 2},
    sessions_per_rank=16,
    rate_per_rank=600.0,
    capacity_blocks=1024,
    decision_ranks=(8, 64, 256),
    decision_calls=10_000,
    decision_capacity_blocks=1024,
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


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.getrandbits(15) for _ in range(count)]


DECISION_TARGETS_US: dict[int, tuple[float | None, float | None]] = {
    8: (None, 50.0),
    256: (40.0, 100.0),
}
"""The decision's (p50, p99) targets in us by rank count (issue 37)."""
DECISION_PASSES = 5
"""Timed passes over the same prompts on the warm index; each percentile is the lowest
of the passes' (the machine is shared: the fastest pass is the least disturbed)."""


def best_percentile(passes: list[list[float]], q: float) -> float:
    """The lowest of the passes' ``q``-th percentiles (see :data:`DECISION_PASSES`)."""
    return min(percentile(timings, q) for timings in passes)


@dataclass
class WarmDecision:
    """A chooser whose prefix index is at its bound (:func:`warm_decision`)."""

    chooser: EngineChooser
    docs: list[list[int]]
    loads: list[EngineLoad]
    rng: random.Random
    now: float
    memory_bytes: int


def warm_decision(ranks: int, capacity_blocks: int, seed: int = 0) -> WarmDecision:
    """An ``EngineChooser`` (prefix, approximate) whose every rank's index is at its
    bound: documents of 4,096 tokens, one per rank, and fresh filler prompts are routed
    until the indexes are full, then the documents once more (on the ranks the router
    gives them); the index's memory is measured over the filling (tracemalloc)."""
    rng = random.Random(seed)
    docs = [_tokens(rng, 4096) for _ in range(ranks)]
    loads = [
        EngineLoad(waiting=rng.randrange(4), running=rng.randrange(8), kv_cache_usage=0.3)
        for _ in range(ranks)
    ]
    routing = PrefixRouting(capacity_blocks=capacity_blocks)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ours = EngineChooser(ranks, routing="prefix", prefix_routing=routing)
    now = 0.0
    fill = 0
    router = ours.router
    assert router is not None
    while router.stored_blocks < ranks * capacity_blocks and fill < 4 * ranks * capacity_blocks:
        # fresh filler prompts fill the indexes; a document now and then keeps them warm
        prompt = docs[fill % ranks] if fill % 4 == 0 else _tokens(rng, 4096)
        ours.choose(loads, prompt, now=now)
        now += 1e-4
        fill += 1
    memory = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    for doc in docs:  # the documents themselves, on the ranks the router gives them
        ours.choose(loads, doc, now=now)
    return WarmDecision(ours, docs, loads, rng, now, memory)


def follow_up_prompts(warm: WarmDecision, calls: int) -> list[list[int]]:
    """``calls`` follow-up turns: a document's first 3,840 tokens plus 256 new ones (240
    blocks to match, 16 new), built ahead (their new tokens cold, as a request's are)."""
    docs, rng = warm.docs, warm.rng
    return [docs[rng.randrange(len(docs))][:3840] + _tokens(rng, 256) for _ in range(calls)]


def measure_decision(
    ranks: int,
    calls: int,
    capacity_blocks: int,
    seed: int = 0,
    passes: int = DECISION_PASSES,
) -> dict[str, Any]:
    """p50/p99 of ``EngineChooser.choose`` with 4,096-token prompts on a warm index, ours
    (prefix, approximate) and vLLM's score (``routing="vllm"``, same loads), the timings
    of ``passes`` passes each (``ours_us``, ``vllm_us``: a list per pass, see
    :func:`best_percentile`), and the index's memory; ``loads`` is the load table, for
    vLLM's own choice on the same loads (:func:`vllm_choice_us`). Every other decision
    of ours is made with the router's store deferred (``PrefixRouter.defer_store``): its
    ``choose()`` in ``deferred_us``, the ``settle()`` that follows in ``settle_us``
    (the others store before ``choose()`` returns: ``ours_us``).

    Warm: see :func:`warm_decision`; each timed prompt is a follow-up turn
    (:func:`follow_up_prompts`), so the walk is deep. Each pass has prompts of its own
    (new tails), on the router as the previous passes left it.
    """
    warm = warm_decision(ranks, capacity_blocks, seed)
    ours, loads, now = warm.chooser, warm.loads, warm.now
    router = ours.router
    assert router is not None
    names = ("ours", "deferred", "settle", "vllm")
    timed: dict[str, list[list[float]]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    counters = router.counters
    prompt_tokens, cached_tokens = counters.prompt_tokens, counters.cached_tokens
    can_defer = hasattr(router, "settle")  # (an older trio_dpcoord, for comparisons)
    settle = getattr(router, "settle", lambda: None)
    for _ in range(passes):
        prompts = follow_up_prompts(warm, calls)
        base = EngineChooser(ranks)
        timings: dict[str, list[float]] = {name: [] for name in names}
        for number, prompt in enumerate(prompts):
            # every other decision with the store deferred, settle() timed apart
            deferring = can_defer and bool(number % 2)
            router.defer_store = deferring
            t0 = clock()
            ours.choose(loads, prompt, now=now)
            t1 = clock()
            settle()
            t2 = clock()
            base.choose(loads, prompt, now=now)
            t3 = clock()
            if deferring:
                timings["deferred"].append((t1 - t0) / 1000)
                timings["settle"].append((t2 - t1) / 1000)
            else:
                timings["ours"].append((t1 - t0) / 1000)
            timings["vllm"].append((t3 - t2) / 1000)
            now += 1e-4
        for name, values in timings.items():
            if values:
                timed[name].append(values)
    router.defer_store = False
    return {
        "ranks": ranks,
        "ours_us": timed["ours"],
        "deferred_us": timed["deferred"],
        "settle_us": timed["settle"],
        "vllm_us": timed["vllm"],
        "stored_blocks": router.stored_blocks,
        "bound_blocks": ranks * capacity_blocks,
        "memory_bytes": warm.memory_bytes,
        "cached_fraction": (counters.cached_tokens - cached_tokens)
        / max(1, counters.prompt_tokens - prompt_tokens),
        "loads": [[load.waiting, load.running, load.kv_cache_usage] for load in loads],
    }


VLLM_CHOICE_RUNNER = Path(__file__).resolve().parent / "_vllm_choice.py"


def vllm_choice_us(loads: list[list[float]], calls: int, passes: int) -> list[list[float]]:
    """Microseconds of each call of vLLM 0.33.0's own ``get_core_engine_for_request`` on
    ``loads`` (``[waiting, running, kv_cache_usage]`` per engine), a list per pass of
    ``calls`` calls on a fresh client, run in the vLLM world
    (:mod:`benchmarks._vllm_choice`, in the cluster import root of
    ``tests/vllm_reference``, whose wheel is fetched into the ignored cache on first
    use). Raises ``RuntimeError`` when vLLM's code cannot be run here."""
    try:
        from tests.vllm_reference import VllmUnavailable, runner_command, vllm_env
        from tests.vllm_reference.dp_cluster import prepare_cluster_root
    except ImportError as exc:
        raise RuntimeError(f"tests/vllm_reference cannot be imported: {exc}") from exc
    try:
        root = prepare_cluster_root()
    except (VllmUnavailable, OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"vLLM 0.33.0 unavailable: {exc}") from exc
    result = subprocess.run(
        runner_command(VLLM_CHOICE_RUNNER, str(calls), str(passes)),
        input=json.dumps(loads),
        env=vllm_env(root),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM choice runner failed: {result.stderr[-500:]}")
    timings: list[list[float]] = json.loads(lines[-1])["us"]
    return timings
