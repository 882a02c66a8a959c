"""Process supervision for the simulated cluster: the engine processes and the
standalone coordinator process, spawned, watched, restarted when asked, always reaped.

Each child runs in its own session (a terminal's Ctrl-C reaches only the launcher, which
stops them in order) and watches its stdin: if the launcher dies, the pipe closes and
the child exits, so no orphan survives. What a run does with them is
:mod:`trio_dpcoord.sim.cluster`'s business.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from ..testing import ServeProcess, open_serve, read_lines
from .cluster_config import ClusterConfig, ClusterReport
from .engine_errors import DIAGNOSED_EXIT_STATUSES, EXIT_COLLECTIVE_TIMEOUT
from .frontend import SimFrontend

__all__ = [
    "EngineFleet",
    "StandaloneCoordinator",
    "child_environment",
    "open_engine_processes",
    "open_serve_process",
    "reap",
]

logger = logging.getLogger(__name__)

_COLLECTIVE_TIMEOUT_MARK = "collective timeout"


def child_environment() -> dict[str, str]:
    """Our environment, with this very ``trio_dpcoord`` first on the children's path: the
    engines and the coordinator process run the same code as the launcher, installed or
    not."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent.parent)
    if root not in sys.path:  # imported from a checkout by path, not installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class EngineFleet:
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
            env=child_environment(),
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
            message = (
                f"engine {rank} (pid {process.pid}) vanished {where}: rank {rank} "
                f"exited with {_exit_status(code)}"
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
        # Every other rank of this group retires, those already dead too: a rank whose
        # own collective timed out at the same moment must not restart the group again
        # (two restarts at once start two rank 0s, and one dies on the taken address).
        pids = set(self.report.engine_pids)
        others = [p for p in self.processes if p.pid in pids and p.pid != pid]
        self._retiring.update(others)
        await reap(others, grace=0.0)
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
        await reap(self.processes, grace=5.0)


async def reap(processes: list[trio.Process], *, grace: float) -> None:
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
    prefix, and ``addresses`` (the options naming its sockets)."""
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
    if config.prefix_cache_blocks:
        command += [
            f"--prefix-cache-blocks={config.prefix_cache_blocks}",
            f"--token-budget={config.token_budget}",
            f"--step-per-token={config.step_per_token}",
        ]
    return command


@asynccontextmanager
async def open_engine_processes(
    config: ClusterConfig,
    *,
    back_publish_address: str,
    back_output_address: str,
    frontend: SimFrontend,
    collective_address: str,
    report: ClusterReport,
    log_line: Callable[[str], None],
) -> AsyncIterator[EngineFleet]:
    """One ``python -m trio_dpcoord.sim engine`` process per rank for the block, each
    pointed at the coordinator, ``frontend`` and the collective; all stopped and reaped
    on the way out, whatever happens."""

    def command(rank: int) -> list[str]:
        return engine_command(
            config,
            rank,
            [
                f"--back-pub={back_publish_address}",
                f"--back-out={back_output_address}",
                f"--request-address={frontend.request_address}",
                f"--completion-address={frontend.completion_address}",
                f"--collective-address={collective_address}",
                *[f"--kv-events-address={a}" for a in frontend.kv_event_addresses[rank : rank + 1]],
            ],
        )

    fleet = EngineFleet(
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


class StandaloneCoordinator:
    """The standalone coordinator of a run: the current ``serve`` process (a new one after
    a restart), its endpoints, its final counters."""

    def __init__(
        self,
        config: ClusterConfig,
        report: ClusterReport,
        log_line: Callable[[str], None],
        fail: Callable[[str], None],
        nursery: trio.Nursery,
    ) -> None:
        self._serve: ServeProcess | None = None
        self._config = config
        self._report = report
        self._log_line = log_line
        self._fail = fail
        self._nursery = nursery
        self._stopping = False
        self._stop = trio.Event()

    @property
    def process(self) -> trio.Process:
        return self._current().process

    @property
    def endpoints(self) -> dict[str, str]:
        return self._current().endpoints

    @property
    def final_counters(self) -> dict[str, Any] | None:
        return self._current().final_counters

    def _current(self) -> ServeProcess:
        assert self._serve is not None, "the coordinator has not started"
        return self._serve

    async def start(self, options: list[str]) -> None:
        """Start an incarnation with ``options``; return once its endpoints are known."""
        self._serve = await self._nursery.start(self._incarnation, options)

    def stop(self) -> None:
        """The run is over: the process is stopped, its exit is no news."""
        self._stopping = True
        self._stop.set()

    async def _incarnation(
        self, options: list[str], *, task_status: trio.TaskStatus[ServeProcess]
    ) -> None:
        config = self._config
        async with open_serve(
            *options,
            prefix=config.coordinator_prefix,
            ready_timeout=config.ready_timeout,
            stderr_line=self._log_line,
            env=child_environment(),
        ) as serve:
            self._report.coordinator_pid = serve.process.pid
            task_status.started(serve)
            # Until it exits or the run ends; then leave the block without being
            # cancelled, so that open_serve still reads its final counters.
            async with trio.open_nursery() as waiting:

                async def until(event: Callable[[], Awaitable[object]]) -> None:
                    await event()
                    waiting.cancel_scope.cancel()

                waiting.start_soon(until, serve.process.wait)
                waiting.start_soon(until, self._stop.wait)
        code = serve.process.returncode
        if not self._stopping and code is not None:
            await self._vanished(serve, code, options)

    async def _vanished(self, serve: ServeProcess, code: int, options: list[str]) -> None:
        """It exited on its own: a failure, or with ``restart_vanished`` a new
        incarnation on the same (resolved) addresses."""
        message = (
            f"the coordinator (pid {serve.process.pid}) vanished: exited with {_exit_status(code)}"
        )
        if not self._config.restart_vanished:
            logger.error("%s", message)
            self._fail(message)
            return
        self._report.coordinator_restarts.append(message)
        logger.error("%s; restarting it on the same addresses", message)
        same = [*options] + [
            f"--{name}={serve.endpoints[key]}"
            for name, key in (
                ("front", "front"),
                ("back-pub", "back_pub"),
                ("back-out", "back_out"),
            )
        ]
        await self.start(same)
        logger.warning("coordinator restarted as pid %d", self.process.pid)


def _serve_options(config: ClusterConfig) -> list[str]:
    """``trio-dpcoord serve``'s options for ``config``: tcp on ``config.host`` if set."""
    options = [
        "--exit-on-stdin-eof",
        f"--engines={config.engines}",
        f"--log-level={config.engine_log_level}",
    ]
    if config.host is not None:
        options += ["--allow-remote"] + [
            f"--{name}=tcp://{config.host}:0" for name in ("front", "back-pub", "back-out")
        ]
    return options + list(config.coordinator_args)


@asynccontextmanager
async def open_serve_process(
    config: ClusterConfig,
    report: ClusterReport,
    log_line: Callable[[str], None],
    fail: Callable[[str], None] | None = None,
) -> AsyncIterator[StandaloneCoordinator]:
    """``python -m trio_dpcoord serve`` for the duration of the block; its stderr goes to
    ``log_line``, its final counters to ``final_counters``.

    If it exits before the block ends, ``fail`` is called with the reason (by default
    the reason goes to ``report.failures``), or with ``config.restart_vanished`` it is
    started again on the same (resolved) addresses.
    """
    async with trio.open_nursery() as nursery:
        coordinator = StandaloneCoordinator(
            config, report, log_line, fail or report.failures.append, nursery
        )
        await coordinator.start(_serve_options(config))
        try:
            yield coordinator
        finally:
            coordinator.stop()


def _exit_status(code: int) -> str:
    """A child's exit status as logs give it: ``status -9 (SIGKILL)``."""
    if code < 0:
        return f"status {code} ({signal.Signals(-code).name})"
    return f"status {code}"
