"""Faults (issue 7): an engine killed mid-wave, the standalone coordinator killed and
restarted under live engines (vLLM #32136), a front-end that reconnects."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest
import trio

from trio_dpcoord import CoordinatorError, open_coordinator, open_frontend
from trio_dpcoord._service import Coordinator
from trio_dpcoord.sim import (
    ClusterConfig,
    EmbeddedCoordinator,
    EngineConfig,
    LoadPlan,
    Progress,
    SimEngine,
    open_sim_frontend,
    run_cluster,
)
from trio_dpcoord.sim.engine import run_sim_engine


async def test_a_killed_engine_is_named_with_its_wave_promptly() -> None:
    """SIGKILL one engine process mid-run: the launcher names the rank and its wave and
    stops at once (well before the 20 s collective timeout would have)."""
    handles: list[Coordinator] = []

    @asynccontextmanager
    async def keep_handle(engines: int) -> AsyncIterator[EmbeddedCoordinator]:
        async with open_coordinator(engines, ready_timeout=30) as coordinator:
            handles.append(coordinator)
            yield coordinator

    def factory(engines: int) -> AbstractAsyncContextManager[EmbeddedCoordinator]:
        return keep_handle(engines)

    killed: list[int] = []

    def kill_rank_1(progress: Progress) -> None:
        if not killed and progress.completed >= 5 and any(progress.engine_running):
            os.kill(progress.engine_pids[1], signal.SIGKILL)
            killed.append(progress.engine_pids[1])

    config = ClusterConfig(
        engines=3,
        load=LoadPlan(requests=100_000, burst=(20, 40), gap=(0.0, 0.0), pause_every=0),
        collective_timeout=20.0,
    )
    lines: list[str] = []
    with trio.fail_after(60):
        report = await run_cluster(
            config, progress=kill_rank_1, coordinator_factory=factory, log_line=lines.append
        )
    assert killed
    assert not report.ok
    assert report.duration < 15.0, "the run waited for a timeout instead of stopping"
    assert report.collective_timeouts == []
    assert len(report.engine_failures) == 1, report.engine_failures
    assert re.fullmatch(
        rf"engine 1 \(pid {killed[0]}\) vanished (during|idle after) wave \d+: rank 1 exited "
        r"with status -9 \(SIGKILL\)",
        report.engine_failures[0],
    ), report.engine_failures[0]


def _config(
    rank: int, count: int, inp: str, out: str, fe_req: str, fe_done: str, tmp: Path
) -> EngineConfig:
    return EngineConfig(
        rank=rank,
        engine_count=count,
        coordinator_input_address=inp,
        coordinator_output_address=out,
        request_address=fe_req,
        completion_address=fe_done,
        collective_address=f"ipc://{tmp}/collective",
        step_time=0.001,
        sync_interval=4,
        collective_timeout=10.0,
    )


async def test_a_vanished_engine_shows_in_the_engine_view_and_gets_ready_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine's sockets close (as when its process dies): the coordinator logs the
    unsubscription and counts it; the engine restarted on the same rank subscribes
    late and gets READY."""
    caplog.set_level(logging.WARNING, logger="trio_dpcoord._service")
    with trio.fail_after(30):
        async with open_coordinator(2, ready_timeout=10) as coord:
            async with open_sim_frontend(coord, 2) as fe:

                def config(rank: int) -> EngineConfig:
                    return _config(
                        rank,
                        2,
                        coord.engine_input_address,
                        coord.engine_output_address,
                        fe.request_address,
                        fe.completion_address,
                        tmp_path,
                    )

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run_sim_engine, SimEngine(config(0)))
                    rank_1 = trio.CancelScope()
                    nursery.start_soon(_run_in, rank_1, SimEngine(config(1)))
                    await coord.wait_ready()
                    await fe.wait_for(lambda f: all(f.engine_ready))
                    assert coord.subscriptions().current == 2
                    rank_1.cancel()  # its sockets close: the coordinator's XPUB notices
                    await coord.wait_for(lambda c: c.subscriptions().unsubscribed == 1)
                    assert coord.subscriptions().current == 1
                    assert any("an engine unsubscribed" in r.message for r in caplog.records)

                    again = SimEngine(config(1))
                    nursery.start_soon(run_sim_engine, again)
                    await coord.wait_for(lambda c: c.subscriptions().late_subscriptions == 1)
                    while not again.ready:  # noqa: ASYNC110 - the engine's own flag
                        await trio.sleep(0.02)
                    assert coord.counters.ready_broadcasts == 2
                    view = coord.subscriptions()
                    assert (view.current, view.subscribed, view.unsubscribed) == (2, 3, 1)
                    nursery.cancel_scope.cancel()


