"""Shared helpers: clocks, statistics, frames, /proc readings and child processes.

Latencies that cross a process boundary are taken with ``CLOCK_MONOTONIC`` in both
processes (:func:`now_ns`): on Linux it is one system-wide clock, so readings from two
processes on the same machine are directly comparable.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def now_ns() -> int:
    """System-wide monotonic clock, comparable across processes on one machine."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def summarize_us(latencies_ns: Sequence[int]) -> dict[str, float]:
    """p50/p99/max of nanosecond latencies, in microseconds."""
    from trio_dpcoord.sim.cluster_config import percentile  # lazily: see the frames below

    us = [v / 1000.0 for v in latencies_ns]
    return {
        "n": float(len(us)),
        "p50": percentile(us, 50),
        "p99": percentile(us, 99),
        "max": max(us) if us else math.nan,
    }


# --- frames: the real wire bytes, made by the project's codec -------------------------


# trio_dpcoord is imported lazily, so that the baseline process does not carry trio.


def stats_frame(engine: int, waiting: int, step: int, running: int = 4) -> bytes:
    """A stats-only ``EngineCoreOutputs`` (the full 18-key SchedulerStats map, ~500 B)."""
    from trio_dpcoord import protocol

    stats = protocol.SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        step_counter=step,
        current_wave=0,
        kv_cache_usage=0.25,
    )
    return protocol.encode_engine_core_outputs(
        protocol.EngineCoreOutputs(
            engine_index=engine, scheduler_stats=stats, timestamp=time.monotonic()
        )
    )


def start_wave_frame(engine: int, wave: int) -> bytes:
    from trio_dpcoord import protocol

    return protocol.encode_engine_core_outputs(
        protocol.EngineCoreOutputs(engine_index=engine, start_wave=wave, timestamp=time.monotonic())
    )


def wave_complete_frame(wave: int) -> bytes:
    from trio_dpcoord import protocol

    return protocol.encode_engine_core_outputs(
        protocol.EngineCoreOutputs(engine_index=0, wave_complete=wave, timestamp=time.monotonic())
    )


# --- /proc readings ----------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` (libzmq I/O threads included), in ns.

    Read from ``/proc/PID/task/*/sched`` (``se.sum_exec_runtime``, ns precision);
    ``/proc/PID/stat`` only counts 10 ms ticks.
    """
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "sched").read_text().splitlines():
                if line.startswith("se.sum_exec_runtime"):
                    total += float(line.split(":")[1])
                    break
    return int(total * 1e6)


def set_parent_death_signal() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no orphans, even on kill -9)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() == 1:  # the parent is already gone
            os._exit(1)


# --- child processes -------------------------------------------------------------------


class Child:
    """A child process that speaks JSON lines on stdout and takes lines on stdin."""

    def __init__(
        self,
        name: str,
        popen: subprocess.Popen[str],
        log_path: Path,
        stop_signal: signal.Signals = signal.SIGTERM,
    ) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self.stop_signal = stop_signal
        self._selector = selectors.DefaultSelector()
        assert popen.stdout is not None
        self._stdout: IO[str] = popen.stdout
        self._selector.register(self._stdout, selectors.EVENT_READ)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def send_line(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def close_stdin(self) -> None:
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()

    def read_json(self, timeout: float) -> dict[str, Any]:
        """The next stdout line that is a JSON object (other lines are skipped)."""
        while True:
            value = self.read_marked("", timeout)
            if isinstance(value, dict):
                return value

    def read_marked(self, marker: str, timeout: float) -> Any:
        """The JSON value after ``marker`` on the next stdout line that starts with
        ``marker`` followed by JSON (other lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._selector.select(remaining):
                raise TimeoutError(f"{self.name}: no JSON line within {timeout} s{self._tail()}")
            line = self._stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name}: exited ({self.popen.poll()}){self._tail()}")
            line = line.strip()
            if line.startswith(marker) and line[len(marker) : len(marker) + 1] in ("{", "["):
                return json.loads(line[len(marker) :])

    def _tail(self) -> str:
        with contextlib.suppress(OSError):
            text = self.log_path.read_text()[-1500:]
            return f"; stderr tail:\n{text}" if text else ""
        return ""

    def stop(self, timeout: float = 5.0, eof_grace: float = 0.0) -> int | None:
        """Close stdin (give it ``eof_grace`` s to exit), its stop signal (SIGTERM unless
        told otherwise), wait, SIGKILL if needed.

        Always reaped. Returns the exit status.
        """
        self.close_stdin()
        if eof_grace > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(eof_grace)
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(self.stop_signal)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s did not stop on %s: killing it", self.name, self.stop_signal.name
                )
                self.popen.kill()
                self.popen.wait()
        self._selector.close()
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        return self.popen.returncode


@contextlib.contextmanager
def spawn(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    *,
    eof_grace: float = 0.0,
    env: Mapping[str, str] | None = None,
    stop_signal: signal.Signals = signal.SIGTERM,
    cwd: Path = REPO_ROOT,
) -> Iterator[Child]:
    """Start ``argv`` (in ``cwd``, the repository root unless given; environment ``env``
    or ours); stop and reap it when the block ends (``stop_signal`` if stdin's end did
    not stop it)."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        popen = subprocess.Popen(
            list(argv),
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            bufsize=1,
            env=None if env is None else dict(env),
        )
    child = Child(name, popen, log_path, stop_signal)
    try:
        yield child
    finally:
        child.stop(eof_grace=eof_grace)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def procs(role: str, *args: str) -> list[str]:
    """argv of one of this package's helper processes (see :mod:`benchmarks.programs.procs`)."""
    return python_module("benchmarks.programs.procs", role, *args)


def with_death_signal(argv: Sequence[str]) -> list[str]:
    """argv that sets the parent-death signal and then execs ``argv`` (for foreign programs)."""
    return procs("exec", "--", *argv)
