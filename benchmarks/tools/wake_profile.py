"""Where a wave's CPU goes: ``python -m benchmarks.tools.wake_profile``.

The wake section's standalone measurement (N engines played by :class:`WakeProbe`,
engine 0's ``start_wave``, START_DP_WAVE to all, ``wave_complete``, a 1 ms gap) against
several subjects, in alternated chunks as :func:`benchmarks.shared.scenarios.wake_compare`
does, with the CPU per wave split by thread (the trio or main thread, libzmq's I/O
thread, the rest), and three optional readings of what each wave costs:

- ``--strace``: after the timed chunks, ``strace -c -f`` attached to each subject for
  ``--traced`` waves: system calls per wave, by name (strace's own cost makes its times
  meaningless: counts only);
- ``--cprofile DIR``: the Python subjects (``standalone``, ``trio-floor``,
  ``trio-floor-raw``) run under ``python -m cProfile`` for the same chunks (their CPU
  figures then include cProfile's cost); each subject's calls per wave of trio's run
  loop pieces (task steps are ``Context.run``, waits on the kernel ``epoll.poll``,
  registrations ``epoll.modify``), of the shim and of pyzmq, and its top functions;
- ``--perf``: ``perf stat`` attached to each subject for ``--traced`` waves: context
  switches, page faults and task-clock per wave.

Subjects: ``standalone`` (``trio-dpcoord serve``), ``standalone-pure`` (its pure twins),
``trio-floor`` and ``trio-floor-raw`` (the card's shape alone:
:mod:`benchmarks.programs.procs`), ``vllm`` (vLLM 0.33.0's ``DPCoordinatorProc``,
tests/vllm_reference). Run one tree against another by running this tool in each
checkout (``PYTHONPATH`` at it); only ratios within one run compare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.shared import scenarios as sc
from benchmarks.shared.util import Child, procs, spawn, summarize_us
from benchmarks.shared.wake_probe import WakeProbe
from trio_dpcoord.testing import serve_command

PYTHON_SUBJECTS = (sc.STANDALONE, sc.STANDALONE_PURE, sc.TRIO_FLOOR, sc.TRIO_FLOOR_RAW)

COUNTED: dict[str, tuple[str, ...]] = {
    "task steps (Context.run)": ("<method 'run' of '_contextvars.Context' objects>",),
    "epoll_wait (epoll.poll)": ("<method 'poll' of 'select.epoll' objects>",),
    "epoll_ctl (modify/register)": (
        "<method 'modify' of 'select.epoll' objects>",
        "<method 'register' of 'select.epoll' objects>",
    ),
    "FD waits x2 (_epoll_wait: entry + resumption)": ("_io_epoll.py:_epoll_wait",),
    "reschedules (Runner.reschedule)": ("_run.py:reschedule",),
    "cancellation checks (checkpoint_if_cancelled)": ("_run.py:checkpoint_if_cancelled",),
    "memory channel receives x2 (entry + resumption)": ("_channel.py:receive",),
    "shim receives x2 (_receive: entry + resumption)": ("_socket.py:_receive",),
    "shim sends (send_nowait)": ("_socket.py:send_nowait",),
    "cancel scopes entered": ("_run.py:__enter__",),
}
"""A reading's name -> the functions whose calls it counts: pstats' name of a builtin
(``<method ...>``) or ``FILE:FUNCTION`` (the file's name and the function's). cProfile
counts a coroutine's every resumption as a call: those readings say so. The compiled
kernels (Cython functions) are not seen by cProfile: their time is their caller's."""


_TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """CPU time (ns) of each thread of ``pid`` by kind: ``main`` (the process's first
    thread: trio's), ``zmq-io`` (libzmq's I/O threads), ``other``; and the main thread's
    time in the kernel (``main-kernel``, from its 10 ms ticks: meaningful over seconds)."""
    split = {"main": 0, "zmq-io": 0, "other": 0, "main-kernel": 0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            comm = (task / "comm").read_text().strip()
            runtime = 0.0
            for line in (task / "sched").read_text().splitlines():
                if line.startswith("se.sum_exec_runtime"):
                    runtime = float(line.split(":")[1])
                    break
            kind = "main" if task.name == str(pid) else ("zmq-io" if "IO" in comm else "other")
            split[kind] += int(runtime * 1e6)
            if kind == "main":
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                split["main-kernel"] = int(int(fields[12]) * _TICK_NS)  # stime
    return split


def _subject_argv(
    kind: str, sockets: Sequence[str], front: str, cprofile: Path | None
) -> list[str]:
    if kind in (sc.STANDALONE, sc.STANDALONE_PURE):
        argv = serve_command(*sockets, "--front", front, "--log-level", "WARNING")
    else:
        raw = ["--raw"] if kind == sc.TRIO_FLOOR_RAW else []
        argv = procs("trio-floor", *sockets, "--front", front, *raw)
    if cprofile is not None:  # [python, -m, M, ...] -> [python, -m, cProfile, -o, OUT, -m, M, ...]
        argv = [argv[0], "-m", "cProfile", "-o", str(cprofile), *argv[1:]]
    return argv


@contextlib.contextmanager
def _other_tree_subject(
    env: sc.Env, tree: Path, kind: str, engines: int
) -> Iterator[tuple[Child, dict[str, Any]]]:
    """``kind`` run by another checkout ``tree`` (its ``.venv``, its working directory):
    the same measurement of two trees' code in one run."""
    back_pub, back_out, front = env.address("bp"), env.address("bo"), env.address("fr")
    sockets = ("--engines", str(engines), "--back-pub", back_pub, "--back-out", back_out)
    argv = _subject_argv(kind, sockets, front, None)
    argv[0] = str(tree / ".venv" / "bin" / "python")
    child_env = {**os.environ, "PYTHONPATH": str(tree)}
    if kind == sc.STANDALONE_PURE:
        child_env[sc.PURE_PYTHON_ENV] = "1"
    with spawn(f"{tree.name}-{kind}", argv, env.log_dir, env=child_env, cwd=tree) as child:
        yield child, child.read_json(60)


@contextlib.contextmanager
def _subject(
    env: sc.Env, kind: str, engines: int, cprofile: Path | None
) -> Iterator[tuple[Child, dict[str, Any]]]:
    if ":" in kind:  # TREE:KIND
        tree, _, inner = kind.rpartition(":")
        with _other_tree_subject(env, Path(tree), inner, engines) as served:
            yield served
        return
    if cprofile is None or kind not in PYTHON_SUBJECTS:
        with sc.serving(env, kind, engines, with_front=True) as served:
            yield served
        return
    back_pub, back_out, front = env.address("bp"), env.address("bo"), env.address("fr")
    sockets = ("--engines", str(engines), "--back-pub", back_pub, "--back-out", back_out)
    child_env = {**os.environ}
    if kind == sc.STANDALONE_PURE:
        child_env[sc.PURE_PYTHON_ENV] = "1"
    argv = _subject_argv(kind, sockets, front, cprofile)
    # SIGINT: trio's KeyboardInterrupt ends the program and cProfile writes its file
    with spawn(
        f"profile-{kind}", argv, env.log_dir, env=child_env, stop_signal=signal.SIGINT
    ) as child:
        info = child.read_json(60)
        yield child, info


def _traced_waves(tracer_argv: list[str], probe: WakeProbe, waves: int, gap_s: float) -> str:
    """What a tracer attached to the subject (``tracer_argv``, writing to the file named by
    ``{out}``) wrote over ``waves`` waves, stopped by SIGINT."""
    with tempfile.NamedTemporaryFile("r", suffix=".trace") as out:
        tracer = subprocess.Popen(
            [arg.replace("{out}", out.name) for arg in tracer_argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)
        probe.start_wave_latencies(waves, gap_s)
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
        return Path(out.name).read_text()


def strace_counts(pid: int, probe: WakeProbe, waves: int, gap_s: float) -> dict[str, float]:
    """System calls per wave by name (every thread), from ``strace -c -f``."""
    text = _traced_waves(["strace", "-c", "-f", "-o", "{out}", "-p", str(pid)], probe, waves, gap_s)
    counts: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            counts[parts[-1]] = int(parts[3]) / waves
    counts["total"] = sum(counts.values())
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def perf_counts(pid: int, probe: WakeProbe, waves: int, gap_s: float) -> dict[str, float]:
    """``perf stat`` events per wave (every thread of ``pid``)."""
    events = "task-clock,context-switches,cpu-migrations,page-faults"
    text = _traced_waves(
        ["perf", "stat", "-x,", "-e", events, "-o", "{out}", "-p", str(pid)], probe, waves, gap_s
    )
    counts: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split(",")
        if len(parts) > 3 and parts[0] and parts[0][0].isdigit():
            counts[parts[2]] = float(parts[0]) / waves
    return counts


def cprofile_counts(path: Path, waves: int, top: int) -> dict[str, Any]:
    """Calls per wave of :data:`COUNTED`, and the ``top`` functions by own time per wave
    (us, with cProfile's cost inside), from a subject's cProfile file."""
    stats = pstats.Stats(str(path))
    table: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    counted: dict[str, Any] = {}
    for reading, names in COUNTED.items():
        calls = 0
        for (file, _, function), (_, ncalls, *_rest) in table.items():
            if function in names or f"{Path(file).name}:{function}" in names:
                calls += ncalls
        counted[reading] = calls / waves
    rows = sorted(table.items(), key=lambda item: -item[1][2])[:top]
    counted["top (own us per wave)"] = {
        f"{Path(file).name}:{line}({function})": round(values[2] / waves * 1e6, 2)
        for (file, line, function), values in rows
    }
    by_calls = sorted(table.items(), key=lambda item: -item[1][1])[:top]
    counted["top (calls per wave)"] = {
        f"{Path(file).name}:{line}({function})": round(values[1] / waves, 2)
        for (file, line, function), values in by_calls
    }
    counted["calls per wave, all"] = round(sum(v[1] for v in table.values()) / waves, 1)
    counted["by layer (own us per wave, calls per wave)"] = _by_layer(table, waves)
    return counted


_LAYERS = (
    ("select.epoll", "epoll (the waits: idle time)"),
    ("/trio/", "trio"),
    ("outcome", "trio"),
    ("attrs generated", "trio"),
    ("collections/__init__", "trio"),  # trio's Instruments is a UserDict
    ("trio_zmq", "shim"),
    ("_shell", "shell (pumps)"),
    ("/core/", "core"),
    ("/protocol/", "protocol"),
    ("procs.py", "floor program"),
)


def _by_layer(table: dict[tuple[str, int, str], tuple[Any, ...]], waves: int) -> dict[str, Any]:
    """Own time and calls per wave by layer, for the functions called at least 0.9 times a
    wave (what start-up ran is left out)."""
    layers: dict[str, list[float]] = {}
    for (file, _, function), values in table.items():
        if values[1] / waves < 0.9:
            continue
        where = f"{file}:{function}"
        layer = next((name for key, name in _LAYERS if key in where), "builtins and others")
        if function == "_try_send":
            layer = "shim's send (libzmq's zmq_send inside)"
        total = layers.setdefault(layer, [0.0, 0.0])
        total[0] += values[2] / waves * 1e6
        total[1] += values[1] / waves
    return {name: [round(us, 1), round(calls, 1)] for name, (us, calls) in layers.items()}


def profile(args: argparse.Namespace) -> dict[str, Any]:
    env = sc.Env(quick=True, log_dir=Path(tempfile.mkdtemp(prefix="wake-profile-")))
    kinds: list[str] = args.subjects
    if sc.VLLM in kinds:
        reason = sc.vllm_unavailable(env)
        if reason:
            print(f"vllm skipped: {reason}", file=sys.stderr)
            kinds = [k for k in kinds if k != sc.VLLM]
    profile_dir: Path | None = args.cprofile
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"engines": args.engines, "waves": args.waves, "subjects": {}}
    try:
        with contextlib.ExitStack() as stack:
            subjects: list[tuple[str, Child, WakeProbe, Path | None]] = []
            for kind in kinds:
                out = None
                if profile_dir is not None and kind in PYTHON_SUBJECTS:
                    out = profile_dir / f"{kind}.prof"
                child, info = stack.enter_context(_subject(env, kind, args.engines, out))
                probe = stack.enter_context(
                    WakeProbe(info["back_pub"], info["back_out"], args.engines)
                )
                probe.wait_ready(expect_ready=True)
                probe.start_wave_latencies(20, args.gap)
                subjects.append((kind, child, probe, out))
            latencies: dict[str, list[int]] = {kind: [] for kind in kinds}
            cpu: dict[str, dict[str, int]] = {kind: {} for kind in kinds}
            done = 0
            while done < args.waves:
                size = min(args.chunk, args.waves - done)
                for kind, child, probe, _ in subjects:
                    before = thread_cpu_ns(child.pid)
                    latencies[kind] += probe.start_wave_latencies(size, args.gap)
                    after = thread_cpu_ns(child.pid)
                    for part, value in after.items():
                        cpu[kind][part] = cpu[kind].get(part, 0) + value - before[part]
                done += size
            for kind, child, probe, _ in subjects:
                waves = len(latencies[kind])
                figures: dict[str, Any] = dict(summarize_us(latencies[kind]))
                per_thread = {part: ns / waves / 1000 for part, ns in cpu[kind].items()}
                figures["cpu_per_wave_us"] = sum(
                    value for part, value in per_thread.items() if part != "main-kernel"
                )
                figures["cpu_per_wave_us_by_thread"] = per_thread
                if args.strace:
                    figures["syscalls_per_wave"] = strace_counts(
                        child.pid, probe, args.traced, args.gap
                    )
                if args.perf:
                    figures["perf_per_wave"] = perf_counts(child.pid, probe, args.traced, args.gap)
                result["subjects"][kind] = figures
            # cProfile writes its file when the subject stops: stop them all here
        for kind, _, _probe, out in subjects:
            if out is not None and out.exists():
                waves = len(latencies[kind]) + 20 + (args.traced if args.strace else 0)
                result["subjects"][kind]["cprofile_per_wave"] = cprofile_counts(
                    out, waves, args.top
                )
    finally:
        env.cleanup()
    base = result["subjects"].get(sc.VLLM)
    if base:
        for figures in result["subjects"].values():
            figures["vs_vllm"] = {
                stat: round(figures[stat] / base[stat], 3)
                for stat in ("p50", "p99", "cpu_per_wave_us")
                if base[stat]
            }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.wake_profile")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--waves", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=50)
    parser.add_argument("--gap", type=float, default=0.001, help="seconds between waves")
    parser.add_argument(
        "--subjects",
        type=lambda text: text.split(","),
        default=[sc.STANDALONE, sc.TRIO_FLOOR, sc.VLLM],
        help="comma-separated: standalone, standalone-pure, trio-floor, trio-floor-raw, vllm; "
        "TREE:KIND runs KIND from another checkout (its .venv), e.g. /work/main:standalone",
    )
    parser.add_argument("--strace", action="store_true", help="system calls per wave")
    parser.add_argument("--perf", action="store_true", help="perf stat events per wave")
    parser.add_argument("--traced", type=int, default=300, help="waves under strace/perf")
    parser.add_argument(
        "--cprofile", type=Path, metavar="DIR", help="Python subjects under cProfile"
    )
    parser.add_argument("--top", type=int, default=25, help="functions listed per cProfile")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = profile(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
