"""Section 1, ``ingest``: the coordinator's ingest of stats reports, against the bare
PULL+unpackb loop (four pushers) and against vLLM's coordinator on a fleet's stream
(``python -m benchmarks.sections.ingest`` alone, with its profiling options).

**The stream** is what a fleet of ``--engines`` N engines sends a coordinator while it
runs: every step, each engine pushes one stats-only ``EngineCoreOutputs`` (vLLM's full
18-key ``SchedulerStats`` map) for that step, in an order that rotates from step to step,
the step one higher each time (lock-stepped, as MoE ranks step): many engines
interleaved, per engine ``(wave, step)`` never going backwards, and the ``(wave, step)``
of the whole stream never going backwards either (vLLM's coordinator keeps one cursor for
all engines and would log a WARNING per report behind it: that is not ingest). The
waiting count varies per engine and step. Frames are pre-encoded by the project's codec
(:func:`benchmarks.programs.fleet.fleet_stream`: step and waiting count as fixed-width
uint32, which both decoders accept), so the pusher does no encoding.

**The measurement** (``measure``): one pusher process (one PUSH socket, FIFO) sends
``start_wave(W)``, the stream and ``start_wave(W + 1)``; every subject broadcasts
START_DP_WAVE for both markers, so the engines' clock brackets the reports (vLLM's
coordinator publishes nothing while its input is queued, so it cannot be timed by its
publishes). The whole stream is queued **before** the subject reads any of it: the subject's
processes are stopped (SIGSTOP), the pusher queues everything (``SNDHWM`` 0), the subject
is continued (SIGCONT). A pusher racing the subject measured the pusher on this 2-core
machine (one pyzmq send per message, its own I/O thread, against the subject's two
threads): ours and the bare forwarder both read ~300,000 msg/s, the pusher's pace. Queued
in advance, only libzmq's I/O threads move bytes while the subject reads. Besides the rate,
the subject's CPU per message, main thread and other threads (libzmq's I/O thread), from
``/proc`` with the subject stopped before and idle after.

``--profile DIR`` runs each subject under ``py-spy record --format raw --nonblocking``;
``--breakdown RAW...`` sorts the samples into the parts of the ingest loop, per message
(share of the samples x the main thread's CPU per message of the same run).
``--floor`` times the parts alone in tight loops in this process (see :func:`floor`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.programs.fleet import fleet_stream, thread_cpu_ns
from benchmarks.shared import scenarios as sc
from benchmarks.shared.suite import VLLM_LABEL, Row, Suite
from benchmarks.shared.util import REPO_ROOT, procs, spawn
from benchmarks.shared.wake_probe import WakeProbe

logger = logging.getLogger("benchmarks.ingest")

INGEST_ENGINES = 8
"""Engines of the fleet stream of the ingest-vs-vLLM rows."""


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (py-spy's child, an exec'd runner), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def _python_pid(tree: Sequence[int]) -> int:
    """The subject itself in its tree: the last process that is not py-spy."""
    for pid in reversed(tree):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() != "py-spy":
                return pid
    return tree[0]


def _thread_cpu(pid: int) -> tuple[int, int]:

    return thread_cpu_ns(pid)


@contextlib.contextmanager
def _stopped(pids: Sequence[int]) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def measure(env: Any, kind: str, engines: int, total: int) -> dict[str, Any]:
    """One subject on the fleet's stream, queued in advance (see the module docstring).

    Returns ``rate`` (msg/s between the markers' arrivals), ``seconds``, ``messages``,
    ``cpu_main_us`` and ``cpu_other_us`` per message."""

    with sc.serving(env, kind, engines) as (child, info):
        with WakeProbe(info["back_pub"], info["back_out"], engines) as probe:
            probe.wait_ready(expect_ready=kind != "forwarder")
            probe.start_wave_latencies(5, 0.0005)  # warm-up; the engines end paused
            first = probe.wave
            argv = procs(
                "pusher",
                "--address",
                info["back_out"],
                "--fleet",
                str(engines),
                "--count",
                str(total),
                "--markers",
                str(first),
            )
            with spawn(f"fleet-pusher-{next(env._counter)}", argv, env.log_dir) as pusher:
                ready = pusher.read_json(300)
                messages = int(ready["messages"])
                time.sleep(0.2)  # the pusher's connection is made before the stop
                tree = process_tree(child.pid)
                subject = _python_pid(tree)
                with _stopped(tree):
                    pusher.send_line("go")
                    pusher.read_json(300)  # every frame queued
                    main0, other0 = _thread_cpu(subject)
                t_first = probe.wave_arrival(first, 60_000)
                t_last = probe.wave_arrival(first + 1, 600_000)
                main1, other1 = _thread_cpu(subject)
    if t_first is None or t_last is None:
        raise TimeoutError(f"{kind}: a start_wave marker never reached the engines")
    seconds = (t_last - t_first) / 1e9
    return {
        "rate": messages / seconds,
        "seconds": seconds,
        "messages": messages,
        "cpu_main_us": (main1 - main0) / 1e3 / messages,
        "cpu_other_us": (other1 - other0) / 1e3 / messages,
    }


# --- the floor: the parts alone, in tight loops -----------------------------------------


def floor(messages: int = 100_000, repeat: int = 5) -> dict[str, float]:
    """Main-thread CPU per message (us, the least of ``repeat`` loops) of the parts of an
    ingest loop, each over ``messages`` frames of the fleet stream already queued on an
    ``inproc://`` PULL (so libzmq's I/O thread does nothing): what a Python coordinator
    cannot go below with each decoder, next to ours without trio and with it."""
    import msgpack
    import trio
    import zmq

    from trio_dpcoord import hot_path_build, protocol
    from trio_dpcoord.core import CoordinatorCore
    from trio_dpcoord.trio_zmq import open_context, open_socket

    frames = fleet_stream(8, messages)
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind("inproc://floor")
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect("inproc://floor")
    noblock = zmq.NOBLOCK

    def fill() -> None:
        for frame in frames:
            push.send(frame)

    def loop_recv() -> None:
        recv = pull.recv
        for _ in frames:
            recv(noblock)

    def loop_recv_frame() -> None:  # what checks for multipart messages
        recv = pull.recv
        for _ in frames:
            frame = recv(noblock, copy=False)
            frame.bytes, frame.more  # noqa: B018

    def loop_unpackb() -> None:  # the forwarder's loop
        recv, unpackb = pull.recv, msgpack.unpackb
        for _ in frames:
            unpackb(recv(noblock))

    def loop_ingest_decode(path: str) -> Callable[[], None]:
        decode = {
            "msgpack": protocol.ingest_stats_with_msgpack,
            "layouts": protocol.ingest_stats_with_layouts,
            "msgspec": protocol.ingest_stats_with_msgspec,
            "core": protocol.decode_ingest_stats,
        }[path]

        def loop() -> None:  # our decoder's hot path, recv with the multipart check
            recv = pull.recv
            for _ in frames:
                frame = recv(noblock, copy=False)
                decode(frame.bytes)

        return loop

    loops: dict[str, Callable[[], None]] = {
        "recv (bytes, no multipart check)": loop_recv,
        "recv (frame, bytes, more: multipart checked)": loop_recv_frame,
        "recv + msgpack.unpackb (the forwarder)": loop_unpackb,
        "recv (frame) + our ingest decode, msgpack path": loop_ingest_decode("msgpack"),
        "recv (frame) + our ingest decode, layouts path": loop_ingest_decode("layouts"),
        "recv (frame) + our ingest decode, msgspec path": loop_ingest_decode("msgspec"),
        f"recv (frame) + our ingest decode as the core calls it ({hot_path_build()} build)": (
            loop_ingest_decode("core")
        ),
    }
    with contextlib.suppress(ImportError):
        import msgspec

        read = [(k, int, 0) for k in ("num_running_reqs", "num_waiting_reqs", "step_counter")]
        least_stats = msgspec.defstruct("_Least", [*read, ("kv_cache_usage", float, 0.0)])
        least_view = msgspec.defstruct(
            "_LeastView",
            [
                ("engine_index", int, 0),
                ("outputs", list[Any], []),
                ("scheduler_stats", least_stats, None),
            ],
            array_like=True,
            gc=False,
        )
        least: Callable[[bytes], Any] = msgspec.msgpack.Decoder(least_view).decode

        def loop_least() -> None:  # skips every unread value unchecked: not a decoder
            recv = pull.recv
            for _ in frames:
                view = least(recv(noblock))
                stats = view.scheduler_stats
                (view.engine_index, stats.num_waiting_reqs, stats.num_running_reqs)  # noqa: B018

        loops["recv + msgspec, 5 fields read, the rest skipped unchecked"] = loop_least

    def loop_core() -> None:  # the core's ingest, a shim-like batch receive, no trio
        core = CoordinatorCore(8)
        recv = pull.recv
        for start in range(0, len(frames), 64):
            batch: list[list[bytes]] = []
            for _ in range(min(64, len(frames) - start)):
                frame = recv(noblock, copy=False)
                batch.append([frame.bytes])
            index = 0
            while index < len(batch):
                index, _ = core.receive_engine_outputs(batch, index, 0.0)

    loops["ours: batches of 64 through the core, no trio"] = loop_core

    async def through_shim() -> None:
        async with (
            open_context() as ctx,
            open_socket(ctx, zmq.PULL, options={zmq.RCVHWM: 0}, exclusive=True) as sock,
        ):
            sock.zmq_socket.bind("inproc://floor-shim")
            sender = ctx.socket(zmq.PUSH)
            sender.setsockopt(zmq.SNDHWM, 0)
            sender.connect("inproc://floor-shim")
            core = CoordinatorCore(8)
            for frame in frames:
                sender.send(frame)
            t0 = time.thread_time()
            left = len(frames)
            while left:
                batch = await sock.recv_multipart_batch(64)
                left -= len(batch)
                index = 0
                while index < len(batch):
                    index, _ = core.receive_engine_outputs(batch, index, 0.0)
            results["ours: the shim's batch receive and the core, in trio"] = min(
                results.get("ours: the shim's batch receive and the core, in trio", 1e9),
                (time.thread_time() - t0) / len(frames) * 1e6,
            )
            sender.close(linger=0)

    results: dict[str, float] = {}
    try:
        for _ in range(repeat):
            for name, loop in loops.items():
                fill()
                t0 = time.thread_time()
                loop()
                us = (time.thread_time() - t0) / len(frames) * 1e6
                results[name] = min(results.get(name, 1e9), us)
            trio.run(through_shim)
    finally:
        context.destroy(linger=0)
    return results


# --- where the CPU goes: py-spy's raw stacks, sorted into the parts of the ingest loop ----

_OURS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (part, substrings of any frame of the stack): the first rule that matches
    ("receive (pyzmq, the shim's batch)", ("trio_zmq/",)),
    ("decode", ("_output_decoder", "_ingest_decoder", "protocol/_codec", "protocol/_outputs")),
    ("core: write the table (per batch)", ("apply_held_stats", "LoadTable", "_apply_held")),
    (
        "core: check, count, hold (per message)",
        ("receive_engine_output", "_hold_stats", "CoordinatorCore"),
    ),
    ("listener: loop, lock, per-batch bookkeeping", ("Pumps.", "IngestBacklog")),
)
_VLLM_LINES: tuple[tuple[str, range], ...] = (
    # vLLM 0.33.0's DPCoordinatorProc.process_input_socket (vllm/v1/engine/coordinator.py)
    ("receive (pyzmq)", range(357, 361)),
    ("decode", range(361, 362)),
    ("apply the stats", range(362, 460)),
    ("loop: poll (one per message), events dict", range(262, 296)),
)
_VLLM_PREFIX = "DPCoordinatorProc.process_input_socket (vllm/v1/engine/coordinator.py:"


def _vllm_part(frames: list[str]) -> str:
    lines = [f for f in frames if f.startswith(_VLLM_PREFIX)]
    if not lines:
        return "other"
    line = int(lines[-1][len(_VLLM_PREFIX) :].rstrip(")"))
    return next((name for name, span in _VLLM_LINES if line in span), "other")


def breakdown(raw: Path) -> dict[str, float]:
    """Shares of the samples in ``raw`` (``py-spy record --format raw``) by part of the
    ingest loop, start-up (imports) and waits in epoll left out; the shares sum to 1."""
    counts: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if f]
        if not frames or any("importlib" in f for f in frames):
            continue
        if frames[-1].startswith("EpollIOManager.get_events"):
            continue  # trio waiting for work: idle
        if any(f.startswith(_VLLM_PREFIX) for f in frames):
            part = _vllm_part(frames)
        elif any("Pumps.engine_output_listener" in f for f in frames):
            part = next(
                (name for name, keys in _OURS if any(k in f for f in frames for k in keys)),
                "other",
            )
        elif any("trio/" in f for f in frames):
            part = "trio's run loop, other tasks"
        else:
            part = "other"
        counts[part] = counts.get(part, 0) + int(count)
    total = sum(counts.values()) or 1
    return {name: n / total for name, n in sorted(counts.items(), key=lambda kv: -kv[1])}


# --- the section's rows ----------------------------------------------------------------


def run_section(suite: Suite) -> None:
    """Rounds of (forwarder, inproc, standalone), interleaved; best round of each.

    Background load on a shared machine only ever slows a run down, so the best
    round is the least disturbed one, for the baseline and the coordinator alike.
    """
    s = suite.sizes
    kinds = ["forwarder", *sc.COORDINATOR_KINDS]
    if suite.standalone_reason:
        kinds.remove("standalone")
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    failures: dict[str, str] = {}
    for _ in range(s.ingest_rounds):
        for kind in kinds:
            if kind in failures:
                continue
            try:
                runs[kind].append(sc.ingest(suite.env, kind, s.ingest_total, s.ingest_pushers))
            except Exception as exc:
                logger.error("ingest %s failed:\n%s", kind, traceback.format_exc())
                failures[kind] = f"failed: {exc!r}"[:160]
    best = {kind: max(r, key=lambda x: x["rate"]) for kind, r in runs.items() if r}
    suite.details["ingest_rounds"] = runs
    for kind, result in best.items():
        suite.details[f"ingest_{kind}"] = result
    base = best.get("forwarder")
    for kind in sc.COORDINATOR_KINDS:
        figure = f"ingest, {kind} ({s.ingest_pushers} pushers)"
        if kind == "standalone" and suite.standalone_reason:
            suite.skipped("1 ingest", figure, suite.standalone_reason)
            continue
        if kind not in best or base is None:
            note = failures.get(kind) or failures.get("forwarder", "failed")
            suite.rows.append(Row("1 ingest", figure, None, "", note=note))
            continue
        rates = ", ".join(f"{r['rate']:,.0f}" for r in runs[kind])
        row = Row(
            "1 ingest",
            figure,
            best[kind]["rate"],
            "msg/s",
            base["rate"],
            "PULL+unpackb loop",
            ">= 0.5x",
            note=f"rounds: {rates}",
        )
        row.met = row.ratio is not None and row.ratio >= 0.5
        if best[kind].get("coarse"):
            row.note += "; coarse: drained within one publish interval"
        suite.rows.append(row)
    suite.guarded("1 ingest", "ingest vs vLLM", lambda: ingest_vs_vllm(suite))


INGEST_TARGETS = {sc.STANDALONE_MSGPACK: 3.0, sc.STANDALONE_PURE: 1.5}
"""Issue 45's goals, as ratios to vLLM's coordinator in the same run: the default install
(the compiled twins, no ``fast`` extra) 3x, its pure-Python twin 1.5x."""

_INGEST_NOTES = {
    "standalone": "the fast extra (msgspec) and the compiled twins; ",
    sc.STANDALONE_MSGPACK: "the default install: compiled twins, no fast extra; ",
    sc.STANDALONE_PURE: "the pure-Python twin (TRIO_DPCOORD_PURE_PYTHON=1), no fast extra; ",
    "forwarder": "Python's PULL+unpackb limit; ",
}


def ingest_vs_vllm(suite: Suite) -> None:
    """A fleet's stream queued in advance, timed by start_wave markers
    (``benchmarks/sections/ingest.py``); interleaved rounds, best of each."""
    s = suite.sizes
    ours = ("standalone", sc.STANDALONE_MSGPACK, sc.STANDALONE_PURE)
    figures = [f"ingest vs vLLM, {kind} (fleet of {INGEST_ENGINES}, queued)" for kind in ours]
    figures.append(f"ingest vs vLLM, inproc (fleet of {INGEST_ENGINES}, queued)")
    figures.append(f"ingest vs vLLM, forwarder (fleet of {INGEST_ENGINES}, queued)")
    if suite.vllm_reason:
        for figure in figures:
            suite.skipped("1 ingest", figure, suite.vllm_reason)
        return
    kinds = [sc.VLLM, "forwarder", "inproc"]
    if not suite.standalone_reason:
        kinds[1:1] = ours
    runs: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(s.ingest_rounds):
        for kind in kinds:
            result = measure(suite.env, kind, INGEST_ENGINES, s.vllm_ingest_total)
            runs[kind].append(result["rate"])
            cpu[kind].append(result["cpu_main_us"])
    suite.details["ingest_vs_vllm_rounds"] = runs
    suite.details["ingest_vs_vllm_cpu_main_us"] = cpu
    base = max(runs[sc.VLLM])
    for kind in (*ours, "inproc", "forwarder"):
        figure = f"ingest vs vLLM, {kind} (fleet of {INGEST_ENGINES}, queued)"
        if kind not in runs:
            suite.skipped("1 ingest", figure, suite.standalone_reason or "")
            continue
        rates = ", ".join(f"{r:,.0f}" for r in runs[kind])
        cpus = ", ".join(f"{c:.2f}" for c in cpu[kind])
        row = Row(
            "1 ingest",
            figure,
            max(runs[kind]),
            "msg/s",
            base,
            VLLM_LABEL,
            note=f"{_INGEST_NOTES.get(kind, '')}rounds: {rates}; main-thread CPU us/msg: {cpus}",
        )
        if kind in INGEST_TARGETS:
            row.target = f">= {INGEST_TARGETS[kind]:g}x"
            row.met = row.ratio is not None and row.ratio >= INGEST_TARGETS[kind]
        suite.rows.append(row)
    # The same targets on CPU per message (main thread, least of the rounds): what the
    # rate is when nothing else runs, steadier than the rate on a shared machine.
    for kind, target in INGEST_TARGETS.items():
        if kind in cpu:
            row = Row(
                "1 ingest",
                f"ingest vs vLLM, {kind}: main-thread CPU per message",
                min(cpu[kind]),
                "us",
                min(cpu[sc.VLLM]),
                VLLM_LABEL,
                f"<= {1 / target:.2f}x",
                note=f"= {min(cpu[sc.VLLM]) / min(cpu[kind]):.2f}x vLLM's rate at one core",
            )
            row.met = row.ratio is not None and row.ratio <= 1 / target
            suite.rows.append(row)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sections.ingest")
    parser.add_argument("--only", default="vllm,standalone,standalone-msgpack,standalone-pure")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", type=Path, metavar="DIR")
    parser.add_argument("--rate", type=int, default=1000, help="py-spy's samples per second")
    parser.add_argument(
        "--breakdown",
        nargs=2,
        action="append",
        metavar=("RAW", "US_PER_MESSAGE"),
        help="sort a py-spy raw profile; scale the shares by the main thread's CPU",
    )
    parser.add_argument("--floor", action="store_true", help="the parts alone (see floor)")
    args = parser.parse_args(argv)
    if args.floor:
        for name, us in floor(args.messages).items():
            print(f"  {us:6.2f} us  {name}")
        return 0
    if args.breakdown:
        for raw, per_message in args.breakdown:
            print(f"{raw} ({float(per_message):.2f} us per message, main thread)")
            for part, share in breakdown(Path(raw)).items():
                print(f"  {share:6.1%} {share * float(per_message):6.2f} us  {part}")
        return 0
    log_dir = REPO_ROOT / "benchmarks" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = sc.Env(quick=True, log_dir=log_dir, profile_dir=args.profile, profile_rate=args.rate)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    kinds = args.only.split(",")
    try:
        if sc.VLLM in kinds and (reason := sc.vllm_unavailable(env)):
            print(f"vllm skipped: {reason}", file=sys.stderr)
            kinds.remove(sc.VLLM)
        for _ in range(args.rounds):
            for kind in kinds:
                result = measure(env, kind, args.engines, args.messages)
                print(json.dumps({"kind": kind, **result}), flush=True)
    finally:
        env.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
