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
so that a death costs a few tens of milliseconds, not an interpreter's start.

**The rule** (:class:`RestartRule`): a crash loop is a worker that cannot serve, not one
that served and died. A worker *served* once it bound its addresses and opened its
start-up gate (READY went out; it says so in its heartbeat). Deaths of workers that never
served count: :data:`MAX_FAILED_STARTS` in a row end the supervisor with status 1 and an
error naming the cause (the last worker's exit status and its last stderr lines); the next
starts at once. A worker that served and died is replaced every time; one that dies within
:data:`QUICK_DEATH` seconds of serving doubles the pause before the next (from 0, then
0.1 s, up to :data:`MAX_PAUSE`), one that served longer resets it.

**The watchdog** (:class:`WorkerWatch`): the worker beats from inside its event loop into
the wave file every 0.1 s (``_heartbeat.py``); a worker silent for longer than
:data:`SILENCE_DEADLINE` (a hung loop, SIGSTOP) or not bound within
:data:`START_DEADLINE` is killed with SIGKILL and replaced like a dead one.

Both rules are plain objects fed clock readings; the loop below only moves bytes. It
imports nothing but the standard library (no trio, no ZeroMQ, no event loop: a selector
over the workers' pipes and a signal pipe), so there is little in it to fail. It is not
itself protected: killing the supervisor ends the worker too (the worker stops when its
stdin, a pipe the supervisor holds, closes), and whoever started the supervisor (vLLM, a
launcher) sees it gone, as it would see an unsupervised coordinator. SIGTERM and SIGINT
are passed on to the worker; the supervisor then exits with its status. The workers'
stderr goes through the supervisor, line by line, to its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Final, cast

from ._heartbeat import read_heartbeat

__all__ = [
    "MAX_FAILED_STARTS",
    "MAX_PAUSE",
    "QUICK_DEATH",
    "RULE",
    "SILENCE_DEADLINE",
    "START_DEADLINE",
    "RestartRule",
    "Verdict",
    "WorkerWatch",
    "supervise_worker",
]

logger = logging.getLogger(__name__)

MAX_FAILED_STARTS: Final = 3
"""Workers in a row that die before they served: the supervisor gives up at this many.
Three, as many as the standbys ready: a start that cannot succeed (a blocked address)
is named within tens of milliseconds, not after cold starts of a second each (vLLM's own
shutdown then takes about 9 s more: measured, docs/failures.md)."""
QUICK_DEATH: Final = 0.25
"""Seconds: a worker that dies sooner after it began to serve doubles the next pause.
(A quarter of a second of serving is its engines' first reports and publishes handled: a
worker that a bug kills at its first input dies well within it, and one killed from
outside a second after its predecessor, which serves about half a second on a loaded
2-core machine, is not paused for: the pause would add to its successor's recovery.)"""
FIRST_PAUSE: Final = 0.1
MAX_PAUSE: Final = 1.0
"""The longest pause before starting the next worker (the pause doubles from 0)."""
START_DEADLINE: Final = 30.0
"""Seconds a started worker has to bind its addresses before it is killed as hung."""
SILENCE_DEADLINE: Final = 3.0
"""Seconds without a heartbeat before the watchdog kills a bound worker. The largest
silence measured between two 0.1 s beats was well under a second (the whole suite, and
serve --supervised under the 1,536-engine overload of the scale benchmark: README.md's
fault table), and a hung worker's pinned request is served within 5 s of the hang."""
RULE: Final = (
    "a worker that served (bound its addresses and opened its gate) and died is replaced "
    f"every time, after a pause doubling from 0 to {MAX_PAUSE:g} s while each dies within "
    f"{QUICK_DEATH:g} s of serving; {MAX_FAILED_STARTS} in a row that die before serving "
    "end the service with the last one's exit status and stderr; a worker silent for "
    f"{SILENCE_DEADLINE:g} s (hung) is killed and replaced"
)
"""The rule in one sentence, for ``--help`` and the docs."""
SPARES: Final = 3
"""Standby workers kept ready (imports done, about 35 MB each). Three, so that in a storm
of deaths a second apart the one that goes has had three seconds for its imports (about
one on a busy 2-core machine, 1.7 s measured under a load of 10), not one."""
_TICK: Final = 0.1
"""Seconds between two looks at the heartbeat."""
_TAIL: Final = 20
"""Stderr lines kept per worker, for the error that names a failed start's cause."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do after a worker died: give up, or start the next after ``pause`` s."""

    give_up: bool
    pause: float
    served: bool
    failed_starts: int
    """Workers in a row, this one included, that died before they served."""


class RestartRule:
    """The crash-loop rule, sans-IO: told each death (with when, if ever, the worker began
    to serve), says whether to give up and how long to pause before the next worker."""

    def __init__(
        self,
        max_failed_starts: int = MAX_FAILED_STARTS,
        *,
        quick_death: float = QUICK_DEATH,
        first_pause: float = FIRST_PAUSE,
        max_pause: float = MAX_PAUSE,
    ) -> None:
        if max_failed_starts < 1:
            raise ValueError(f"max_failed_starts must be >= 1, got {max_failed_starts}")
        self.max_failed_starts = max_failed_starts
        self.quick_death = quick_death
        self.first_pause = first_pause
        self.max_pause = max_pause
        self.failed_starts = 0
        self._pause = 0.0

    def died(self, now: float, served_at: float | None) -> Verdict:
        """A worker died at ``now``; ``served_at``: when it began to serve (None: never)."""
        if served_at is None:  # no pause: five of them end it soon enough
            self.failed_starts += 1
            give_up = self.failed_starts >= self.max_failed_starts
            return Verdict(give_up, 0.0, False, self.failed_starts)
        self.failed_starts = 0
        if now - served_at < self.quick_death:
            return Verdict(False, self._next_pause(), True, 0)
        self._pause = 0.0
        return Verdict(False, 0.0, True, 0)

    def _next_pause(self) -> float:
        pause = self._pause
        self._pause = min(self.max_pause, self.first_pause if pause == 0 else 2 * pause)
        return pause


class WorkerWatch:
    """One worker's watchdog, sans-IO: fed its binding, its heartbeat readings and clock
    readings; :meth:`overdue` says why it must be killed (None: it is fine)."""

    def __init__(
        self,
        now: float,
        *,
        start_deadline: float = START_DEADLINE,
        silence_deadline: float = SILENCE_DEADLINE,
    ) -> None:
        self.started_at = now
        self.start_deadline = start_deadline
        self.silence_deadline = silence_deadline
        self.bound_at: float | None = None
        self.served_at: float | None = None
        self.alive_at = now
        self.longest_silence = 0.0
        """The longest time seen between two changes of its beat counter."""
        self._beats: int | None = None

    def bound(self, now: float, *, serving: bool = False) -> None:
        """It printed its endpoints (``serving``: without a heartbeat, that is serving)."""
        self.bound_at = self.alive_at = now
        if serving:
            self.served_at = now

    def heartbeat(self, beats: int, gate_open: bool, now: float) -> bool:
        """A reading of its record; True when it has just begun to serve."""
        if beats != self._beats:
            if self._beats is not None:
                self.longest_silence = max(self.longest_silence, now - self.alive_at)
            self._beats = beats
            self.alive_at = now
        if gate_open and self.served_at is None and self.bound_at is not None:
            self.served_at = now
            return True
        return False

    def overdue(self, now: float) -> str | None:
        if self.bound_at is None:
            if now - self.started_at > self.start_deadline:
                return f"it did not bind its addresses within {self.start_deadline:g} s"
            return None
        silent = now - self.alive_at
        if self.silence_deadline > 0 and silent > self.silence_deadline:
            return (
                f"its event loop was silent for {silent:.1f} s (no heartbeat; the watchdog's "
                f"deadline is {self.silence_deadline:g} s): hung"
            )
        return None


def _status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


_ERROR_LINE: Final = re.compile(r"error:|Error\b|Exception\b|Crash\b|Traceback")


def _cause(lines: Sequence[str], count: int = 3) -> str:
    """What a worker's stderr says of its death: its last line that tells an error (an
    exception, serve's ``error:`` line), else its last ``count`` lines."""
    telling = [line.strip() for line in lines if line.strip(" +-|=\t")]
    errors = [line for line in telling if _ERROR_LINE.search(line)]
    if errors:
        return errors[-1]
    return " | ".join(telling[-count:]) if telling else "(no stderr output)"


class _Worker:
    """One worker process, its stdout lines and its stderr's last lines; a standby until
    :meth:`go`."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str] | None) -> None:
        self.process = subprocess.Popen(
            list(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        self.stdout: IO[bytes] = self.process.stdout
        self.stderr: IO[bytes] = self.process.stderr
        self._pending = b""
        self._pending_err = b""
        self.lines: deque[str] = deque()
        self.tail: deque[str] = deque(maxlen=_TAIL)
        self.killed_because: str | None = None

    def go(self) -> bool:
        """A standby: bind now (False if it is gone already)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(b"go\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return False
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

    def relay_stderr(self) -> bool:
        """Pass what its stderr has on to ours, whole lines only (the last kept); False
        at end of file."""
        data = os.read(self.stderr.fileno(), 65536)
        if not data:
            if self._pending_err:
                self._write_err(self._pending_err + b"\n")
                self._pending_err = b""
            return False
        *lines, self._pending_err = (self._pending_err + data).split(b"\n")
        if lines:
            self._write_err(b"\n".join(lines) + b"\n")
        return True

    def _write_err(self, data: bytes) -> None:
        self.tail.extend(data.decode(errors="replace").splitlines())
        try:
            sys.stderr.flush()
            os.write(sys.stderr.fileno(), data)
        except (OSError, ValueError):  # nobody reads our stderr: keep the tail anyway
            pass

    def close(self) -> int:
        """Once it exited (or to end it): its status, its stderr read to the end."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        returncode = self.process.wait()
        self.stdout.close()
        while self.relay_stderr():
            pass
        self.stderr.close()
        return returncode


def supervise_worker(
    command: Callable[[Mapping[str, str] | None], list[str]],
    standby: Callable[[Mapping[str, str]], list[str]] | None = None,
    *,
    on_endpoints: Callable[[dict[str, str]], None],
    on_line: Callable[[str], None] = lambda line: None,
    heartbeat_path: str | None = None,
    max_failed_starts: int = MAX_FAILED_STARTS,
    silence_deadline: float = SILENCE_DEADLINE,
    start_deadline: float = START_DEADLINE,
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
    ``heartbeat_path``: the wave file the workers beat in (``_heartbeat.py``); without
    it a worker serves once bound and only the start deadline is watched.
    ``silence_deadline`` 0 turns the watchdog off.
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
    rule = RestartRule(max_failed_starts)
    heartbeat_fd: int | None = None
    longest_silence = 0.0
    endpoints: dict[str, str] | None = None

    def watch(now: float) -> WorkerWatch:
        return WorkerWatch(now, start_deadline=start_deadline, silence_deadline=silence_deadline)

    def start(new: _Worker) -> _Worker:
        selector.register(new.stderr, selectors.EVENT_READ, ("stderr", new))
        return new

    first = start(_Worker(command(None), env))
    worker: _Worker | None = first
    watched = watch(time.monotonic())
    spares: deque[_Worker] = deque()  # standbys, the oldest first
    died_at: float | None = None
    next_at: float | None = None  # when the next worker goes, after a death
    forwarded = False
    try:
        selector.register(first.stdout, selectors.EVENT_READ, ("stdout", first))
        while True:
            now = time.monotonic()
            timeout = _TICK if next_at is None else max(0.0, min(_TICK, next_at - now))
            ended = False
            for key, _ in selector.select(timeout):
                if key.data == "signal":
                    os.read(wakeup_read, 512)
                elif key.data == "stdin":
                    if not os.read(sys.stdin.fileno(), 4096):
                        selector.unregister(sys.stdin.fileno())
                        logger.info("standard input closed: stopping (the parent is gone)")
                        stopping.append(signal.SIGTERM)
                else:
                    pipe, owner = cast("tuple[str, _Worker]", key.data)
                    if pipe == "stderr":
                        if not owner.relay_stderr():
                            selector.unregister(owner.stderr)
                    elif owner is worker and not owner.read():
                        ended = True
            now = time.monotonic()
            if stopping and not forwarded:
                forwarded = True
                if worker is None:  # between two workers: nothing to stop
                    return 0
                worker.process.send_signal(signal.SIGTERM)
            if worker is None:
                assert next_at is not None and endpoints is not None
                if now < next_at:
                    continue
                worker = None
                while spares and worker is None:
                    spare = spares.popleft()
                    if spare.go():
                        worker = spare
                    else:  # it died waiting
                        _end(selector, spare)
                if worker is None:
                    worker = start(_Worker(command(endpoints), env))
                while standby is not None and len(spares) < SPARES:  # imports meanwhile
                    spares.append(start(_Worker(standby(endpoints), env)))
                selector.register(worker.stdout, selectors.EVENT_READ, ("stdout", worker))
                watched, next_at = watch(now), None
                continue
            while worker.lines:
                line = worker.lines.popleft()
                if endpoints is None:
                    endpoints = _endpoints(line)
                    on_endpoints(endpoints)
                    watched.bound(now, serving=heartbeat_path is None)
                    logger.info(
                        "coordinator worker (pid %d) serving, supervised (pid %d)",
                        worker.process.pid,
                        os.getpid(),
                    )
                elif watched.bound_at is None:
                    watched.bound(now, serving=heartbeat_path is None)
                    assert died_at is not None
                    logger.info(
                        "coordinator worker restarted as pid %d: bound the same addresses "
                        "%.2f s after the last one died; the engines reconnect to it",
                        worker.process.pid,
                        now - died_at,
                    )
                else:
                    on_line(line)
                while standby is not None and len(spares) < SPARES and not stopping:
                    spares.append(start(_Worker(standby(endpoints), env)))
            if heartbeat_path is not None and watched.bound_at is not None:
                if heartbeat_fd is None:
                    heartbeat_fd = _open_quietly(heartbeat_path)
                beat = None if heartbeat_fd is None else read_heartbeat(heartbeat_fd)
                began = (
                    beat is not None
                    and beat.pid == worker.process.pid
                    and watched.heartbeat(beat.beats, beat.gate_open, now)
                )
                if began:
                    logger.info(
                        "coordinator worker (pid %d) serving: its gate opened%s",
                        worker.process.pid,
                        "" if died_at is None else f" {now - died_at:.2f} s after the last died",
                    )
            reason = watched.overdue(now)
            if reason is not None and worker.killed_because is None and not stopping:
                worker.killed_because = reason
                logger.error(
                    "coordinator worker (pid %d): %s; killing it (SIGKILL) to replace it",
                    worker.process.pid,
                    reason,
                )
                worker.process.kill()
            if not ended:
                continue
            selector.unregister(worker.stdout)
            if _registered(selector, worker.stderr):
                selector.unregister(worker.stderr)
            returncode = worker.close()
            longest_silence = max(longest_silence, watched.longest_silence)
            dead, worker = worker, None
            if stopping:
                if heartbeat_path is not None:
                    logger.info(
                        "watchdog: the longest silence of a worker's event loop seen was "
                        "%.2f s (deadline %g s)",
                        longest_silence,
                        silence_deadline,
                    )
                return returncode if returncode >= 0 else 1
            if endpoints is None:
                logger.error(
                    "coordinator worker (pid %d) %s before it bound its addresses: giving up; "
                    "its stderr said: %s",
                    dead.process.pid,
                    _status(returncode),
                    _cause(dead.tail),
                )
                return returncode if returncode > 0 else 1
            died_at = now
            verdict = rule.died(now, watched.served_at)
            how = _status(returncode)
            if dead.killed_because is not None:
                how += f" (the watchdog: {dead.killed_because})"
            elif returncode > 0:
                how += f"; its stderr said: {_cause(dead.tail)};"
            if verdict.give_up:
                logger.error(
                    "coordinator worker (pid %d) %s before it served, %d workers in a row: a "
                    "crash loop, giving up",
                    dead.process.pid,
                    how,
                    verdict.failed_starts,
                )
                return 1
            served = (
                f"after serving {now - watched.served_at:.1f} s"
                if watched.served_at is not None
                else f"before it served ({verdict.failed_starts} of {rule.max_failed_starts} in "
                "a row)"
            )
            logger.warning(
                "coordinator worker (pid %d) %s %s: starting another on the same addresses%s",
                dead.process.pid,
                how,
                served,
                f" in {verdict.pause:.1f} s" if verdict.pause > 0 else "",
            )
            next_at = now + verdict.pause
    finally:
        selector.close()
        signal.set_wakeup_fd(old_wakeup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(wakeup_read)
        os.close(wakeup_write)
        if heartbeat_fd is not None:
            os.close(heartbeat_fd)
        for spare in spares:
            # A standby has bound nothing: killed, not asked (one still importing reads
            # its stdin only once its imports are done, which would hold up our exit,
            # and with it the caller's word that the coordinator is gone, by a second).
            if spare.process.poll() is None:
                spare.process.kill()
            _end(None, spare)
        if worker is not None and worker.process.poll() is None:  # ours failed: no orphan
            worker.process.kill()
            worker.close()


def _registered(selector: selectors.BaseSelector, pipe: IO[bytes]) -> bool:
    try:
        selector.get_key(pipe)
    except KeyError:
        return False
    return True


def _end(selector: selectors.BaseSelector | None, worker: _Worker) -> None:
    """A standby not needed (or gone): close its stdin (it exits) and reap it."""
    if selector is not None and _registered(selector, worker.stderr):
        selector.unregister(worker.stderr)
    worker.close()


def _open_quietly(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def _endpoints(line: str) -> dict[str, str]:
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError(f"not an endpoints line: {line!r}")
    return {str(key): str(value) for key, value in record.items()}