async def _run_in(scope: trio.CancelScope, engine: SimEngine) -> None:
    with scope:
        await run_sim_engine(engine)


async def _serve(tmp_path: Path, engines: int) -> tuple[trio.Process, dict[str, str]]:
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "trio_dpcoord",
            "serve",
            f"--engines={engines}",
            f"--front=ipc://{tmp_path}/front",
            f"--back-pub=ipc://{tmp_path}/bp",
            f"--back-out=ipc://{tmp_path}/bo",
            "--exit-on-stdin-eof",
            "--log-level=WARNING",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert process.stdout is not None
    line = b""
    while not line.endswith(b"\n"):
        chunk = await process.stdout.receive_some(4096)
        assert chunk, "the coordinator exited before printing its endpoints"
        line += chunk
    return process, json.loads(line)


async def _reap(process: trio.Process) -> None:
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.kill()
        await process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                await stream.aclose()


async def test_coordinator_killed_and_restarted_under_live_engines(tmp_path: Path) -> None:
    """vLLM #32136 and a restart: SIGKILL the standalone coordinator under a live fleet;
    the front-end with coordinator_timeout raises within the bound, every engine logs
    the loss at once; a coordinator restarted on the same addresses gets every engine
    back (gate, READY), the other front-end gets its next publish, the wave moves on
    from what the engines report and no request is stranded."""
    first, endpoints = await _serve(tmp_path, 2)
    processes = [first]
    try:
        with trio.fail_after(60):
            async with open_frontend(endpoints["front"], engine_count=2) as view:
                async with open_sim_frontend(view, 2) as fe:
                    engines = [
                        SimEngine(
                            _config(
                                r,
                                2,
                                endpoints["back_pub"],
                                endpoints["back_out"],
                                fe.request_address,
                                fe.completion_address,
                                tmp_path,
                            )
                        )
                        for r in range(2)
                    ]
                    async with trio.open_nursery() as nursery:
                        for engine in engines:
                            nursery.start_soon(run_sim_engine, engine)
                        await fe.wait_for(lambda f: all(f.engine_ready))
                        for _ in range(3):  # three waves
                            await fe.submit(max_tokens=2)
                            await fe.wait_for(lambda f: f.pending == 0)
                            await view.wait_for(lambda v: not v.snapshot().engines_running)
                        await view.wait_for(lambda v: v.snapshot().current_wave >= 3)
                        wave_before = view.snapshot().current_wave

                        lost: list[float] = []

                        async def strict_front_end(task_status: trio.TaskStatus[None]) -> None:
                            with pytest.raises(CoordinatorError, match="no publish from the"):
                                async with open_frontend(
                                    endpoints["front"], engine_count=2, coordinator_timeout=2.0
                                ) as strict:
                                    await strict.wait_for(lambda s: s.publishes_received > 0)
                                    task_status.started()
                                    await trio.sleep_forever()
                            lost.append(trio.current_time())

                        await nursery.start(strict_front_end)
                        for _ in range(4):  # in flight when the coordinator dies
                            await fe.submit(max_tokens=6)
                        first.send_signal(signal.SIGKILL)
                        killed_at = trio.current_time()
                        await first.wait()
                        while not all(e.coordinator_lost.is_set() for e in engines):  # noqa: ASYNC110
                            await trio.sleep(0.02)
                        engines_knew = trio.current_time() - killed_at
                        while not lost:  # noqa: ASYNC110 - set by the task above
                            await trio.sleep(0.05)
                        assert 2.0 <= lost[0] - killed_at < 6.0
                        assert engines_knew < 3.0
                        assert all(e.counters.coordinator_disconnects == 1 for e in engines)
                        await fe.wait_for(lambda f: f.pending == 0)  # the wave finished anyway

                        publishes = view.publishes_received
                        second, _ = await _serve(tmp_path, 2)
                        processes.append(second)
                        await view.wait_for(lambda v: v.publishes_received > publishes)
                        assert view.disconnects == 1 and view.connected
                        while not all(e.counters.coordinator_reconnects == 1 for e in engines):  # noqa: ASYNC110
                            await trio.sleep(0.02)
                        # The restarted coordinator starts at wave 0; the engines' reports
                        # take it past every wave it had reached before.
                        for engine in (0, 1, 0):
                            await fe.submit(max_tokens=2, engine=engine)
                            await fe.wait_for(lambda f: f.pending == 0)
                        await view.wait_for(
                            lambda v: (
                                v.snapshot().current_wave > wave_before
                                and not v.snapshot().engines_running
                            )
                        )
                        assert fe.completed == fe.sent == 10
                        nursery.cancel_scope.cancel()
    finally:
        for process in processes:
            await _reap(process)
