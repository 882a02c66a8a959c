"""A tiny supervising process: the coordinator runs as a worker process it restarts.

``trio-dpcoord serve --supervised`` and the vLLM plugin (``TRIO_DPCOORD_VLLM_SUPERVISED=1``)
run :func:`supervise_worker` in the process their caller started. It starts the worker
(``python -m trio_dpcoord serve`` with the same options and a wave file), relays its
endpoints line once, and when the worker dies without being asked to (a crash, a
SIGKILL) starts a new one on the very same addresses (ipc paths fixed up front, tcp
ports as the first worker resolved them), with the wave file the dead one kept its wave
in: the new coordinator takes over as a restart (docs/protocol.md §16), the engines
reconnect and subscribe again by themselves. The next worker is started ahead, as a
*standby* that has done its imports and waits for a line on its stdin before it binds,
so that a death costs a few tens of milliseconds, not an interpreter's start. More than
``max_restarts`` deaths within ``window`` seconds is a crash loop: the supervisor gives
up with status 1.

It imports nothing but the standard library (no trio, no ZeroMQ, no event loop: a
selector over the worker's stdout and a signal pipe), so there is little in it to fail.
It is not itself protected: killing the supervisor ends the worker too (the worker
stops when its stdin, a pipe the supervisor holds, closes), and whoever started the
supervisor (vLLM, a launcher) sees it gone, as it would see an unsupervised coordinator.
SIGTERM and SIGINT are passed on to the worker; the supervisor then exits with its status.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import IO

__all__ = ["supervise_worker"]

logger = logging.getLogger(__name__)


def _status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


class _Worker:
    """One worker process and the lines of its stdout; a standby until :meth:`go`."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str] | None) -> None:
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        assert self.process.stdout is not None
        self.stdout: IO[bytes] = self.process.stdout
        self._pending = b""
        self.lines: deque[str] = deque()

    def go(self) -> bool:
        """A standby: bind now (False if it is gone already)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(b"go\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return False
        self.started_at = time.monotonic()
        return True

    def read(self) -> bool:
        """Read what its stdout has; False at end of file."""
        data = os.read(self.stdout.fileno(), 65536)
        if not data:
            if self._pending:
                self.lines.append(self._pending.decode(errors="replace"))
                self._pending = b""
            return False
        *lines, self._pending = (self._pending + data).split(b"\n")
        self.lines.extend(line.decode(errors="replace") for line in lines)
        return True

    def close(self) -> int:
        self.stdout.close()
        if self.process.stdin is not None:
            self.process.stdin.close()
        return self.process.wait()


def supervise_worker(
    command: Callable[[Mapping[str, str] | None], list[str]],
    standby: Callable[[Mapping[str, str]], list[str]] | None = None,
    *,
    on_endpoints: Callable[[dict[str, str]], None],
    on_line: Callable[[str], None] = lambda line: None,
    max_restarts: int = 5,
    window: float = 60.0,
    stop_on_stdin_eof: bool = False,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run workers until told to stop; returns the exit status to end with.

    ``command(None)`` is the first worker's command line, ``command(endpoints)`` a
    restarted one's, given the first worker's endpoints (its first stdout line, a JSON
    object: what ``serve`` prints), which also go once to ``on_endpoints``. The lines a
    worker writes after its endpoints go to ``on_line`` (serve's counters line). A
    first worker that dies before its endpoints line ends the supervisor with its
    status (bad options, an address in use); SIGTERM or SIGINT (or, with
    ``stop_on_stdin_eof``, the end of stdin) is passed on and the worker's status
    returned. ``standby(endpoints)``: the command of a worker that binds only once it
    reads a line on stdin (``serve --standby``), started ahead for the next restart.
    """
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    stopping: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    old_wakeup = signal.set_wakeup_fd(wakeup_write)
    selector = selectors.DefaultSelector()
    selector.register(wakeup_read, selectors.EVENT_READ, "signal")
    if stop_on_stdin_eof:
        selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    deaths: deque[float] = deque()
    endpoints: dict[str, str] | None = None
    worker = _Worker(command(None), env)
    spare: _Worker | None = None
    died_at: float | None = None
    try:
        while True:
            selector.register(worker.stdout, selectors.EVENT_READ, "worker")
            forwarded = False
            open_output = True
            while open_output:
                for key, _ in selector.select():
                    if key.data == "signal":
                        os.read(wakeup_read, 512)
                    elif key.data == "stdin":
                        if not os.read(sys.stdin.fileno(), 4096):
                            selector.unregister(sys.stdin.fileno())
                            logger.info("standard input closed: stopping (the parent is gone)")
                            stopping.append(signal.SIGTERM)
                    elif not worker.read():
                        open_output = False
                if stopping and not forwarded:
                    forwarded = True
                    worker.process.send_signal(signal.SIGTERM)
                while worker.lines:
                    line = worker.lines.popleft()
                    if endpoints is None:
                        endpoints = _endpoints(line)
                        on_endpoints(endpoints)
                        logger.info(
                            "coordinator worker (pid %d) serving, supervised (pid %d)",
                            worker.process.pid,
                            os.getpid(),
                        )
                    elif died_at is not None:
                        _told_restart(worker, died_at, deaths, max_restarts, window)
                        died_at = None
                    else:
                        on_line(line)
                    if spare is None and standby is not None and not stopping:
                        spare = _Worker(standby(endpoints), env)
            selector.unregister(worker.stdout)
            returncode = worker.close()
            if stopping or endpoints is None:
                return returncode if returncode >= 0 else 1
            died_at = time.monotonic()
            while deaths and deaths[0] <= died_at - window:
                deaths.popleft()
            if len(deaths) >= max_restarts:
                logger.error(
                    "coordinator worker (pid %d) %s; it died %d times within %g s: giving up",
                    worker.process.pid,
                    _status(returncode),
                    len(deaths) + 1,
                    window,
                )
                return 1
            deaths.append(died_at)
            logger.warning(
                "coordinator worker (pid %d) %s after %.1f s: starting another on the same "
                "addresses",
                worker.process.pid,
                _status(returncode),
                died_at - worker.started_at,
            )
            if spare is not None and spare.go():
                worker, spare = spare, None
            else:
                if spare is not None:
                    spare.close()
                worker, spare = _Worker(command(endpoints), env), None
    finally:
        selector.close()
        signal.set_wakeup_fd(old_wakeup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(wakeup_read)
        os.close(wakeup_write)
        if spare is not None:
            spare.close()  # its stdin closes: a standby exits at once
        if worker.process.poll() is None:  # an exception of our own: never orphan it
            worker.process.kill()
            worker.close()


def _told_restart(
    worker: _Worker, died_at: float, deaths: deque[float], max_restarts: int, window: float
) -> None:
    logger.info(
        "coordinator worker restarted as pid %d: bound the same addresses %.2f s after the "
        "last one died (restart %d within %g s, at most %d); the engines reconnect to it",
        worker.process.pid,
        time.monotonic() - died_at,
        len(deaths),
        window,
        max_restarts,
    )


def _endpoints(line: str) -> dict[str, str]:
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError(f"not an endpoints line: {line!r}")
    return {str(key): str(value) for key, value in record.items()}
