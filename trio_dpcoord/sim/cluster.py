"""A whole simulated cluster: coordinator, front-end, N engine processes and a load.

:func:`run_cluster` is what ``examples/launch_cluster.py`` runs, and what tests and
benchmarks reuse. Two modes:

* ``inproc``: the front-end embeds :func:`trio_dpcoord.open_coordinator`;
* ``standalone``: ``python -m trio_dpcoord serve`` runs in its own process and the
  front-end follows it with :func:`trio_dpcoord.open_frontend`.

Engines are ``python -m trio_dpcoord.sim engine`` processes, one per DP rank, supervised
by :mod:`trio_dpcoord.sim.fleet`; every child is reaped before :func:`run_cluster`
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

import dataclasses
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Protocol

import trio

from .. import CoordinatorView, PrivateIpcDirectory, open_coordinator, open_frontend
from .cluster_config import ClusterConfig, ClusterReport, Progress, log_to_stderr
from .fleet import StandaloneCoordinator, open_engine_processes, open_serve_process
from .frontend import SimFrontend, open_sim_frontend
from .load import generate_load
from .timeline import Timeline

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "EmbeddedCoordinator",
    "open_engine_fleet",
    "run_cluster",
]

logger = logging.getLogger(__name__)


class _Counters(Protocol):
    @property
    def errors(self) -> int: ...


class EmbeddedCoordinator(CoordinatorView, Protocol):
    """What ``inproc`` mode needs from the embedded coordinator (``open_coordinator``'s
    handle, or a test's stand-in)."""

    @property
    def back_publish_address(self) -> str: ...

    @property
    def back_output_address(self) -> str: ...

    async def wait_ready(self) -> None: ...

    def statistics(self) -> _Counters: ...

    def expect_shutdown(self) -> None: ...


CoordinatorFactory = Callable[[int], AbstractAsyncContextManager[EmbeddedCoordinator]]


@asynccontextmanager
async def open_engine_fleet(
    config: ClusterConfig,
    frontend: SimFrontend,
    *,
    back_publish_address: str,
    back_output_address: str,
    on_failure: Callable[[str], None],
    log_line: Callable[[str], None] = log_to_stderr,
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
        async with open_engine_processes(
            config,
            back_publish_address=back_publish_address,
            back_output_address=back_output_address,
            frontend=frontend,
            collective_address=config.collective_address or workdir.address("collective"),
            report=report,
            log_line=log_line,
        ) as fleet:
            fleet.on_failure = lambda: on_failure(failures[-1])
            yield tuple(report.engine_pids)
    finally:
        workdir.cleanup()


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
    log_line: Callable[[str], None] = log_to_stderr,
    coordinator_factory: CoordinatorFactory | None = None,
    between_bursts: Callable[[SimFrontend, Progress], Awaitable[None]] | None = None,
    drive: Callable[[SimFrontend], Awaitable[None]] | None = None,
) -> ClusterReport:
    """Run the whole cluster once and report; never leaves a child process behind.

    ``progress`` is called about ten times a second; ``log_line`` receives every stderr
    line of the child processes (default: written to our stderr).
    ``coordinator_factory(engine_count)`` replaces the embedded coordinator in
    ``inproc`` mode (tests use it to plug in a deliberately broken one).
    ``between_bursts(frontend, progress)`` is awaited after every burst but the last,
    once its requests finished and the front-end saw every engine idle: tests inject
    faults there, deterministically outside a wave.
    ``drive(frontend)`` replaces the load plan (a benchmark replaying a trace): it sends
    requests and returns once they finished (``between_bursts`` is then not called;
    set ``config.load.requests`` to the number it sends, for :attr:`ClusterReport.ok`).
    Failures of the cluster (an engine dying, a collective timeout, a stall, a start-up
    timeout) end the run early and are recorded in the report, not raised.
    """
    report = ClusterReport(
        mode=config.mode,
        engines=config.engines,
        wake_path=config.wake_path,
        seed=config.load.seed,
        planned=config.load.requests,
        routing=config.routing,
    )
    run = _ClusterRun(config, report, progress, log_line)
    try:
        with trio.CancelScope() as run.scope:
            async with AsyncExitStack() as stack:
                await run.start(stack, coordinator_factory)
                if await run.wait_ready():
                    await run.apply_load(between_bursts, drive)
                if progress is not None:
                    progress(run.progress())
                run.collect()
    except (Exception, BaseExceptionGroup) as exc:
        if not isinstance(exc, Exception) and not _all_exceptions(exc):
            raise
        report.failures.append(f"{type(exc).__name__}: {exc}")
        logger.exception("cluster run failed")
    run.conclude()
    return report


class _ClusterRun:
    """One run of :func:`run_cluster`: what it started, and the steps it goes through.
    A failure of the cluster is recorded in the report and cancels :attr:`scope`."""

    def __init__(
        self,
        config: ClusterConfig,
        report: ClusterReport,
        progress: Callable[[Progress], None] | None,
        log_line: Callable[[str], None],
    ) -> None:
        self.config = config
        self.report = report
        self._progress = progress
        self._log_line = log_line
        self.started = trio.current_time()
        self.scope = trio.CancelScope()
        self.frontend: SimFrontend | None = None
        self.coordinator: EmbeddedCoordinator | None = None
        self.serve: StandaloneCoordinator | None = None

    def fail(self, message: str) -> None:
        self.report.failures.append(message)
        logger.error("%s", message)
        self.scope.cancel()

    async def start(
        self, stack: AsyncExitStack, coordinator_factory: CoordinatorFactory | None
    ) -> None:
        """The coordinator (embedded or standalone), the front-end, then the engines."""
        config, report = self.config, self.report
        view, back_publish, back_output = await self._open_coordinator(stack, coordinator_factory)
        tcp = None if config.host is None else f"tcp://{config.host}"
        frontend = self.frontend = await stack.enter_async_context(
            open_sim_frontend(
                view,
                config.engines,
                wake_path=config.wake_path,
                routing=config.routing,
                prefix=config.prefix_routing(),
                kv_events=config.kv_events,
                request_address=tcp and f"{tcp}:0",
                completion_address=tcp and f"{tcp}:0",
            )
        )
        if config.record_timeline:
            report.timeline = frontend.timeline = Timeline(config.engines, self.started)
        await stack.enter_async_context(
            open_engine_fleet(
                config,
                frontend,
                back_publish_address=back_publish,
                back_output_address=back_output,
                on_failure=lambda _: self.scope.cancel(),
                log_line=self._log_line,
                report=report,
            )
        )
        if self.coordinator is not None:  # leaving stops the engines: that is no outage
            stack.callback(self.coordinator.expect_shutdown)

    async def _open_coordinator(
        self, stack: AsyncExitStack, coordinator_factory: CoordinatorFactory | None
    ) -> tuple[CoordinatorView, str, str]:
        """The coordinator of the mode: what the front-end follows, and the addresses of
        its back-publish and back-output sockets (where the engines connect)."""
        config = self.config
        if config.mode == "inproc":
            factory = coordinator_factory or _default_coordinator(config)
            coordinator = self.coordinator = await stack.enter_async_context(
                factory(config.engines)
            )
            return coordinator, coordinator.back_publish_address, coordinator.back_output_address
        serve = self.serve = await stack.enter_async_context(
            open_serve_process(config, self.report, self._log_line, self.fail)
        )
        view = await stack.enter_async_context(
            open_frontend(serve.endpoints["front"], engine_count=config.engines)
        )
        return view, serve.endpoints["back_pub"], serve.endpoints["back_out"]

    async def wait_ready(self) -> bool:
        """Every engine ready within ``ready_timeout`` (else the run fails)."""
        assert self.frontend is not None
        config, report = self.config, self.report
        with trio.move_on_after(config.ready_timeout) as ready_scope:
            if self.coordinator is not None:
                await self.coordinator.wait_ready()
            await self.frontend.wait_for(lambda f: all(f.engine_ready))
        if report.timeline is not None:  # the picture starts with the load
            report.timeline.start = trio.current_time()
        if ready_scope.cancelled_caught:
            self.fail(
                f"engines not ready after {config.ready_timeout:g} s: ready "
                f"{self.frontend.engine_ready}"
            )
            return False
        return True

    async def apply_load(
        self,
        between_bursts: Callable[[SimFrontend, Progress], Awaitable[None]] | None,
        drive: Callable[[SimFrontend], Awaitable[None]] | None = None,
    ) -> None:
        """The load plan (or ``drive``), watched by the monitor; ``between_bursts`` once
        the engines are idle after each burst."""
        frontend, report = self.frontend, self.report
        assert frontend is not None
        hook: Callable[[], Awaitable[None]] | None = None
        if between_bursts is not None:
            user_hook = between_bursts

            async def idle_hook() -> None:
                await frontend.wait_for(lambda f: not any(f.engine_running))
                await user_hook(frontend, _progress(frontend, report))

            hook = idle_hook

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_monitor, frontend, self.config, report, self._progress, self.fail)
            if drive is None:
                await generate_load(frontend, self.config.load, after_burst=hook)
            else:
                await drive(frontend)
            nursery.cancel_scope.cancel()
        if report.timeline is not None:
            # End the picture with the last wave, not with the teardown.
            with trio.move_on_after(1.0):
                await frontend.wait_for(lambda f: not any(f.engine_running))
            report.timeline.finish(trio.current_time())

    def progress(self) -> Progress:
        assert self.frontend is not None
        return _progress(self.frontend, self.report)

    def collect(self) -> None:
        """What the front-end (and an embedded coordinator) counted, into the report."""
        if self.frontend is not None:
            _collect(self.report, self.frontend, self.coordinator)

    def conclude(self) -> None:
        """After the run, whichever way it ended: the counts, the standalone
        coordinator's final counters, the duration, the end of the picture."""
        report = self.report
        self.collect()
        if self.serve is not None:
            final = self.serve.final_counters
            if final is None:
                report.failures.append("the coordinator process printed no final counters")
            else:
                report.coordinator_errors = int(final.get("errors", 0))
        report.duration = trio.current_time() - self.started
        if report.timeline is not None and report.timeline.end is None:
            report.timeline.finish(trio.current_time())


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
            back_publish_address=f"tcp://{config.host}:0",
            back_output_address=f"tcp://{config.host}:0",
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
    report.prefix_queries = list(frontend.prefix_queries)
    report.prefix_hits = list(frontend.prefix_hits)
    report.engine_tokens = list(frontend.engine_tokens)
    report.kv_event_batches = frontend.kv_event_batches
    counters = frontend.chooser.statistics().router
    if counters is not None:
        report.routing_counters = dataclasses.asdict(counters)
    if coordinator is not None:
        report.coordinator_errors = coordinator.statistics().errors
