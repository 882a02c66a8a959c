"""A whole simulated cluster: coordinator, front-end, N engine processes and a load.

:func:`run_cluster` is what ``examples/launch_cluster.py`` runs, and what tests and
benchmarks reuse. Two modes:

* ``inproc``: the front-end embeds :func:`trio_dpcoord.open_coordinator`;
* ``standalone``: ``python -m trio_dpcoord serve`` runs in its own process and the
  front-end follows it with :func:`trio_dpcoord.open_frontend`.

Engines are ``python -m trio_dpcoord.sim engine`` processes, one per DP rank, each in
its own session (a terminal's Ctrl-C reaches only the launcher, which stops them in
order) and each watching its stdin: if the launcher dies, the pipe closes and every
engine exits, so no orphan survives. Every child is reaped before :func:`run_cluster`
returns or raises, Ctrl-C and cancellation included.

An engine process that exits unexpectedly is reported by rank, pid and wave and ends the
run; with ``ClusterConfig.restart_vanished`` a new process is started for the rank
instead, the requests stranded on it are resubmitted once it is back, and the run goes
on. An engine that exits because its collective timed out ends the run too: its DP
group is broken (a peer died mid-wave, or a partition outlasted the collective timeout);
with ``restart_vanished`` the whole group is restarted instead, as a real DP deployment
must, and every request in flight is resubmitted. An engine that exits for another
failure it names (an invalid broadcast, a lost coordinator) is never restarted. Likewise
a standalone coordinator process that vanishes ends the run, or with
``restart_vanished`` is started again on the same addresses (the engines and the
front-end reconnect on their own).

Across hosts: ``ClusterConfig.host`` makes every socket TCP on that address (the
coordinator with ``--allow-remote``), ``engine_prefix`` and ``coordinator_prefix`` start
processes through a command prefix (``ip netns exec NODE``, ``ssh NODE``),
``collective_address`` is where rank 0 hosts the collective.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import trio

from .. import CoordinatorView, PrivateIpcDirectory, open_coordinator, open_frontend
from ..testing import ServeProcess, open_serve, read_lines
from .engine import DIAGNOSED_EXIT_STATUSES, EXIT_COLLECTIVE_TIMEOUT
from .frontend import LoadPlan, SimFrontend, WakePath, generate_load, open_sim_frontend
from .frontend import percentile as _percentile
from .timeline import Timeline

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "ClusterConfig",
    "ClusterReport",
    "EmbeddedCoordinator",
    "Mode",
    "Progress",
    "open_engine_fleet",
    "run_cluster",
]

logger = logging.getLogger(__name__)

Mode = Literal["inproc", "standalone"]
_COLLECTIVE_TIMEOUT_MARK = "collective timeout"


class _Counters(Protocol):
    @property
    def errors(self) -> int: ...


class EmbeddedCoordinator(CoordinatorView, Protocol):
    """What ``inproc`` mode needs from the embedded coordinator (``open_coordinator``'s
    handle, or a test's stand-in)."""

    @property
    def engine_input_address(self) -> str: ...

    @property
    def engine_output_address(self) -> str: ...

    async def wait_ready(self) -> None: ...

    def counters(self) -> _Counters: ...

    def expect_shutdown(self) -> None: ...


CoordinatorFactory = Callable[[int], AbstractAsyncContextManager[EmbeddedCoordinator]]


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """How to run the cluster; the defaults are the launcher's."""

    engines: int = 4
    mode: Mode = "inproc"
    wake_path: WakePath = "both"
    load: LoadPlan = field(default_factory=LoadPlan)
    step_time: float = 0.002
    max_running: int = 8
    sync_interval: int = 16
    collective_timeout: float = 10.0
    ready_timeout: float = 30.0
    stall_timeout: float | None = None
    """Fail when requests are pending and none finished for this long (default: twice
    the collective timeout plus 5 s)."""
    engine_log_level: str = "WARNING"
    restart_vanished: bool = False
    """Restart an engine process that exits unexpectedly (after reporting it) and resubmit
    its in-flight requests, the whole DP group when its collective timed out, and a
    standalone coordinator on the same addresses, instead of ending the run."""
    host: str | None = None
    """Bind the front-end's sockets (and the coordinator's, with ``--allow-remote``) on
    ``tcp://HOST`` instead of private ipc paths: engines may run on other hosts."""
    engine_prefix: tuple[tuple[str, ...], ...] = ()
    """Per rank, a command prefix for its engine process (e.g. ``("ip", "netns", "exec",
    "node1")``); ranks beyond the tuple run directly."""
    coordinator_prefix: tuple[str, ...] = ()
    """A command prefix for the standalone coordinator's process."""
    collective_address: str | None = None
    """Where rank 0 hosts the collective (default: a private ipc path)."""
    coordinator_args: tuple[str, ...] = ()
    """Extra options for ``trio-dpcoord serve`` in standalone mode (they come last)."""
    record_timeline: bool = False
    """Record engine states, wake-ups and requests in flight (:attr:`ClusterReport.timeline`)."""

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("engines must be >= 1")
        if self.mode not in ("inproc", "standalone"):
            raise ValueError(f"mode must be inproc or standalone, got {self.mode!r}")


@dataclass(slots=True)
class ClusterReport:
    """The outcome of one run; :attr:`ok` decides the launcher's exit status."""

    mode: str
    engines: int
    wake_path: str
    seed: int
    planned: int
    requests: int = 0
    completed: int = 0
    waves: int = 0
    coordinator_errors: int = 0
    frontend_errors: int = 0
    wave_regressions: int = 0
    notifications: int = 0
    pauses: int = 0
    collective_timeouts: list[str] = field(default_factory=list)
    engine_failures: list[str] = field(default_factory=list)
    engine_restarts: list[str] = field(default_factory=list)
    """Vanished engines that were restarted (``restart_vanished``): reported, not errors."""
    group_restarts: list[str] = field(default_factory=list)
    """With ``restart_vanished``, the collective timeouts that made the whole DP group
    restart (reported, not errors; without it they are in ``collective_timeouts``)."""
    coordinator_restarts: list[str] = field(default_factory=list)
    """A vanished standalone coordinator restarted (``restart_vanished``): not errors."""
    wave_resets: int = 0
    """The front-end saw a restarted coordinator start at a lower wave (not an error)."""
    resubmitted: int = 0
    failures: list[str] = field(default_factory=list)
    wake_latencies: list[float] = field(default_factory=list)
    engine_pids: list[int] = field(default_factory=list)
    coordinator_pid: int | None = None
    duration: float = 0.0
    timeline: Timeline | None = None
    """What the front-end saw over time, with ``ClusterConfig.record_timeline``."""

    @property
    def errors(self) -> int:
        return (
            self.coordinator_errors
            + self.frontend_errors
            + self.wave_regressions
            + len(self.engine_failures)
            + len(self.failures)
        )

    @property
    def ok(self) -> bool:
        """Every planned request sent, every sent request completed (a fault-injection hook
        may send more), no collective timed out, no error counted."""
        return (
            self.requests >= self.planned
            and self.completed == self.requests
            and not self.collective_timeouts
            and self.errors == 0
        )

    def wake_latency_ms(self) -> dict[str, float | int | None]:
        def ms(q: float) -> float | None:
            value = _percentile(self.wake_latencies, q)
            return None if math.isnan(value) else round(value * 1000.0, 3)

        return {
            "p50": ms(50),
            "p99": ms(99),
            "max": ms(100),
            "count": len(self.wake_latencies),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "mode": self.mode,
            "engines": self.engines,
            "wake_path": self.wake_path,
            "seed": self.seed,
            "requests": self.requests,
            "completed": self.completed,
            "waves": self.waves,
            "errors": self.errors,
            "coordinator_errors": self.coordinator_errors,
            "collective_timeouts": list(self.collective_timeouts),
            "engine_failures": list(self.engine_failures),
            "engine_restarts": list(self.engine_restarts),
            "group_restarts": list(self.group_restarts),
            "coordinator_restarts": list(self.coordinator_restarts),
            "resubmitted": self.resubmitted,
            "failures": list(self.failures),
            "wave_regressions": self.wave_regressions,
            "wave_resets": self.wave_resets,
            "frontend_notifications": self.notifications,
            "pauses": self.pauses,
            "wake_latency_ms": self.wake_latency_ms(),
            "duration_s": round(self.duration, 3),
        }


@dataclass(frozen=True, slots=True)
class Progress:
    """A live view for progress displays."""

    completed: int
    total: int
    sent: int
    wave: int
    running: bool
    engine_pending: tuple[int, ...]
    engine_running: tuple[bool, ...]
    engine_pids: tuple[int, ...] = ()
    """The engine processes by rank (for tools that inject faults)."""
    coordinator_pid: int | None = None
    """The standalone coordinator process."""


def _child_environment() -> dict[str, str]:
    """Our environment, with this very ``trio_dpcoord`` first on the children's path: the
    engines and the coordinator process run the same code as the launcher, installed or
    not."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent.parent)
    if root not in sys.path:  # imported from a checkout by path, not installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _default_log_line(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class _Fleet:
    """The engine processes: spawned, watched, and always reaped."""

    def __init__(
        self,
        report: ClusterReport,
        log_line: Callable[[str], None],
        frontend: SimFrontend | None = None,
        *,
        command: Callable[[int], list[str]] | None = None,
        restart_vanished: bool = False,
    ) -> None:
        self.report = report
        self.frontend = frontend
        self.processes: list[trio.Process] = []
        self.stopping = False
        self.on_failure: Callable[[], None] = lambda: None
        self._log_line = log_line
        self._command = command
        self._restart_vanished = restart_vanished
        self._nursery: trio.Nursery | None = None
        self._retiring: set[trio.Process] = set()
        """Processes stopped on purpose by a group restart: their exit is no news."""

    async def spawn(self, rank: int, nursery: trio.Nursery | None = None) -> trio.Process:
        """Start the engine process of ``rank`` and watch it."""
        if nursery is not None:
            self._nursery = nursery
        assert self._command is not None and self._nursery is not None
        process = await trio.lowlevel.open_process(
            self._command(rank),
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=_child_environment(),
        )
        self.processes.append(process)
        if rank < len(self.report.engine_pids):
            self.report.engine_pids[rank] = process.pid
        else:
            self.report.engine_pids.append(process.pid)
        assert process.stderr is not None
        self._nursery.start_soon(self.forward_stderr, rank, process.stderr)
        self._nursery.start_soon(self.watch, rank, process)
        return process

    def _restartable(self, rank: int, code: int) -> bool:
        # Not a failure the engine diagnosed itself, and the rank had come up since its
        # last start (a process that dies before READY would only die again).
        return (
            self._restart_vanished
            and not self.stopping
            and self.frontend is not None
            and self._nursery is not None
            and code not in DIAGNOSED_EXIT_STATUSES
            and self.frontend.engine_ready[rank]
        )

    async def watch(self, rank: int, process: trio.Process) -> None:
        code = await process.wait()
        if process in self._retiring:
            self._retiring.discard(process)
            return
        if (
            code == EXIT_COLLECTIVE_TIMEOUT
            and self._restart_vanished
            and not self.stopping
            and self.frontend is not None
        ):
            await self._restart_group(rank, process.pid)
            return
        if not self.stopping:
            # Which wave the rank was in, from its last status event at the front-end.
            where = "before its first wave"
            if self.frontend is not None:
                wave = self.frontend.engine_wave[rank]
                if self.frontend.engine_running[rank]:
                    where = f"during wave {wave}"
                elif wave or 0 in self.frontend.waves_completed:
                    where = f"idle after wave {wave}"
            status = f"status {code}"
            if code < 0:
                status += f" ({signal.Signals(-code).name})"
            message = (
                f"engine {rank} (pid {process.pid}) vanished {where}: rank {rank} "
                f"exited with {status}"
            )
            if self._restartable(rank, code):
                assert self.frontend is not None and self._nursery is not None
                self.report.engine_restarts.append(message)
                logger.error("%s; restarting it", message)
                self.frontend.engine_lost(rank)
                new = await self.spawn(rank)
                logger.warning("engine %d restarted as pid %d", rank, new.pid)
                self._nursery.start_soon(self.frontend.resubmit_lost)
                return
            self.report.engine_failures.append(message)
            logger.error("%s", message)
            self.on_failure()

    async def _restart_group(self, rank: int, pid: int) -> None:
        """Rank ``rank``'s collective timed out: stop every other rank, start the whole
        group again, resubmit every request in flight once all ranks are back."""
        assert self.frontend is not None and self._nursery is not None
        ranks = range(len(self.report.engine_pids))
        logger.error(
            "engine %d (pid %d) exited after its collective timed out: the DP group is "
            "broken; restarting all %d ranks",
            rank,
            pid,
            len(ranks),
        )
        pids = set(self.report.engine_pids)
        others = [p for p in self.processes if p.returncode is None and p.pid in pids]
        self._retiring.update(others)
        await _reap(others, grace=0.0)
        for other in ranks:
            self.frontend.engine_lost(other)
        for other in ranks:
            await self.spawn(other)
        logger.warning("DP group restarted: pids %s", self.report.engine_pids)
        self._nursery.start_soon(self.frontend.resubmit_lost)

    async def forward_stderr(self, rank: int, stream: trio.abc.ReceiveStream) -> None:
        async for line in read_lines(stream):
            self._line(line.rstrip())

    def _line(self, line: str) -> None:
        if _COLLECTIVE_TIMEOUT_MARK in line and "trio_dpcoord.sim engine rank" in line:
            if self._restart_vanished and self.frontend is not None:
                self.report.group_restarts.append(line)
            else:
                self.report.collective_timeouts.append(line)
        self._log_line(line)

    async def stop(self) -> None:
        """Close every engine's stdin (they exit on EOF), then terminate, then kill."""
        self.stopping = True
        for process in self.processes:
            if process.stdin is not None:
                await process.stdin.aclose()
        await _reap(self.processes, grace=5.0)


async def _reap(processes: list[trio.Process], *, grace: float) -> None:
    """Wait ``grace`` s for ``processes`` to exit, then SIGTERM, then SIGKILL; reap all."""
    with trio.move_on_after(grace):
        for process in processes:
            await process.wait()
    for process in processes:
        if process.returncode is None:
            process.terminate()
    with trio.move_on_after(2.0):
        for process in processes:
            await process.wait()
    for process in processes:
        if process.returncode is None:
            process.kill()
            await process.wait()


def engine_command(config: ClusterConfig, rank: int, addresses: Sequence[str]) -> list[str]:
    """The command line of rank ``rank``'s engine process: ``config``'s step model and
    prefix, and ``addresses`` (the ``--...-address`` options of its sockets)."""
    prefix = config.engine_prefix[rank] if rank < len(config.engine_prefix) else ()
    command = [
        *prefix,
        sys.executable,
        "-m",
        "trio_dpcoord.sim",
        "engine",
        f"--rank={rank}",
        f"--engines={config.engines}",
        *addresses,
        f"--step-time={config.step_time}",
        f"--max-running={config.max_running}",
        f"--sync-interval={config.sync_interval}",
        f"--collective-timeout={config.collective_timeout}",
        f"--log-level={config.engine_log_level}",
        "--exit-on-stdin-eof",
    ]
    if config.wake_path == "frontend":
        command.append("--legacy-wake")
    return command


@asynccontextmanager
async def _engine_fleet(
    config: ClusterConfig,
    *,
    coordinator_input: str,
    coordinator_output: str,
    frontend: SimFrontend,
    collective_address: str,
    report: ClusterReport,
    log_line: Callable[[str], None],
) -> AsyncIterator[_Fleet]:
    def command(rank: int) -> list[str]:
        return engine_command(
            config,
            rank,
            [
                f"--coordinator-input={coordinator_input}",
                f"--coordinator-output={coordinator_output}",
                f"--request-address={frontend.request_address}",
                f"--completion-address={frontend.completion_address}",
                f"--collective-address={collective_address}",
            ],
        )

    fleet = _Fleet(
        report,
        log_line,
        frontend,
        command=command,
        restart_vanished=config.restart_vanished,
    )
    async with trio.open_nursery() as nursery:
        try:
            for rank in range(config.engines):
                await fleet.spawn(rank, nursery)
            yield fleet
        finally:
            with trio.CancelScope(shield=True):
                await fleet.stop()


class _Coordinator:
    """The standalone coordinator of a run: the current ``serve`` process (a new one after
    a restart), its endpoints, its final counters."""

    def __init__(self, serve: ServeProcess) -> None:
        self.serve = serve
        self.stopping = False

    @property
    def process(self) -> trio.Process:
        return self.serve.process

    @property
    def endpoints(self) -> dict[str, str]:
        return self.serve.endpoints

    @property
    def final_counters(self) -> dict[str, Any] | None:
        return self.serve.final_counters


@asynccontextmanager
async def open_engine_fleet(
    config: ClusterConfig,
    frontend: SimFrontend,
    *,
    coordinator_input: str,
    coordinator_output: str,
    on_failure: Callable[[str], None],
    log_line: Callable[[str], None] = _default_log_line,
    report: ClusterReport | None = None,
) -> AsyncIterator[tuple[int, ...]]:
    """``config.engines`` simulated engine processes serving ``frontend``; yields their pids.

    What :func:`run_cluster` runs, and what other front-ends can run (the HTTP example).
    An engine process that exits while the block runs is reported to ``on_failure``
    (one line naming its rank, pid and wave): the DP group is then broken. ``report``
    (if given) collects engine pids, failures, restarts and collective timeouts.
    Leaving the block stops every engine (stdin EOF, then SIGTERM, then SIGKILL) and
    reaps it.
    """
    if report is None:
        report = ClusterReport(config.mode, config.engines, config.wake_path, 0, 0)
    failures = report.engine_failures
    workdir = PrivateIpcDirectory()
    try:
        async with _engine_fleet(
            config,
            coordinator_input=coordinator_input,
            coordinator_output=coordinator_output,
            frontend=frontend,
            collective_address=config.collective_address or workdir.address("collective"),
            report=report,
            log_line=log_line,
        ) as fleet:
            fleet.on_failure = lambda: on_failure(failures[-1])
            yield tuple(report.engine_pids)
    finally:
        workdir.cleanup()


@asynccontextmanager
async def _serve_process(
    config: ClusterConfig,
    report: ClusterReport,
    log_line: Callable[[str], None],
    fail: Callable[[str], None] | None = None,
) -> AsyncIterator[_Coordinator]:
    """``python -m trio_dpcoord serve`` for the duration of the block; its stderr goes to
    ``log_line``, its final counters to ``final_counters``.

    If it exits before the block ends, ``fail`` is called with the reason (by default
    the reason goes to ``report.failures``), or with ``config.restart_vanished`` it is
    started again on the same (resolved) addresses.
    """
    options = [
        "--exit-on-stdin-eof",
        f"--engines={config.engines}",
        f"--log-level={config.engine_log_level}",
    ]
    if config.host is not None:
        options += ["--allow-remote"] + [
            f"--{name}=tcp://{config.host}:0" for name in ("front", "back-pub", "back-out")
        ]
    options += config.coordinator_args
    holder: list[_Coordinator] = []
    stop = trio.Event()

    async def incarnation(
        options: list[str], *, task_status: trio.TaskStatus[ServeProcess]
    ) -> None:
        async with open_serve(
            *options,
            prefix=config.coordinator_prefix,
            ready_timeout=config.ready_timeout,
            stderr_line=log_line,
            env=_child_environment(),
        ) as serve:
            report.coordinator_pid = serve.process.pid
            task_status.started(serve)
            # Until it exits or the run ends; then leave the block without being
            # cancelled, so that open_serve still reads its final counters.
            async with trio.open_nursery() as waiting:

                async def until(event: Callable[[], Awaitable[object]]) -> None:
                    await event()
                    waiting.cancel_scope.cancel()

                waiting.start_soon(until, serve.process.wait)
                waiting.start_soon(until, stop.wait)
        code = serve.process.returncode
        coordinator = holder[0]
        if coordinator.stopping or code is None:
            return
        status = f"status {code}"
        if code < 0:
            status += f" ({signal.Signals(-code).name})"
        message = f"the coordinator (pid {serve.process.pid}) vanished: exited with {status}"
        if not config.restart_vanished:
            logger.error("%s", message)
            (fail or report.failures.append)(message)
            return
        report.coordinator_restarts.append(message)
        logger.error("%s; restarting it on the same addresses", message)
        same = [*options] + [
            f"--{name}={serve.endpoints[key]}"
            for name, key in (
                ("front", "front"),
                ("back-pub", "back_pub"),
                ("back-out", "back_out"),
            )
        ]
        coordinator.serve = await nursery.start(incarnation, same)
        logger.warning("coordinator restarted as pid %d", coordinator.process.pid)

    async with trio.open_nursery() as nursery:
        holder.append(_Coordinator(await nursery.start(incarnation, options)))
        try:
            yield holder[0]
        finally:
            holder[0].stopping = True
            stop.set()


async def _monitor(
    frontend: SimFrontend,
    config: ClusterConfig,
    report: ClusterReport,
    progress: Callable[[Progress], None] | None,
    fail: Callable[[str], None],
) -> None:
    """Progress ticks, wave sampling and the stall guard."""
    stall = config.stall_timeout
    if stall is None:
        stall = 2 * config.collective_timeout + 5.0
    last_completed = -1
    last_change = trio.current_time()
    while True:
        frontend.check_front_wave()
        now = trio.current_time()
        if frontend.completed != last_completed or frontend.pending == 0:
            last_completed = frontend.completed
            last_change = now
        elif now - last_change > stall:
            fail(
                f"stalled: {frontend.pending} requests pending and none finished for "
                f"{stall:g} s (engines running: {frontend.engine_running})"
            )
            return
        if progress is not None:
            progress(_progress(frontend, report))
        await trio.sleep(0.1)


def _progress(frontend: SimFrontend, report: ClusterReport) -> Progress:
    snapshot = frontend.view.snapshot()
    return Progress(
        completed=frontend.completed,
        total=report.planned,
        sent=frontend.sent,
        wave=snapshot.current_wave,
        running=snapshot.engines_running,
        engine_pending=frontend.per_engine_pending(),
        engine_running=tuple(frontend.engine_running),
        engine_pids=tuple(report.engine_pids),
        coordinator_pid=report.coordinator_pid,
    )


async def run_cluster(
    config: ClusterConfig,
    *,
    progress: Callable[[Progress], None] | None = None,
    log_line: Callable[[str], None] = _default_log_line,
    coordinator_factory: CoordinatorFactory | None = None,
    between_bursts: Callable[[SimFrontend, Progress], Awaitable[None]] | None = None,
) -> ClusterReport:
    """Run the whole cluster once and report; never leaves a child process behind.

    ``progress`` is called about ten times a second; ``log_line`` receives every stderr
    line of the child processes (default: written to our stderr).
    ``coordinator_factory(engine_count)`` replaces the embedded coordinator in
    ``inproc`` mode (tests use it to plug in a deliberately broken one).
    ``between_bursts(frontend, progress)`` is awaited after every burst but the last,
    once its requests finished and the front-end saw every engine idle: tests inject
    faults there, deterministically outside a wave.
    Failures of the cluster (an engine dying, a collective timeout, a stall, a start-up
    timeout) end the run early and are recorded in the report, not raised.
    """
    report = ClusterReport(
        mode=config.mode,
        engines=config.engines,
        wake_path=config.wake_path,
        seed=config.load.seed,
        planned=config.load.requests,
    )
    started = trio.current_time()
    frontend: SimFrontend | None = None
    coordinator: EmbeddedCoordinator | None = None
    serve: _Coordinator | None = None
    try:
        with trio.CancelScope() as run_scope:

            def fail(message: str) -> None:
                report.failures.append(message)
                logger.error("%s", message)
                run_scope.cancel()

            async with AsyncExitStack() as stack:
                tcp = None if config.host is None else f"tcp://{config.host}"
                view: CoordinatorView
                if config.mode == "inproc":
                    factory = coordinator_factory or _default_coordinator(config)
                    coordinator = await stack.enter_async_context(factory(config.engines))
                    view = coordinator
                    engine_input = coordinator.engine_input_address
                    engine_output = coordinator.engine_output_address
                else:
                    serve = await stack.enter_async_context(
                        _serve_process(config, report, log_line, fail)
                    )
                    view = await stack.enter_async_context(
                        open_frontend(serve.endpoints["front"], engine_count=config.engines)
                    )
                    engine_input = serve.endpoints["back_pub"]
                    engine_output = serve.endpoints["back_out"]
                frontend = await stack.enter_async_context(
                    open_sim_frontend(
                        view,
                        config.engines,
                        wake_path=config.wake_path,
                        request_address=tcp and f"{tcp}:0",
                        completion_address=tcp and f"{tcp}:0",
                    )
                )
                if config.record_timeline:
                    report.timeline = frontend.timeline = Timeline(config.engines, started)
                await stack.enter_async_context(
                    open_engine_fleet(
                        config,
                        frontend,
                        coordinator_input=engine_input,
                        coordinator_output=engine_output,
                        on_failure=lambda _: run_scope.cancel(),
                        log_line=log_line,
                        report=report,
                    )
                )
                if coordinator is not None:  # leaving stops the engines: that is no outage
                    stack.callback(coordinator.expect_shutdown)
                with trio.move_on_after(config.ready_timeout) as ready_scope:
                    if coordinator is not None:
                        await coordinator.wait_ready()
                    await frontend.wait_for(lambda f: all(f.engine_ready))
                if report.timeline is not None:  # the picture starts with the load
                    report.timeline.start = trio.current_time()
                if ready_scope.cancelled_caught:
                    fail(
                        f"engines not ready after {config.ready_timeout:g} s: ready "
                        f"{frontend.engine_ready}"
                    )
                else:
                    hook: Callable[[], Awaitable[None]] | None = None
                    if between_bursts is not None:
                        user_hook, sim = between_bursts, frontend

                        async def idle_hook() -> None:
                            await sim.wait_for(lambda f: not any(f.engine_running))
                            await user_hook(sim, _progress(sim, report))

                        hook = idle_hook

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_monitor, frontend, config, report, progress, fail)
                        await generate_load(frontend, config.load, after_burst=hook)
                        nursery.cancel_scope.cancel()
                    if report.timeline is not None:
                        # End the picture with the last wave, not with the teardown.
                        with trio.move_on_after(1.0):
                            await frontend.wait_for(lambda f: not any(f.engine_running))
                        report.timeline.finish(trio.current_time())
                if progress is not None:
                    progress(_progress(frontend, report))
                _collect(report, frontend, coordinator)
    except (Exception, BaseExceptionGroup) as exc:
        if not isinstance(exc, Exception) and not _all_exceptions(exc):
            raise
        report.failures.append(f"{type(exc).__name__}: {exc}")
        logger.exception("cluster run failed")
    if frontend is not None:
        _collect(report, frontend, coordinator)
    if serve is not None:
        final = serve.final_counters
        if final is None:
            report.failures.append("the coordinator process printed no final counters")
        else:
            report.coordinator_errors = int(final.get("errors", 0))
    report.duration = trio.current_time() - started
    if report.timeline is not None and report.timeline.end is None:
        report.timeline.finish(trio.current_time())
    return report


