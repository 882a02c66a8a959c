"""A coordinator that survives its own death: its pumps restarted in place, a new core in
recovering mode (docs/protocol.md §16).

:func:`open_coordinator` runs its pumps (the tasks that feed the core and carry out what
it decides) under :func:`supervise`, in a nursery of their own. When one of them fails
(a broken invariant of our own: the core or a pump raised), the others are cancelled
and, within the restart budget, the failed core is replaced by a new one in recovering
mode: :meth:`~trio_dpcoord.core.CoordinatorCore.restarted` with what the failed one
still shows (its wave as a floor, the live subscriptions and the open gate, which the
kept sockets will not report again, its loads). The sockets stay bound and connected,
so engines and front-ends see no disconnection and the application's block, its handle
and whatever it streams do not fail. What the failed core had decided and not yet sent
is dropped (the recovery wake covers it); what the pumps had read and not yet applied is
applied by the new core, but the message being handled when the failure came, which may
be its cause.

Each restart is counted (:class:`RestartStatistics`, ``Coordinator.restarts()``) and told
in one INFO line: how long the engines were without a coordinator and what was rebuilt;
the failure itself is logged at ERROR with its traceback. More than ``max_restarts``
failures within :data:`RESTART_WINDOW` seconds is a crash loop: the service stops with
:class:`~trio_dpcoord.CoordinatorError` as it would without supervision.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import struct
import sys
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import trio

from .._heartbeat import HeartbeatWriter
from ..core import Broadcast, CoordinatorCore, Effect, Recovery


class Restartable(Protocol):
    """What a restart needs of the coordinator's pumps (``pumps.Pumps``): a
    protocol, so that this module and the coordinator's do not import each other."""

    core: CoordinatorCore
    lock: threading.Lock
    ready: trio.Event
    fault: str | None
    timer_scope: trio.CancelScope | None

    def drop_undelivered(self) -> int: ...

    def dispatch(self, effects: Sequence[Effect]) -> bool: ...

    def changed(self) -> None: ...


if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "CRASH_VARIABLE",
    "HEARTBEAT_INTERVAL",
    "RESTART_WINDOW",
    "InjectedCrash",
    "RestartLog",
    "RestartStatistics",
    "WaveFile",
    "inject_failure",
    "keep_heartbeat",
    "recovery_from",
    "restart_pumps",
    "supervise",
]

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL: Final = 0.1
"""Seconds between two heartbeats of a supervised worker (one store into its wave file)."""

CRASH_VARIABLE: Final = "TRIO_DPCOORD_INJECT_CRASH"
"""A testing hook, off when unset: ``worker:SECONDS`` makes the first worker process on
a wave file raise :class:`InjectedCrash` in its event loop that many seconds after its gate
opened (the process dies of it; its supervisor replaces it); ``worker:/PATH``, any worker
once a file appears at PATH (it removes it: one crash per file); ``pump:...`` raises an
``AssertionError`` inside the coordinator's engine-output pump instead (the service is
restarted in place)."""

RESTART_WINDOW: Final = 60.0
"""Seconds over which ``max_restarts`` is counted: more failures than that is a loop."""


@dataclass(frozen=True, slots=True)
class RestartStatistics:
    """How often the coordinator was restarted after a failure, and what it cost."""

    restarts: int
    """Restarts in place since the coordinator started."""
    seconds_without_coordinator: float
    """In all: from each failure until the new core's pumps ran."""
    last_failure: str | None
    """The latest failure, as ``Type: message``."""
    last_restart_at: float | None
    """The clock reading (``trio.current_time()``) of the latest restart."""
    process_restarts: int = 0
    """Coordinator processes that ran before this one on the same wave file and died
    (``serve --supervised`` restarted this process in their place)."""


class RestartLog:
    """The restarts so far and the crash-loop budget (what :class:`RestartStatistics` copies)."""

    def __init__(self, max_restarts: int) -> None:
        if type(max_restarts) is not int or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        self.max_restarts = max_restarts
        self._recent: deque[float] = deque()
        self._restarts = 0
        self._down = 0.0
        self._last_failure: str | None = None
        self._last_restart_at: float | None = None
        self.process_restarts = 0

    def allow(self, failed_at: float) -> bool:
        """A failure at ``failed_at``: whether one more restart is within the budget."""
        recent = self._recent
        while recent and recent[0] <= failed_at - RESTART_WINDOW:
            recent.popleft()
        if len(recent) >= self.max_restarts:
            return False
        recent.append(failed_at)
        return True

    def restarted(self, failure: str, failed_at: float, up_at: float) -> None:
        self._restarts += 1
        self._down += max(0.0, up_at - failed_at)
        self._last_failure = failure
        self._last_restart_at = up_at

    def counters(self) -> RestartStatistics:
        return RestartStatistics(
            self._restarts,
            self._down,
            self._last_failure,
            self._last_restart_at,
            self.process_restarts,
        )


