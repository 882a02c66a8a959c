"""The measurements. Each returns plain dicts; :mod:`benchmarks.run` turns them into rows.

Processes: the coordinator under test (``inproc``: :func:`open_coordinator` in a small
trio program; ``standalone``: ``python -m trio_dpcoord serve``) or the baseline
(``forwarder``) runs in its own process; this process plays the engines with blocking
pyzmq; stats pushers are separate processes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import trio
import zmq

from benchmarks.shared.util import (
    REPO_ROOT,
    Child,
    cpu_ns,
    procs,
    python_module,
    rss_bytes,
    spawn,
    stats_frame,
    summarize_us,
)
from benchmarks.shared.util import (
    with_death_signal as _with_death_signal,
)
from benchmarks.shared.wake_probe import WakeProbe
from trio_dpcoord import PrivateIpcDirectory, open_coordinator, protocol
from trio_dpcoord.core import CoordinatorCore, Publish
from trio_dpcoord.testing import connect_engines, serve_command

COORDINATOR_KINDS = ("inproc", "standalone")
VLLM = "vllm"
"""vLLM 0.33.0's real ``DPCoordinatorProc`` (tests/vllm_reference), torch-free."""
STANDALONE = "standalone"
STANDALONE_PURE = "standalone-pure"
"""``trio-dpcoord serve`` with ``TRIO_DPCOORD_PURE_PYTHON=1``: the pure-Python twins of
every compiled module (measured beside ``standalone`` when that one runs compiled)."""
PURE_PYTHON_ENV = "TRIO_DPCOORD_PURE_PYTHON"
STANDALONE_MSGPACK = "standalone-msgpack"
"""``trio-dpcoord serve`` with msgspec unimportable: a machine without the ``fast`` extra."""
STANDALONE_PURE = "standalone-pure"
"""The same with ``TRIO_DPCOORD_PURE_PYTHON=1``: the default install's pure-Python twin."""
TRIO_FLOOR = "trio-floor"
TRIO_FLOOR_RAW = "trio-floor-raw"
TRIO_FLOORS = (TRIO_FLOOR, TRIO_FLOOR_RAW)
"""The least a trio program in the coordinator's shape (a receiving task, a memory channel,
a sending task) does per wave, with our shim and waiting on the FD directly: not
coordinators, the reference below which none can go."""


@dataclass
class Env:
    """Where a run keeps its sockets and logs, and how big it is."""

    quick: bool
    log_dir: Path
    profile_dir: Path | None = None
    profile_rate: int = 250
    """py-spy's samples per second (``profile_dir``)."""
    vllm_root: Path | None = None
    """The import root of vLLM's real code (see :func:`vllm_unavailable`)."""
    socket_dir: PrivateIpcDirectory = field(default_factory=PrivateIpcDirectory)
    _counter: Iterator[int] = field(default_factory=itertools.count)

    def address(self, name: str) -> str:
        return self.socket_dir.address(f"{name}-{next(self._counter)}")

    def cleanup(self) -> None:
        self.socket_dir.cleanup()