def _all_exceptions(group: BaseException) -> bool:
    if isinstance(group, BaseExceptionGroup):
        return all(_all_exceptions(e) for e in group.exceptions)
    return isinstance(group, Exception)


def _default_coordinator(config: ClusterConfig) -> CoordinatorFactory:
    def factory(engine_count: int) -> AbstractAsyncContextManager[EmbeddedCoordinator]:
        if config.host is None:
            return open_coordinator(engine_count, ready_timeout=config.ready_timeout)
        return open_coordinator(
            engine_count,
            ready_timeout=config.ready_timeout,
            engine_input_address=f"tcp://{config.host}:0",
            engine_output_address=f"tcp://{config.host}:0",
            allow_remote=True,
        )

    return factory


def _collect(
    report: ClusterReport, frontend: SimFrontend, coordinator: EmbeddedCoordinator | None
) -> None:
    report.requests = frontend.sent
    report.completed = frontend.completed
    report.waves = len(frontend.waves_completed)
    report.frontend_errors = frontend.bad_messages
    report.wave_regressions = frontend.wave_regressions
    report.wave_resets = frontend.wave_resets
    report.notifications = frontend.notifications
    report.pauses = frontend.pauses
    report.wake_latencies = list(frontend.wake_latencies)
    report.resubmitted = frontend.resubmitted
    if coordinator is not None:
        report.coordinator_errors = coordinator.counters().errors
