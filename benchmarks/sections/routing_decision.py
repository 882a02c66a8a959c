"""Section ``routing_decision`` (opt-in: ``python -m benchmarks routing_decision``, also the
end of ``routing``): the cost and memory of one prefix decision, ours against vLLM's score
as ``EngineChooser`` computes it and against vLLM 0.33.0's own
``get_core_engine_for_request`` on the same loads, in the same run.

No processes but vLLM's own choice (:mod:`benchmarks.programs.vllm_choice`, in the vLLM
world of ``tests/vllm_reference``).
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

from benchmarks.shared.suite import Row, Suite
from benchmarks.shared.util import REPO_ROOT
from trio_dpcoord import EngineChooser, PrefixRouting, hot_path_build
from trio_dpcoord.protocol import EngineLoad
from trio_dpcoord.sim.cluster_config import percentile

logger = logging.getLogger("benchmarks.routing_decision")

BYTES_PER_BLOCK_BOUND = 250
"""PrefixRouting's documented index cost per remembered block ("about 250 bytes")."""


@dataclass(frozen=True)
class DecisionSizes:
    ranks: tuple[int, ...]
    calls: int
    """Timed decisions per pass."""
    capacity_blocks: int
    """Each rank's bound in the warm index, in 16-token blocks."""


DECISION_QUICK = DecisionSizes(ranks=(8, 64, 256), calls=2_000, capacity_blocks=1024)
DECISION_FULL = DecisionSizes(ranks=(8, 64, 256), calls=10_000, capacity_blocks=1024)


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.getrandbits(15) for _ in range(count)]


DECISION_TARGETS_US: dict[int, tuple[float | None, float | None]] = {
    8: (15.0, 30.0),
    256: (25.0, 60.0),
}
"""The decision's (p50, p99) targets in us by rank count (issue 45)."""
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


def warm_decision(
    ranks: int, capacity_blocks: int, seed: int = 0, chooser: type[EngineChooser] = EngineChooser
) -> WarmDecision:
    """An ``EngineChooser`` (prefix, approximate) whose every rank's index is at its
    bound: documents of 4,096 tokens, one per rank, and fresh filler prompts are routed
    until the indexes are full, then the documents once more (on the ranks the router
    gives them); the index's memory is measured over the filling (tracemalloc)."""
    rng = random.Random(seed)
    docs = [random_tokens(rng, 4096) for _ in range(ranks)]
    loads = [
        EngineLoad(waiting=rng.randrange(4), running=rng.randrange(8), kv_cache_usage=0.3)
        for _ in range(ranks)
    ]
    routing = PrefixRouting(capacity_blocks=capacity_blocks)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ours = chooser(ranks, routing="prefix", prefix_routing=routing)
    now = 0.0
    fill = 0
    router = ours.router
    assert router is not None
    # Until the indexes are at their bound, or stop growing: an index evicts whole pieces
    # of a chain, so it may settle a prompt or two below its bound (at 8 ranks of 1,024
    # blocks, 7,680 of 8,192), and filling on to the bound never ended.
    grown_at, stored = 0, -1
    while router.stored_blocks < ranks * capacity_blocks and fill - grown_at < 4 * ranks:
        # fresh filler prompts fill the indexes; a document now and then keeps them warm
        prompt = docs[fill % ranks] if fill % 4 == 0 else random_tokens(rng, 4096)
        ours.choose(loads, prompt, now=now)
        now += 1e-4
        fill += 1
        if router.stored_blocks > stored:
            grown_at, stored = fill, router.stored_blocks
    memory = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    for doc in docs:  # the documents themselves, on the ranks the router gives them
        ours.choose(loads, doc, now=now)
    return WarmDecision(ours, docs, loads, rng, now, memory)


def pure_twin_chooser(ranks: int, capacity_blocks: int, seed: int = 0) -> EngineChooser | None:
    """On a compiled build, the pure-Python twin's chooser on a warm index of its own (the
    same seed as :func:`warm_decision`'s: the same documents, loads and filling), to run
    beside ours; None on the pure build, where ours is the twin."""
    if hot_path_build() != "compiled":
        return None
    from tests.routing.pure_twin import hot_path

    return warm_decision(ranks, capacity_blocks, seed, hot_path(True).EngineChooser).chooser


def follow_up_prompts(warm: WarmDecision, calls: int) -> list[list[int]]:
    """``calls`` follow-up turns: a document's first 3,840 tokens plus 256 new ones (240
    blocks to match, 16 new), built ahead (their new tokens cold, as a request's are)."""
    docs, rng = warm.docs, warm.rng
    return [docs[rng.randrange(len(docs))][:3840] + random_tokens(rng, 256) for _ in range(calls)]


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
    # the pure-Python twin (on a compiled build), its decisions timed right after ours
    twin = pure_twin_chooser(ranks, capacity_blocks, seed)
    names = ("ours", "deferred", "settle", "vllm", "pure")
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
                if twin is not None:
                    t4 = clock()
                    twin.choose(loads, prompt, now=now)
                    timings["pure"].append((clock() - t4) / 1000)
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
        "pure_us": timed["pure"],
        "stored_blocks": router.stored_blocks,
        "bound_blocks": ranks * capacity_blocks,
        "memory_bytes": warm.memory_bytes,
        "cached_fraction": (counters.cached_tokens - cached_tokens)
        / max(1, counters.prompt_tokens - prompt_tokens),
        "loads": [[load.waiting, load.running, load.kv_cache_usage] for load in loads],
    }