class WaveFile:
    """The coordinator's wave kept in a small memory-mapped file, for the process that
    takes over if this one dies (``serve --supervised``, docs/protocol.md §16).

    Kept before anything newer goes out (the pumps call :meth:`keep` as they hand
    effects to the broadcaster), so it is never behind what an engine or a front-end
    saw; the kernel keeps the page when the process is killed, even by SIGKILL. Layout:
    8 bytes of magic, the wave, the number of processes that started on it (little-endian
    uint64s; one aligned store each). Meant for one fleet's lifetime: a file left from
    another fleet would hand its wave to engines that restarted at 0.
    """

    _MAGIC: Final = b"trdpwav1"
    _SIZE: Final = 24

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < self._SIZE:
                os.ftruncate(fd, self._SIZE)
            self._map = mmap.mmap(fd, self._SIZE)
        finally:
            os.close(fd)
        self.path = path
        valid = self._map[:8] == self._MAGIC
        self.previous_wave: int | None = None
        """The wave the previous process had reached (None: this is the first)."""
        starts = 0
        if valid:
            self.previous_wave, starts = struct.unpack_from("<QQ", self._map, 8)
        self.starts: int = starts + 1
        """Processes started on this file, this one included."""
        self._kept = self.previous_wave if valid else 0
        struct.pack_into("<QQ", self._map, 8, self._kept, self.starts)
        self._map[:8] = self._MAGIC

    def keep(self, wave: int) -> None:
        """The coordinator is about to send something decided at ``wave``."""
        if wave != self._kept:
            struct.pack_into("<Q", self._map, 8, wave)
            self._kept = wave

    def close(self) -> None:
        self._map.close()


def recovery_from(failed: CoordinatorCore, gate_open: bool) -> tuple[Recovery, str]:
    """What a failed core still shows, for its successor on the same sockets, and a
    description for the log. ``gate_open``: READY went out (the shell's own record, used
    if the failed core cannot even be read)."""
    try:
        snap = failed.snapshot()
        view = failed.subscriptions()
        recovery = Recovery(
            wave=snap.current_wave,
            subscriptions=view.current,
            gate_open=view.gate_open,
            front_ends=view.front_ends,
            loads=failed.engine_loads(),
        )
    except Exception:  # a broken core: take what the shell knows
        logger.exception("the failed coordinator core cannot be read")
        engines = failed.expected_engines if gate_open else 0
        recovery = Recovery(subscriptions=engines, gate_open=gate_open)
    wave = "unknown" if recovery.wave is None else f"{recovery.wave}"
    return recovery, (
        f"wave {wave}, {recovery.subscriptions} engine subscriptions, the gate "
        f"{'open' if recovery.gate_open else 'closed'}, {len(recovery.loads)} engine loads"
    )


def restart_pumps(pumps: Restartable, new_core: CoordinatorCore) -> str:
    """After a failure, with every pump stopped: ``new_core`` takes over from the failed
    one in recovering mode; what the failed one decided and nobody sent is dropped.
    Returns what was rebuilt, for the log."""
    dropped = pumps.drop_undelivered()
    with pumps.lock:
        recovery, rebuilt = recovery_from(pumps.core, pumps.ready.is_set())
        pumps.core = new_core
        effects = new_core.restarted(recovery, trio.current_time())
        pumps.dispatch(effects)
    pumps.changed()
    for effect in effects:
        if isinstance(effect, Broadcast) and effect.wave_start is not None:
            rebuilt += f"; woke the engines at wave {effect.wave_start.wave}"
    return rebuilt + f"; {dropped} undelivered decisions dropped"


def inject_failure(pumps: Restartable, where: str) -> None:
    """Make the pump ``where`` raise as a broken invariant of ours would, under the lock:
    ``timer`` at once, ``engine_output`` as it applies its next batch (whose first
    message is then lost). For tests (``testing.inject_coordinator_failure``)."""
    if where not in ("timer", "engine_output"):
        raise ValueError(f"no failure can be injected in {where!r}")
    pumps.fault = where
    if where == "timer" and pumps.timer_scope is not None:
        pumps.timer_scope.deadline = -math.inf


