"""A long run of the simulated cluster against the standalone coordinator (soak).

``python -m trio_dpcoord.sim soak --waves 10000 --messages 1000000`` starts
``trio-dpcoord serve``, a simulated engine fleet and a front-end that sends tiny bursts
(1-2 requests of 1-2 tokens, no gap) so that waves are short, and pauses/resumes every
``pause_every`` bursts. Because a real wave produces only a dozen engine messages, bare
stats pushers (:mod:`trio_dpcoord.testing` peers, not subscribed) add load on the
coordinator's engine output socket until the total reaches ``messages``. It samples the
coordinator process's resident memory (``VmRSS``) after a warm-up and at the end, and
reports waves, messages, stranded requests and wave regressions.
"""

from __future__ import annotations

import logging
import random
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio

from .. import PrivateIpcDirectory, open_frontend
from ..testing import EnginePeer, connect_engines
from .cluster_config import ClusterConfig, ClusterReport
from .fleet import open_engine_processes, open_serve_process
from .frontend import SimFrontend, open_sim_frontend
from .load import LoadPlan

__all__ = ["SoakConfig", "SoakReport", "run_soak", "vm_rss_kib"]

logger = logging.getLogger(__name__)


def vm_rss_kib(pid: int) -> int:
    """The resident set size of process ``pid`` in KiB, from ``/proc/<pid>/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


@dataclass(frozen=True, slots=True)
class SoakConfig:
    waves: int = 10_000
    messages: int = 1_000_000
    engines: int = 4
    warmup_waves: int = 1_000
    pause_every: int = 200
    pushers: int = 2
    push_batch: int = 50
    push_pause: float = 0.01
    step_time: float = 0.0005
    sync_interval: int = 4
    collective_timeout: float = 10.0
    seed: int = 0


@dataclass(slots=True)
class SoakReport:
    waves: int = 0
    requests: int = 0
    completed: int = 0
    stranded: int = 0
    pauses: int = 0
    wave_regressions: int = 0
    final_wave: int = 0
    pushed_messages: int = 0
    coordinator_engine_messages: int | None = None
    coordinator_errors: int | None = None
    rss_warmup_kib: int = 0
    rss_end_kib: int = 0
    rss_max_kib: int = 0
    duration_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def rss_growth_percent(self) -> float:
        return 100.0 * (self.rss_end_kib - self.rss_warmup_kib) / max(1, self.rss_warmup_kib)

    @property
    def ok(self) -> bool:
        return (
            not self.failures
            and self.stranded == 0
            and self.wave_regressions == 0
            and self.coordinator_errors == 0
            and self.rss_growth_percent < 5.0
        )

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["rss_growth_percent"] = round(self.rss_growth_percent, 2)
        record["ok"] = self.ok
        return record


async def run_soak(config: SoakConfig, *, log_line: Any = None) -> SoakReport:
    """Run the soak once; every child process is reaped before it returns."""
    report = SoakReport()
    cluster = _soak_cluster(config)
    lines: list[str] = []
    sink = log_line if log_line is not None else lines.append
    fleet_report = ClusterReport("standalone", config.engines, "both", config.seed, 0)
    workdir = PrivateIpcDirectory()
    started = trio.current_time()
    try:
        async with AsyncExitStack() as stack:
            serve = await stack.enter_async_context(open_serve_process(cluster, fleet_report, sink))
            view = await stack.enter_async_context(
                open_frontend(serve.endpoints["front"], engine_count=config.engines)
            )
            frontend = await stack.enter_async_context(
                open_sim_frontend(view, config.engines, wake_path="both")
            )
            await stack.enter_async_context(
                open_engine_processes(
                    cluster,
                    back_publish_address=serve.endpoints["back_pub"],
                    back_output_address=serve.endpoints["back_out"],
                    frontend=frontend,
                    collective_address=workdir.address("collective"),
                    report=fleet_report,
                    log_line=sink,
                )
            )
            with trio.fail_after(60):
                await frontend.wait_for(lambda f: all(f.engine_ready))
            peers = await stack.enter_async_context(
                connect_engines(
                    serve.endpoints["back_pub"],
                    serve.endpoints["back_out"],
                    config.pushers,
                    subscribe=False,
                )
            )
            soak = _Soak(config, report, frontend, serve.process.pid, fleet_report)
            await soak.run(peers)
            soak.record(view.snapshot().current_wave)
        final = serve.final_counters
        if final is not None:
            report.coordinator_engine_messages = int(final["engine_messages"])
            report.coordinator_errors = int(final["errors"])
        else:
            report.failures.append("the coordinator printed no final counters")
    finally:
        workdir.cleanup()
    report.failures += fleet_report.failures
    report.duration_s = trio.current_time() - started
    return report


def _soak_cluster(config: SoakConfig) -> ClusterConfig:
    """The standalone cluster the soak runs: no load plan of its own, quiet engines."""
    return ClusterConfig(
        engines=config.engines,
        mode="standalone",
        wake_path="both",
        load=LoadPlan(requests=0),
        step_time=config.step_time,
        sync_interval=config.sync_interval,
        collective_timeout=config.collective_timeout,
        engine_log_level="ERROR",
    )


class _Soak:
    """The soak's load on a running cluster: bursts of tiny requests (with a pause and
    resume every ``pause_every`` bursts) until ``waves`` waves completed, bare stats
    pushers until the ``messages`` budget is spent, and the coordinator's memory
    sampled after the warm-up, every second and at the end."""

    def __init__(
        self,
        config: SoakConfig,
        report: SoakReport,
        frontend: SimFrontend,
        pid: int,
        fleet_report: ClusterReport,
    ) -> None:
        self.config = config
        self.report = report
        self.frontend = frontend
        self.pid = pid
        self.fleet_report = fleet_report
        self.rng = random.Random(config.seed)
        self.pushers_done = 0

    async def run(self, peers: list[EnginePeer]) -> None:
        """Drive the waves with the pushers and the watch alongside; a failed engine or
        collective ends the run early (recorded in ``failures``)."""
        with trio.CancelScope() as run_scope:
            async with trio.open_nursery() as nursery:
                for peer in peers:
                    nursery.start_soon(self._push, peer)
                nursery.start_soon(self._watch, run_scope)
                await self._drive_waves()
                await self._finish()
                nursery.cancel_scope.cancel()

    def _budget_left(self) -> bool:
        # The fleet's own traffic (about 3 messages per engine per wave) is
        # under-estimated on purpose, so the total surely reaches the target; the
        # coordinator's final counter is the figure reported.
        fleet = 2 * self.config.engines * len(self.frontend.waves_completed)
        return self.report.pushed_messages + fleet < self.config.messages

    async def _push(self, peer: EnginePeer) -> None:
        config = self.config
        while self._budget_left():
            for _ in range(config.push_batch):
                await peer.stats(0, 0, 0.0, wave=0, step=0)
            self.report.pushed_messages += config.push_batch
            await trio.sleep(config.push_pause)
        self.pushers_done += 1

    async def _watch(self, run_scope: trio.CancelScope) -> None:
        report, fleet_report = self.report, self.fleet_report
        while True:
            await trio.sleep(1.0)
            report.rss_max_kib = max(report.rss_max_kib, vm_rss_kib(self.pid))
            if fleet_report.engine_failures or fleet_report.collective_timeouts:
                report.failures += fleet_report.engine_failures
                report.failures += fleet_report.collective_timeouts
                run_scope.cancel()
                return

    async def _drive_waves(self) -> None:
        config, report, frontend, rng = self.config, self.report, self.frontend, self.rng
        bursts = 0
        while len(frontend.waves_completed) < config.waves:
            for _ in range(rng.randint(1, 2)):
                await frontend.submit(max_tokens=rng.randint(1, 2))
            bursts += 1
            with trio.fail_after(2 * config.collective_timeout + 5):
                await frontend.wait_for(lambda f: f.pending == 0)
            if config.pause_every and bursts % config.pause_every == 0:
                await frontend.pause_engines()
                await frontend.resume_engines()
            if not report.rss_warmup_kib and (len(frontend.waves_completed) >= config.warmup_waves):
                report.rss_warmup_kib = vm_rss_kib(self.pid)
                logger.info("warm-up done: coordinator VmRSS %d KiB", report.rss_warmup_kib)
            if bursts % 500 == 0:
                logger.info(
                    "soak: %d waves, %d requests, %d pushed",
                    len(frontend.waves_completed),
                    frontend.sent,
                    report.pushed_messages,
                )

    async def _finish(self) -> None:
        """Every pusher finishes its share, the front-end and the coordinator drain,
        then the end sample."""
        with trio.fail_after(900):
            while self.pushers_done < self.config.pushers:  # noqa: ASYNC110 - counters
                await trio.sleep(0.2)
        with trio.move_on_after(2 * self.config.collective_timeout):
            await self.frontend.wait_for(lambda f: f.pending == 0)
        await trio.sleep(0.5)  # let the coordinator drain its socket
        report = self.report
        report.rss_end_kib = vm_rss_kib(self.pid)
        report.rss_max_kib = max(report.rss_max_kib, report.rss_end_kib)

    def record(self, final_wave: int) -> None:
        """What the front-end saw, into the report."""
        report, frontend = self.report, self.frontend
        report.waves = len(frontend.waves_completed)
        report.requests = frontend.sent
        report.completed = frontend.completed
        report.stranded = frontend.pending
        report.pauses = frontend.pauses
        report.wave_regressions = frontend.wave_regressions
        report.final_wave = final_wave