def standalone_unavailable() -> str | None:
    """Why the standalone CLI cannot be benchmarked, or None if it can."""
    if importlib.util.find_spec("trio_dpcoord.cli") is None:
        return "trio_dpcoord/cli.py does not exist yet"
    result = subprocess.run(
        serve_command("--help"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"`python -m trio_dpcoord serve --help` failed: {tail[0]}"
    return None


def vllm_unavailable(env: Env) -> str | None:
    """Why vLLM's coordinator cannot be benchmarked, or None (then ``env.vllm_root`` is
    set). The wheel is fetched into the ignored cache on first use (tests/vllm_reference)."""
    try:
        from tests.vllm_reference import VllmUnavailable, prepare_import_root
    except ImportError as exc:
        return f"tests/vllm_reference cannot be imported: {exc}"
    try:
        env.vllm_root = prepare_import_root()
    except (VllmUnavailable, OSError, subprocess.SubprocessError) as exc:
        return f"vLLM 0.33.0 unavailable: {exc}".splitlines()[0][:120]
    return None


@contextlib.contextmanager
def serving(
    env: Env, kind: str, engines: int, *, ingest: int = 0, with_front: bool = True
) -> Iterator[tuple[Child, dict[str, Any]]]:
    """Start a coordinator (or the forwarder baseline); yield it and its endpoints."""
    back_pub, back_out, front = env.address("bp"), env.address("bo"), env.address("fr")
    # py-spy loses a process that execs: profiled, the subject is py-spy's own child
    with_death_signal = list if env.profile_dir is not None else _with_death_signal
    sockets = ("--engines", str(engines), "--back-pub", back_pub, "--back-out", back_out)
    child_env: dict[str, str] | None = None
    if kind == "inproc":
        argv = procs("coordinator", *sockets, "--front", front if with_front else "")
    elif kind in (STANDALONE, STANDALONE_PURE):
        if kind == STANDALONE_PURE:
            child_env = {**os.environ, PURE_PYTHON_ENV: "1"}  # docs/vllm.md's switch
        argv = with_death_signal(
            serve_command(
                *sockets,
                "--front",
                front,
                "--log-level",
                "WARNING",
            )
        )
    elif kind in (STANDALONE_MSGPACK, STANDALONE_PURE):
        role = "serve-msgpack" if kind == STANDALONE_MSGPACK else "serve-pure"
        argv = procs(role, "--", *sockets, "--front", front, "--log-level", "WARNING")
    elif kind in TRIO_FLOORS:
        argv = procs(
            "trio-floor",
            *sockets,
            "--front",
            front,
            *(["--raw"] if kind == TRIO_FLOOR_RAW else []),
        )
    elif kind == "forwarder":
        argv = procs("forwarder", "--back-pub", back_pub, "--back-out", back_out)
        if ingest:
            argv += ["--ingest", str(ingest)]
    elif kind == VLLM:
        from tests.vllm_reference import coordinator_command, vllm_env
        from tests.vllm_reference.coordinator import ADDRESSES_MARKER

        assert env.vllm_root is not None, "call vllm_unavailable(env) first"
        argv = with_death_signal(
            coordinator_command(
                engines,
                front_publish_address=front,
                back_output_address=back_out,
                back_publish_address=back_pub,
            )
        )
    else:
        raise ValueError(kind)
    name = f"{kind}-{engines}-{next(env._counter)}"
    # py-spy writes its profile when interrupted (SIGINT, as at a terminal); a SIGTERM
    # loses it, and the coordinators that do not stop at stdin's end get one
    stop_signal = signal.SIGTERM
    if env.profile_dir is not None and kind != "forwarder":
        out = env.profile_dir / f"{name}.txt"
        argv = [
            *("py-spy", "record", "--format", "raw", "--nonblocking"),
            *("--rate", str(env.profile_rate), "-o", str(out), "--", *argv),
        ]
        stop_signal = signal.SIGINT
    if kind == VLLM:
        with spawn(
            name,
            argv,
            env.log_dir,
            eof_grace=0.0,
            env=vllm_env(env.vllm_root),
            stop_signal=stop_signal,
        ) as child:
            bound_front, bound_out, bound_pub = child.read_marked(ADDRESSES_MARKER, 60)
            yield child, {"front": bound_front, "back_pub": bound_pub, "back_out": bound_out}
        return
    with spawn(
        name, argv, env.log_dir, eof_grace=3.0, env=child_env, stop_signal=stop_signal
    ) as child:
        info = child.read_json(60)
        yield child, info


@contextlib.contextmanager
def pushers(
    env: Env, address: str, count: int, *, per_pusher: int = 0, rate: float = 0.0, engines: int
) -> Iterator[list[Child]]:
    """``count`` pusher processes, started (frames pre-encoded) but not yet told to go."""
    with contextlib.ExitStack() as stack:
        children = []
        for k in range(count):
            argv = procs("pusher", "--address", address, "--engine", str(k % engines))
            argv += ["--count", str(per_pusher)] if per_pusher else ["--rate", str(rate)]
            children.append(stack.enter_context(spawn(f"pusher-{k}", argv, env.log_dir)))
        for child in children:
            child.read_json(120)
        yield children


def _stop_paced(children: list[Child]) -> float:
    """SIGTERM paced pushers; the rate they achieved together (messages/s)."""
    for child in children:
        child.popen.send_signal(signal.SIGTERM)
    total = 0.0
    for child in children:
        report = child.read_json(10)
        total += report["sent"] / max(report["seconds"], 1e-9)
    return total


# --- 1. ingest throughput ----------------------------------------------------------------


def ingest(env: Env, kind: str, total: int, pusher_count: int) -> dict[str, Any]:
    """Decoded-and-applied stats messages per second, with the queue kept full."""
    per = total // pusher_count
    total = per * pusher_count
    if kind == "forwarder":
        with serving(env, kind, pusher_count, ingest=total) as (child, info):
            with pushers(
                env, info["back_out"], pusher_count, per_pusher=per, engines=pusher_count
            ) as ps:
                for p in ps:
                    p.send_line("go")
                report = child.read_json(300)
        rate = report["messages"] / report["seconds"]
        return {"rate": rate, "messages": report["messages"], "seconds": report["seconds"]}
    with serving(env, kind, pusher_count) as (child, info):
        with WakeProbe(info["back_pub"], info["back_out"], pusher_count) as probe:
            probe.wait_ready(expect_ready=True)
            front = probe.context.socket(zmq.SUB)
            front.setsockopt(zmq.LINGER, 0)
            front.setsockopt(zmq.SUBSCRIBE, b"")
            front.connect(info["front"])
            with pushers(
                env, info["back_out"], pusher_count, per_pusher=per, engines=pusher_count
            ) as ps:
                for p in ps:
                    p.send_line("go")
                samples = _applied_samples(front, total, timeout_s=300)
    return _rate_from_samples(samples, total)


def _applied_samples(
    front: zmq.Socket[bytes], total: int, timeout_s: float
) -> list[tuple[int, int]]:
    """(time, stats applied so far) from each front publish, until all were applied.

    Each pusher's k-th frame reports ``waiting = k``, so the counts a publish carries
    sum to the number of stats messages the coordinator has applied.
    """
    samples: list[tuple[int, int]] = []
    deadline = time.monotonic() + timeout_s
    applied = 0
    while applied < total:
        if time.monotonic() > deadline or not front.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"only {applied} of {total} stats applied")
        frame = front.recv()
        arrived = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        counts = protocol.decode_front_publish(frame).counts
        if counts is None:
            continue
        applied = sum(waiting for waiting, _, _ in counts)
        samples.append((arrived, applied))
    return samples


def _rate_from_samples(samples: list[tuple[int, int]], total: int) -> dict[str, Any]:
    """Rate between the first publish past 5% and the last one before 100% (both while
    the queue was still full), so start-up and the tail do not count."""
    start = next(s for s in samples if s[1] >= total * 0.05)
    before_end = [s for s in samples if s[1] < total and s[0] > start[0]]
    coarse = not before_end
    end = before_end[-1] if before_end else samples[-1]
    seconds = (end[0] - start[0]) / 1e9
    if seconds <= 0:
        return {"rate": math.nan, "messages": 0, "seconds": 0.0, "coarse": True}
    messages = end[1] - start[1]
    return {"rate": messages / seconds, "messages": messages, "seconds": seconds, "coarse": coarse}


# --- 2./3. wake latency --------------------------------------------------------------------


@dataclass
class _Subject:
    """One process under test in an interleaved wake measurement."""

    kind: str
    child: Child
    probe: WakeProbe
    triggers: tuple[str, ...]
    back_out: str


def wake_compare(
    env: Env,
    engines: int,
    waves: int,
    variants: dict[str, tuple[str, ...]],
    *,
    chunk: int = 50,
    gap_s: float = 0.001,
    load_rate: float = 0.0,
    load_pushers: int = 4,
) -> dict[str, dict[str, Any]]:
    """Wake latency of several subjects, measured in interleaved chunks of ``chunk`` waves.

    ``variants`` maps a kind (``forwarder``, ``inproc``, ``standalone``) to its
    triggers (``start_wave``, ``notify_first_request``). Interleaving exposes every
    subject to the same background noise of a shared machine. With ``load_rate``,
    paced pushers send that many stats messages per second to every non-forwarder
    subject (split between them) for the whole measurement.
    Returns p50/p99/max in microseconds per ``"kind trigger"``, and ``cpu_per_wave_us``:
    the subject process's CPU (all its threads) over its own chunks, per wave.
    """
    with contextlib.ExitStack() as stack:
        subjects: list[_Subject] = []
        for kind, triggers in variants.items():
            child, info = stack.enter_context(
                serving(env, kind, engines, with_front=kind == "standalone")
            )
            probe = stack.enter_context(WakeProbe(info["back_pub"], info["back_out"], engines))
            probe.wait_ready(expect_ready=kind != "forwarder")
            probe.start_wave_latencies(20, gap_s)  # warm-up
            subjects.append(_Subject(kind, child, probe, triggers, info["back_out"]))
        paced: list[Child] = []
        loaded = [s for s in subjects if s.kind != "forwarder"]
        if load_rate > 0 and loaded:
            per_subject = load_rate / load_pushers
            for subject in loaded:
                paced += stack.enter_context(
                    pushers(
                        env,
                        subject.back_out,
                        load_pushers,
                        rate=per_subject,
                        engines=engines,
                    )
                )
            for p in paced:
                p.send_line("go")
            time.sleep(0.3)
        latencies: dict[str, list[int]] = {
            f"{s.kind} {t}": [] for s in subjects for t in s.triggers
        }
        cpu: dict[str, int] = dict.fromkeys(latencies, 0)
        done = 0
        while done < waves:
            size = min(chunk, waves - done)
            for subject in subjects:
                for trigger in subject.triggers:
                    label = f"{subject.kind} {trigger}"
                    cpu0 = cpu_ns(subject.child.pid)
                    latencies[label] += _chunk(subject, trigger, size, gap_s)
                    cpu[label] += cpu_ns(subject.child.pid) - cpu0
            done += size
        achieved = _stop_paced(paced) if paced else 0.0
    results: dict[str, dict[str, Any]] = {}
    for label, values in latencies.items():
        results[label] = dict(summarize_us(values))
        # the subject's CPU (every thread) over its own chunks, gaps between waves included
        results[label]["cpu_per_wave_us"] = cpu[label] / max(len(values), 1) / 1000
        if load_rate > 0 and not label.startswith("forwarder"):
            results[label]["load_rate_target"] = load_rate
            results[label]["load_rate_achieved"] = achieved / max(len(loaded), 1)
    return results


def _chunk(subject: _Subject, trigger: str, waves: int, gap_s: float) -> list[int]:
    if trigger == "start_wave":
        return subject.probe.start_wave_latencies(waves, gap_s)
    subject.child.send_line(f"nfr {waves} {gap_s}")
    arrivals = subject.probe.answer_waves(waves)
    starts = subject.child.read_json(60)["t0_ns"]
    return [a - s for a, s in zip(arrivals, starts, strict=True)]


# --- 4. request hot path -------------------------------------------------------------------


def _per_call_ns(call: Any, arg: Any, calls: int, repeats: int = 5) -> float:
    """Best of ``repeats`` loops of ``calls`` calls (timeit's convention), ns per call."""
    best = math.inf
    for _ in range(repeats):
        if arg is None:
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                call()
            elapsed = time.perf_counter_ns() - t0
        else:
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                call(arg)
            elapsed = time.perf_counter_ns() - t0
        best = min(best, elapsed / calls)
    return best


def hot_path(env: Env, calls: int) -> dict[str, float]:
    """ns per ``snapshot()`` / ``notify_first_request()`` with the engines running,
    against reading a tuple under a ``threading.Lock``."""
    lock = threading.Lock()
    state = (3, True)

    def read_tuple() -> tuple[int, bool]:
        with lock:
            return state

    def read_tuple_arg(engine: int) -> tuple[int, bool]:
        with lock:
            return state

    async def measure() -> dict[str, float]:
        async with open_coordinator(2, ready_timeout=30) as coordinator:
            async with connect_engines(
                coordinator.back_publish_address, coordinator.back_output_address, 2
            ) as engines:
                await coordinator.wait_ready()
                coordinator.notify_first_request(0)
                for engine in engines[1:]:
                    with trio.fail_after(10):
                        await engine.next_broadcast()  # READY
                        await engine.next_broadcast()  # START_DP_WAVE
                assert coordinator.snapshot().engines_running
                return {
                    "snapshot_ns": _per_call_ns(coordinator.snapshot, None, calls),
                    "notify_first_request_ns": _per_call_ns(
                        coordinator.notify_first_request, 0, calls
                    ),
                    "engine_loads_ns": _per_call_ns(coordinator.engine_loads, None, calls),
                    "baseline_ns": _per_call_ns(read_tuple, None, calls),
                    "baseline_arg_ns": _per_call_ns(read_tuple_arg, 0, calls),
                }

    return trio.run(measure)


def decode_costs(calls: int) -> dict[str, float]:
    """ns per decode of a stats-only ``EngineCoreOutputs`` (vLLM's full 18-key stats map,
    496 bytes) by the coordinator's two decoder paths, against a bare ``msgpack.unpackb``
    of the same frame (which checks nothing and builds every object)."""
    frame = protocol.encode_engine_core_outputs(
        protocol.EngineCoreOutputs(
            engine_index=2,
            scheduler_stats=protocol.SchedulerStats(12, 3, 17, 5, 0.4375),
            timestamp=81234.5678,
        )
    )
    result = {
        "msgpack_path_ns": _per_call_ns(
            protocol.decode_coordinator_output_with_msgpack, frame, calls
        ),
        "unpackb_ns": _per_call_ns(msgpack.unpackb, frame, calls),
    }
    if protocol.COORDINATOR_OUTPUT_DECODER == "msgspec":
        result["msgspec_path_ns"] = _per_call_ns(
            protocol.decode_coordinator_output_with_msgspec, frame, calls
        )
    return result


# --- 5. scale ------------------------------------------------------------------------------


def scale_point(env: Env, kind: str, engines: int, waves: int) -> dict[str, float]:
    """Resident memory and CPU per wave with ``engines`` engines connected (sub + push)."""
    with serving(env, kind, engines) as (child, info):
        with WakeProbe(info["back_pub"], info["back_out"], engines, push_per_engine=True) as probe:
            probe.wait_ready(expect_ready=kind != "forwarder", timeout_s=60)
            probe.send_stats_from_all()
            probe.start_wave_latencies(10, 0.0005)
            time.sleep(0.3)
            rss = rss_bytes(child.pid)
            cpu0 = cpu_ns(child.pid)
            latencies = probe.start_wave_latencies(waves, 0.0005)
            cpu1 = cpu_ns(child.pid)
    return {
        "rss_mib": rss / 2**20,
        "cpu_per_wave_us": (cpu1 - cpu0) / waves / 1000,
        "wake_p50_us": summarize_us(latencies)["p50"],
    }


def front_publish_cost(engines: int, calls: int) -> dict[str, float]:
    """ns per timed front publish (lock, counts, encode: what the front publisher does
    before its send) against ``msgpack.packb`` of the same message."""

    core = CoordinatorCore(engines, publish_to_front_ends=True)
    for index in range(engines):
        core.receive_engine_subscription(protocol.SUBSCRIBE, 0.0)
        core.receive_engine_output([stats_frame(index, index, 1)], 0.0)
    lock = threading.Lock()
    clock = [0.0]

    def publish() -> bytes:
        # the timer's call: a tick at a clock reading where the heartbeat is due
        with lock:
            clock[0] += 10.0
            effect = core.tick(clock[0])[0]
            assert isinstance(effect, Publish)
            return effect.payload

    counts = [[index, 4, 0.25] for index in range(engines)]
    message = [counts, 3, True]
    return {
        "publish_ns": _per_call_ns(publish, None, calls),
        "baseline_ns": _per_call_ns(msgpack.packb, message, calls),
        "bytes": float(len(publish())),
    }


VLLM_PUBLISH_RUNNER = REPO_ROOT / "benchmarks" / "programs" / "vllm_publish.py"


def vllm_front_publish_cost(env: Env, engines: int, calls: int) -> dict[str, float]:
    """ns per timed front publish of vLLM's coordinator (its own ``_get_engine_counts``
    and ``msgspec`` encode, run in the vLLM world), best of 5 loops."""
    from tests.vllm_reference import runner_command, vllm_env

    result = subprocess.run(
        runner_command(VLLM_PUBLISH_RUNNER, str(engines), str(calls)),
        env=vllm_env(env.vllm_root),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM publish runner failed: {result.stderr[-500:]}")
    value: dict[str, float] = json.loads(lines[-1])
    return value


# --- 7. saturation: a fleet's stats at a cadence, waves timed through it -------------------


def saturation_point(
    env: Env, kind: str, engines: int, interval_ms: float, seconds: float, warmup: float = 1.0
) -> dict[str, Any]:
    """One point of the sweep: ``engines`` engines (:mod:`benchmarks.programs.fleet`) each
    reporting every ``interval_ms``, a rotating engine's ``start_wave`` every 250 ms,
    for ``warmup`` + ``seconds`` s against ``kind``; the fleet's JSON report, plus the
    WARNING lines the coordinator wrote (vLLM's out-of-order stats warnings among them)."""
    with serving(env, kind, engines) as (child, info):
        argv = python_module(
            "benchmarks.programs.fleet",
            "--back-pub",
            info["back_pub"],
            "--back-out",
            info["back_out"],
            "--front",
            info["front"],
            "--engines",
            str(engines),
            "--interval-ms",
            str(interval_ms),
            "--seconds",
            str(seconds),
            "--warmup",
            str(warmup),
            "--observe-pid",
            str(child.pid),
        )
        name = f"fleet-{kind}-{engines}-{interval_ms:g}ms-{next(env._counter)}"
        with spawn(name, argv, env.log_dir) as fleet:
            report = fleet.read_json(180 + warmup + seconds)
        # vLLM's warning for a report older than the last one it read, from any engine
        report["out_of_order_warnings"] = _count_warnings(child.log_path, "out-of-order")
    return report


def _count_warnings(log_path: Path, text: str = "WARNING") -> int:
    with contextlib.suppress(OSError):
        return log_path.read_text(errors="replace").count(text)
    return 0


def kept_up(report: dict[str, Any], lag_limit_ms: float = 100.0) -> bool:
    """Every wave delivered (no 250 ms slot skipped because the last was not), wake lag
    p99 under ``lag_limit_ms`` and not growing (the last third's median at most 25 ms
    above the first third's: past the limit it grows by 0.4-1 s per second), and the
    fleet sent at least 90 % of its target rate (else the generator, not the
    coordinator, was the limit)."""
    return bool(
        report["waves"] > 0
        and report["undelivered"] == 0
        and report["late_slots"] == 0
        and report["lag_p99_ms"] < lag_limit_ms
        and report["lag_last_third_p50_ms"] < report["lag_first_third_p50_ms"] + 25
        and report["sent_rate"] >= 0.9 * report["target_rate"]
    )


# --- 8. SIGTERM in a flood of disconnects --------------------------------------------------


def flood_shutdown(env: Env, kind: str, engines: int) -> dict[str, Any]:
    """``engines`` engines (XSUB + PUSH) subscribe and each send one stats report; once
    READY reached them all, every socket is closed at once and SIGTERM follows at once.
    Time from the signal to the exit, the exit status, the WARNING lines written after
    the engines left, and whether the counters line was printed (ours only)."""
    from trio_dpcoord.protocol import engine_identity

    with serving(env, kind, engines) as (child, info):
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        context.set(zmq.MAX_SOCKETS, 2 * engines + 64)
        subs, pushes = [], []
        poller = zmq.Poller()
        for index in range(engines):
            sub = context.socket(zmq.XSUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.IDENTITY, engine_identity(index))
            sub.connect(info["back_pub"])
            sub.send(b"\x01")
            poller.register(sub, zmq.POLLIN)
            subs.append(sub)
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(info["back_out"])
            push.send(stats_frame(index, 1, 1))
            pushes.append(push)  # referenced: a collected socket closes at once
        pending = set(range(engines))
        index_of = {sub: i for i, sub in enumerate(subs)}
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            for sock, _ in poller.poll(1000):
                with contextlib.suppress(zmq.Again):
                    while True:
                        if sock.recv_multipart(zmq.NOBLOCK)[0] == b"READY":
                            pending.discard(index_of[sock])
        if pending:
            raise TimeoutError(f"READY reached {engines - len(pending)} of {engines} engines")
        time.sleep(0.5)  # whatever start-up wrote is written
        before = _count_warnings(child.log_path)
        context.destroy(linger=0)  # every engine gone at once
        t0 = time.monotonic()
        child.popen.send_signal(signal.SIGTERM)
        try:
            status: int | None = child.popen.wait(30)
        except subprocess.TimeoutExpired:
            status = None
        exit_s = time.monotonic() - t0 if status is not None else math.inf
        counters = False
        if status is not None and kind != VLLM:
            with contextlib.suppress(RuntimeError, TimeoutError):
                counters = "counters" in child.read_json(5)
        warnings = _count_warnings(child.log_path) - before
    return {
        "engines": engines,
        "status": status,
        "exit_s": exit_s,
        "warnings": warnings,
        "counters_printed": counters,
    }