async def supervise(
    start_pumps: Callable[[trio.Nursery], Awaitable[None]],
    restart: Callable[[], str],
    log: RestartLog,
    closed: Callable[[], bool],
    changed: Callable[[], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the pumps (``start_pumps`` starts them in the nursery it is given) until
    cancelled; after a failure, ``restart()`` (which swaps the core, under the lock, and
    describes what it rebuilt) and run them again, while ``log`` allows it (``changed()``
    tells the handle's observers once it counted one). Started once the first pumps run;
    a failure to start them, a failure once ``closed()`` (the service is stopping) or past
    the budget propagates."""
    started = False
    pending: tuple[str, float, str] | None = None  # (failure, failed at, what was rebuilt)
    while True:
        try:
            async with trio.open_nursery() as nursery:
                await start_pumps(nursery)
                if not started:
                    started = True
                    task_status.started()
                if pending is not None:
                    failure, failed_at, rebuilt = pending
                    pending = None
                    up_at = trio.current_time()
                    log.restarted(failure, failed_at, up_at)
                    logger.info(
                        "coordinator restarted in place after %s: the engines were without a "
                        "coordinator for %.1f ms; rebuilt from the failed one: %s "
                        "(restart %d, at most %d per %g s)",
                        failure,
                        (up_at - failed_at) * 1000.0,
                        rebuilt,
                        log.counters().restarts,
                        log.max_restarts,
                        RESTART_WINDOW,
                    )
                    changed()
        except BaseExceptionGroup as group:
            failures = group.split(lambda e: isinstance(e, trio.Cancelled))[1]
            if failures is None or not started or closed():
                raise
            failed_at = trio.current_time()
            failure = _describe(failures)
            if not log.allow(failed_at):
                logger.error(
                    "coordinator failed %d times within %g s, the last time with %s: "
                    "not restarting it again",
                    log.max_restarts + 1,
                    RESTART_WINDOW,
                    failure,
                )
                raise
            logger.error("coordinator failed (%s): restarting it in place", failure, exc_info=group)
            pending = (failure, failed_at, restart())


def _describe(group: BaseExceptionGroup[BaseException]) -> str:
    """``Type: message`` of the first leaf of ``group``."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


class InjectedCrash(AssertionError):
    """A broken invariant raised on purpose (:data:`CRASH_VARIABLE`)."""


def _crash_plan(value: str | None) -> tuple[str, float | str] | None:
    """``CRASH_VARIABLE``'s value as (where, seconds after the gate opened, or the path
    whose appearance triggers it); None when unset."""
    if not value:
        return None
    where, _, when = value.partition(":")
    if where not in ("worker", "pump"):
        raise ValueError(f"{CRASH_VARIABLE}={value!r}: expected worker:WHEN or pump:WHEN")
    if when.startswith("/"):
        return where, when
    try:
        delay = float(when or "0")
    except ValueError:
        delay = -1.0
    if not delay >= 0:
        raise ValueError(f"{CRASH_VARIABLE}={value!r}: WHEN is seconds or an absolute path")
    return where, delay


def _crash_due(plan: tuple[str, float | str], opened_at: float, now: float) -> bool:
    """Whether the planned crash is due; a trigger file is consumed (one crash per file)."""
    when = plan[1]
    if isinstance(when, float):
        return now >= opened_at + when
    try:
        os.unlink(when)
    except OSError:
        return False
    return True


async def keep_heartbeat(
    path: str,
    gate_open: Callable[[], bool],
    first_process: bool,
    inject_in_pump: Callable[[], None],
    *,
    wait_gate_open: Callable[[], Awaitable[None]] | None = None,
    interval: float = HEARTBEAT_INTERVAL,
) -> None:
    """A supervised worker's heartbeat (``_heartbeat.py``), from a task of its own event
    loop, once per ``interval`` until cancelled: a loop that stops running (a hang, a
    task that never yields, SIGSTOP) stops it, and the supervisor's watchdog replaces the
    worker. Also carries out :data:`CRASH_VARIABLE` in the first process on the file
    (``first_process``); ``inject_in_pump`` makes the engine-output pump fail.

    ``wait_gate_open`` (returns once the start-up gate is open): the beat that says so
    goes out at once, not up to ``interval`` later, so that a worker killed right after
    it began to serve is judged by the supervisor as one that served (a crash loop
    counts only workers that never did)."""
    plan = _crash_plan(os.environ.get(CRASH_VARIABLE))
    if plan is not None and isinstance(plan[1], float) and not first_process:
        plan = None  # after a delay: the first process only, or every one would crash
    writer = HeartbeatWriter(path, interval)
    opened_at: float | None = None
    try:
        while True:
            now = trio.current_time()
            opened = gate_open()
            writer.beat(now, opened)
            if plan is not None and opened:
                opened_at = now if opened_at is None else opened_at
                if _crash_due(plan, opened_at, now):
                    where, plan = plan[0], None
                    logger.warning("%s: injecting a crash in the %s now", CRASH_VARIABLE, where)
                    if where == "worker":
                        raise InjectedCrash(f"a broken invariant injected ({CRASH_VARIABLE})")
                    inject_in_pump()
            if wait_gate_open is not None and not opened:
                with trio.move_on_after(interval):
                    await wait_gate_open()
            else:
                await trio.sleep(interval)
    finally:
        if writer.longest_silence > 0:
            logger.info(
                "event loop: the longest silence between two heartbeats was %.3f s",
                writer.longest_silence,
            )
        writer.close()
