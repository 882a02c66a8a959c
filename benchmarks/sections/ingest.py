"""Coordinator ingest against vLLM's on a fleet's stream: ``python -m benchmarks._ingest``.

**The stream** is what a fleet of ``--engines`` N engines sends a coordinator while it
runs: every step, each engine pushes one stats-only ``EngineCoreOutputs`` (vLLM's full
18-key ``SchedulerStats`` map) for that step, in an order that rotates from step to step,
the step one higher each time (lock-stepped, as MoE ranks step): many engines
interleaved, per engine ``(wave, step)`` never going backwards, and the ``(wave, step)``
of the whole stream never going backwards either (vLLM's coordinator keeps one cursor for
all engines and would log a WARNING per report behind it: that is not ingest). The
waiting count varies per engine and step. Frames are pre-encoded by the project's codec
(``benchmarks._fleet.template``: step and waiting count as fixed-width uint32, which both
decoders accept), so the pusher does no encoding.

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
import os
import signal
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks._util import procs, spawn

_UINT32 = struct.Struct(">I")


def fleet_stream(engines: int, count: int) -> list[bytes]:
    """``count`` stats frames of a lock-stepped fleet of ``engines`` (rounded down to
    whole steps): step ``s`` has one report from every engine, starting with engine
    ``s mod engines`` (the order within a step rotates), waiting count ``(s + e) mod 17``."""
    from benchmarks._fleet import template

    templates = [template(e) for e in range(engines)]
    frames: list[bytes] = []
    pack_into = _UINT32.pack_into
    for step in range(1, count // engines + 1):
        for k in range(engines):
            engine = (step + k) % engines
            frame, step_at, waiting_at = templates[engine]
            pack_into(frame, step_at, step)
            pack_into(frame, waiting_at, (step + engine) % 17)
            frames.append(bytes(frame))
    return frames


# --- the subject's processes --------------------------------------------------------------


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
    from benchmarks._fleet import thread_cpu_ns

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
    from benchmarks import _scenarios as sc
    from benchmarks._wake import WakeProbe

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

    from trio_dpcoord.core import CoordinatorCore
    from trio_dpcoord.testing import coordinator_ingest_paths
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
        decode = coordinator_ingest_paths()[path]

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
        "recv (frame) + our ingest decode, msgspec path": loop_ingest_decode("msgspec"),
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
    ("receive (pyzmq, the shim's batch)", ("trio_zmq.py",)),
    ("decode", ("_output_decoder", "_ingest_decoder", "protocol/_codec", "protocol/_outputs")),
    ("core: write the table (per batch)", ("apply_held_stats", "LoadTable", "_apply_held")),
    (
        "core: check, count, hold (per message)",
        ("receive_engine_output", "_hold_stats", "CoordinatorCore"),
    ),
    ("listener: loop, lock, per-batch bookkeeping", ("_Pumps.", "IngestBacklog")),
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
        elif any("_Pumps.engine_output_listener" in f for f in frames):
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


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks import _scenarios as sc

    parser = argparse.ArgumentParser(prog="python -m benchmarks._ingest")
    parser.add_argument("--only", default="vllm,standalone,standalone-msgpack")
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
    log_dir = Path(__file__).resolve().parent / "results" / "logs"
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
