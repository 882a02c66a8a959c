"""A fleet of simulated engines for the saturation sweep: ``python -m benchmarks.programs.fleet``.

N engines, each an XSUB (its rank as identity, subscribed) and a PUSH, as vLLM's engines
connect to a coordinator, all in this one process with blocking pyzmq. Every
``--interval-ms`` each engine pushes one stats-only ``EngineCoreOutputs`` (vLLM's full
18-key ``SchedulerStats`` map) for the same step (lock-stepped), the step one higher each
time, so per engine ``(wave, step)`` never goes backwards, as real engines send. Every
``--wave-every-ms`` a rotating engine pushes ``start_wave(W)`` behind its own stats; the
wake lag is the time until another engine's XSUB has START_DP_WAVE(W), after which rank
0 pushes ``wave_complete(W)``.

The frames are pre-encoded by the project's codec, one per engine, with the step and the
waiting count encoded as fixed-width ``uint32`` (valid msgpack: a wider encoding than
vLLM's own, which both decoders accept); each send patches those eight bytes in place, so
the generator's own cost per message is one ``struct.pack_into`` and one pyzmq send. The
waiting count is the step, so a front publish says which step each engine's applied
report was for: its freshness is the time since the newest step in it was sent.

It reads the coordinator's CPU per thread (main thread apart from the others: libzmq's
I/O thread) and its own at the start and the end of the measured window from ``/proc``,
and the coordinator's peak RSS (``VmHWM``) at the end; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import zmq

from benchmarks.shared.util import (
    now_ns,
    set_parent_death_signal,
    start_wave_frame,
    stats_frame,
    summarize_us,
    wave_complete_frame,
)

STEP_MARK = 0xCAFEBABE
WAITING_MARK = 0xFACEFEED
_UINT32 = struct.Struct(">I")
_START = b"\x02"


def thread_cpu_ns(pid: int | str) -> tuple[int, int]:
    """CPU of ``pid``'s main thread and of all its other threads, in ns
    (``se.sum_exec_runtime`` of ``/proc/PID/task/*/sched``)."""
    main = other = 0.0
    base = Path(f"/proc/{pid}/task")
    main_tid = str(pid) if pid != "self" else str(Path("/proc/self").resolve().name)
    for task in base.iterdir():
        try:
            text = (task / "sched").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("se.sum_exec_runtime"):
                value = float(line.split(":")[1])
                if task.name == main_tid:
                    main += value
                else:
                    other += value
                break
    return int(main * 1e6), int(other * 1e6)


def run_delay_ns(pid: int) -> int:
    """How long ``pid``'s main thread has waited, runnable, for a CPU (schedstat's second
    field): the direct measure of being starved by other work on a shared machine."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1])


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (``/proc/stat``)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def template(engine: int) -> tuple[bytearray, int, int]:
    """Engine ``engine``'s pre-encoded stats frame and the offsets of its step and
    waiting count (each a big-endian uint32 after a 0xce marker)."""
    frame = stats_frame(engine, WAITING_MARK, STEP_MARK)
    step_at = frame.index(b"\xce" + _UINT32.pack(STEP_MARK)) + 1
    waiting_at = frame.index(b"\xce" + _UINT32.pack(WAITING_MARK)) + 1
    return bytearray(frame), step_at, waiting_at


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def run(args: argparse.Namespace) -> dict[str, object]:
    n = args.engines
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    context.set(zmq.MAX_SOCKETS, 2 * n + 64)  # libzmq's default allows 1,023
    subs: list[zmq.Socket[bytes]] = []
    pushes: list[zmq.Socket[bytes]] = []
    for index in range(n):
        sub = context.socket(zmq.XSUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IDENTITY, index.to_bytes(2, "little"))
        sub.connect(args.back_pub)
        sub.send(b"\x01")
        subs.append(sub)
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 0)  # a coordinator that falls behind queues, as in life
        push.connect(args.back_out)
        pushes.append(push)
    front = context.socket(zmq.SUB)
    front.setsockopt(zmq.LINGER, 0)
    front.setsockopt(zmq.SUBSCRIBE, b"")
    front.connect(args.front)
    templates = [template(index) for index in range(n)]

    # every engine has READY (the coordinator's start-up gate opened)
    t_connect = time.monotonic()
    ready_poller = zmq.Poller()
    for sub in subs:
        ready_poller.register(sub, zmq.POLLIN)
    pending = set(range(n))
    index_of = {sub: i for i, sub in enumerate(subs)}
    deadline = time.monotonic() + args.ready_timeout
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"READY reached {n - len(pending)} of {n} engines")
        for sock, _ in ready_poller.poll(1000):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if frames[0] == b"READY":
                    pending.discard(index_of[sock])
    connect_s = time.monotonic() - t_connect

    pack_into = _UINT32.pack_into
    interval = args.interval_ms / 1000
    wave_every = args.wave_every_ms / 1000
    t_begin = time.monotonic()
    t_measure = t_begin + args.warmup
    t_end = t_measure + args.seconds
    next_tick = t_begin
    next_wave = t_begin + wave_every
    step = 0
    wave = 0
    starter = 0
    sent = 0
    sent_at_measure = 0
    sent_ns: dict[int, int] = {}
    # the wave being woken: its number, when start_wave was sent, who observes, counted?
    waiting_wave: tuple[int, int, zmq.Socket[bytes], bool] | None = None
    lags: list[int] = []  # (only waves started in the measured window)
    lag_times: list[float] = []
    late_slots = 0
    freshness: list[int] = []
    publishes = 0
    bad_publishes = 0
    cpu0: tuple[int, int] | None = None
    own0: tuple[int, int] | None = None
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    measuring = False
    wall0 = t_measure
    while True:
        now = time.monotonic()
        if not measuring and now >= t_measure:
            measuring = True
            cpu0 = thread_cpu_ns(args.observe_pid)
            own0 = thread_cpu_ns("self")
            delay0 = run_delay_ns(args.observe_pid)
            busy0 = machine_busy()
            sent_at_measure = sent
            wall0 = now
        if now >= t_end:
            break
        if now >= next_tick:
            step += 1
            sent_ns[step] = now_ns()
            for index in range(n):
                frame, step_at, waiting_at = templates[index]
                pack_into(frame, step_at, step)
                pack_into(frame, waiting_at, step)
                pushes[index].send(frame)
            sent += n
            if now >= next_wave:
                next_wave += wave_every
                if waiting_wave is None:
                    starter = (starter + 1) % n
                    t0 = now_ns()
                    pushes[starter].send(start_wave_frame(starter, wave))
                    observer = subs[(starter + 1) % n]
                    poller.register(observer, zmq.POLLIN)
                    waiting_wave = (wave, t0, observer, measuring)
                elif measuring:
                    late_slots += 1  # the last wave is still not delivered
            next_tick += interval
            continue
        timeout_ms = max(0, math.ceil((next_tick - time.monotonic()) * 1000))
        for sock, _ in poller.poll(timeout_ms):
            arrived = now_ns()
            if sock is front:
                while True:
                    try:
                        payload = front.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    fresh = _freshness(payload, sent_ns, arrived)
                    if fresh is None:
                        bad_publishes += 1
                    elif fresh >= 0 and measuring:
                        publishes += 1
                        freshness.append(fresh)
                continue
            if waiting_wave is None or sock is not waiting_wave[2]:
                continue
            while waiting_wave is not None:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if frames[0] == _START and _decode_wave(frames[1]) >= waiting_wave[0]:
                    if waiting_wave[3]:
                        lags.append(arrived - waiting_wave[1])
                        lag_times.append(time.monotonic() - t_measure)
                    pushes[0].send(wave_complete_frame(waiting_wave[0]))
                    poller.unregister(sock)
                    wave = waiting_wave[0] + 1
                    waiting_wave = None
    assert cpu0 is not None and own0 is not None
    cpu1 = thread_cpu_ns(args.observe_pid)
    own1 = thread_cpu_ns("self")
    delay1 = run_delay_ns(args.observe_pid)
    busy1 = machine_busy()
    wall = time.monotonic() - wall0
    undelivered = 0
    if waiting_wave is not None:  # give the last one as long as the kept-up limit
        observer = waiting_wave[2]
        if observer.poll(int(args.lag_limit_ms)) and waiting_wave[3]:
            lags.append(now_ns() - waiting_wave[1])
            lag_times.append(time.monotonic() - t_measure)
        else:
            undelivered = 1
    peak = peak_rss_bytes(args.observe_pid)
    context.destroy(linger=0)
    third = max(1, len(lags) // 3)
    first_p50 = _median(lags[:third]) / 1e6
    last_p50 = _median(lags[-third:]) / 1e6
    summary = summarize_us(lags)
    sent_window = sent - sent_at_measure
    return {
        "engines": n,
        "interval_ms": args.interval_ms,
        "connect_s": connect_s,
        "window_s": wall,
        "target_rate": n / interval,
        "sent_rate": sent_window / wall,
        "sent": sent_window,
        "waves": len(lags),
        "late_slots": late_slots,
        "undelivered": undelivered,
        "lag_p50_ms": summary["p50"] / 1000,
        "lag_p99_ms": summary["p99"] / 1000,
        "lag_max_ms": summary["max"] / 1000,
        "lag_first_third_p50_ms": first_p50,
        "lag_last_third_p50_ms": last_p50,
        "main_cpu_s": (cpu1[0] - cpu0[0]) / 1e9,
        "other_cpu_s": (cpu1[1] - cpu0[1]) / 1e9,
        "generator_cpu_s": (own1[0] + own1[1] - own0[0] - own0[1]) / 1e9,
        "generator_main_cpu_s": (own1[0] - own0[0]) / 1e9,
        "main_run_delay_s": (delay1 - delay0) / 1e9,
        "machine_busy": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]),
        "peak_rss_mib": peak / 2**20,
        "publishes": publishes,
        "bad_publishes": bad_publishes,
        "freshness_p50_ms": summarize_us(freshness)["p50"] / 1000 if freshness else None,
        "freshness_p99_ms": summarize_us(freshness)["p99"] / 1000 if freshness else None,
    }


def _decode_wave(payload: bytes) -> int:
    import msgpack

    value = msgpack.unpackb(payload)
    return int(value[0]) if isinstance(value, list) and value else -1


def _freshness(payload: bytes, sent_ns: dict[int, int], arrived: int) -> int | None:
    """ns since the newest step a front publish's counts carry was sent; -1 for a publish
    without counts (a wave change); None for one that cannot be read."""
    import msgpack

    try:
        value = msgpack.unpackb(payload)
        counts = value[0]
        if counts is None:
            return -1
        newest = max(int(entry[0]) for entry in counts)
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    sent = sent_ns.get(newest)
    return -1 if sent is None else arrived - sent


def fleet_stream(engines: int, count: int) -> list[bytes]:
    """``count`` stats frames of a lock-stepped fleet of ``engines`` (rounded down to
    whole steps): step ``s`` has one report from every engine, starting with engine
    ``s mod engines`` (the order within a step rotates), waiting count ``(s + e) mod 17``."""
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


def main(argv: Sequence[str] | None = None) -> int:
    set_parent_death_signal()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.programs.fleet")
    parser.add_argument("--back-pub", required=True)
    parser.add_argument("--back-out", required=True)
    parser.add_argument("--front", required=True)
    parser.add_argument("--engines", type=int, required=True)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--wave-every-ms", type=float, default=250.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--lag-limit-ms", type=float, default=100.0)
    parser.add_argument("--ready-timeout", type=float, default=120.0)
    parser.add_argument("--observe-pid", type=int, required=True)
    args = parser.parse_args(argv)
    sys.stdout.write(json.dumps(run(args)) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