VLLM_CHOICE_RUNNER = REPO_ROOT / "benchmarks" / "programs" / "vllm_choice.py"


def vllm_choice_us(loads: list[list[float]], calls: int, passes: int) -> list[list[float]]:
    """Microseconds of each call of vLLM 0.33.0's own ``get_core_engine_for_request`` on
    ``loads`` (``[waiting, running, kv_cache_usage]`` per engine), a list per pass of
    ``calls`` calls on a fresh client, run in the vLLM world
    (:mod:`benchmarks.programs.vllm_choice`, in the cluster import root of
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


# --- the section's rows ----------------------------------------------------------------


def run_section(suite: Suite) -> None:
    """p50/p99 of one decision (:func:`measure_decision`): ours
    (prefix) against vLLM's score as EngineChooser computes it, and that against
    vLLM 0.33.0's own ``get_core_engine_for_request`` (in the vLLM world), all on the
    same loads in the same run; the index's size and memory against their bounds."""
    sizes = DECISION_QUICK if suite.env.quick else DECISION_FULL
    best = best_percentile
    unavailable = ""
    for fleet_size in sizes.ranks:
        d = measure_decision(fleet_size, sizes.calls, sizes.capacity_blocks)
        if not unavailable:
            try:
                d["vllm_own_us"] = vllm_choice_us(d["loads"], sizes.calls, DECISION_PASSES)
            except RuntimeError as exc:  # vLLM's code cannot run here: ours alone
                unavailable = str(exc)
                logger.warning("routing decision: no vLLM baseline: %s", exc)
        suite.details.setdefault("routing_decision", []).append(
            {k: v for k, v in d.items() if not k.endswith("_us") and k != "loads"}
        )
        section = f"10 routing decision N={fleet_size}"
        shape = "4,096-token prompts, warm index"
        targets = DECISION_TARGETS_US.get(fleet_size, (None, None))
        cached = f"{d['cached_fraction'] * 100:.0f}% of prompt tokens cached"
        build = hot_path_build()
        variants = [
            (
                "ours_us",
                f", store inside the choice, {build} build",
                {
                    q: cached
                    + (
                        f"; pure-Python twin p{q} {best(d['pure_us'], q):.1f} us"
                        if d["pure_us"]
                        else ""
                    )
                    for q in (50, 99)
                },
            )
        ]
        if d["pure_us"]:
            variants.append(("pure_us", ", store inside the choice, pure-Python twin", {}))
        if d["deferred_us"]:
            settle = {q: f"then settle() p{q} {best(d['settle_us'], q):.1f} us" for q in (50, 99)}
            variants.append(("deferred_us", ", store deferred", settle))
        for key, label, notes in variants:
            for q, target_us in zip((50, 99), targets, strict=True):
                target = f"<= {target_us:g} us" if target_us else ""
                value = best(d[key], q)
                suite.rows.append(
                    Row(
                        section,
                        f"choose() p{q}, prefix{label} ({shape})",
                        value,
                        "us",
                        best(d["vllm_us"], q),
                        "vLLM 0.33.0 score (EngineChooser, no prompt)",
                        target,
                        value <= target_us if target_us else None,
                        note=notes.get(q, ""),
                    )
                )
        if "vllm_own_us" in d:
            for q in (50, 99):
                value = best(d["vllm_us"], q)
                own = best(d["vllm_own_us"], q)
                suite.rows.append(
                    Row(
                        section,
                        f"choose() p{q}, vLLM's score (EngineChooser routing=vllm)",
                        value,
                        "us",
                        own,
                        "vLLM 0.33.0 get_core_engine_for_request",
                        "<= 1.5x",
                        value <= 1.5 * own,
                        note="vLLM's own code runs in a process of its own",
                    )
                )
        suite.rows.append(
            Row(
                section,
                "index: blocks remembered",
                float(d["stored_blocks"]),
                "blocks",
                float(d["bound_blocks"]),
                f"bound ({fleet_size} x capacity_blocks)",
                "<= 1.0x",
                d["stored_blocks"] <= d["bound_blocks"],
            )
        )
        bound_bytes = float(d["bound_blocks"] * BYTES_PER_BLOCK_BOUND)
        suite.rows.append(
            Row(
                section,
                "index memory (tracemalloc)",
                d["memory_bytes"] / 2**20,
                "MiB",
                bound_bytes / 2**20,
                f"{BYTES_PER_BLOCK_BOUND} B/block documented",
                "<= 1.0x",
                d["memory_bytes"] <= bound_bytes,
                note=f"{d['memory_bytes'] / max(1, d['stored_blocks']):.0f} B/block",
            )
        )
