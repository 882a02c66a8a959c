"""Faults: an engine killed mid-wave, the standalone coordinator killed and
restarted under live engines (vLLM #32136), a front-end that reconnects."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from pathlib import Path

import msgpack
import pytest
import trio
import zmq

from tests.helpers import sim_engine_config
from trio_dpcoord import (
    Coordinator,
    CoordinatorError,
    WaveSnapshot,
    open_coordinator,
    open_frontend,
)
from trio_dpcoord.protocol import engine_identity
from trio_dpcoord.sim import (
    ClusterConfig,
    EmbeddedCoordinator,
    EngineConfig,
    LoadPlan,
    Progress,
    SimEngine,
    SimFrontend,
    open_sim_frontend,
    run_cluster,
)
from trio_dpcoord.sim.collective import AllReduceResult, CollectiveClient, CollectiveHost
from trio_dpcoord.sim.engine import run_sim_engine
from trio_dpcoord.testing import ServeProcess, open_serve
from trio_dpcoord.trio_zmq import AsyncSocket, open_context, open_socket


@asynccontextmanager
async def _recording_coordinator(
    handles: list[Coordinator], engines: int
) -> AsyncIterator[EmbeddedCoordinator]:
    """The cluster runner's coordinator, with its handle kept for the test to inspect."""
    async with open_coordinator(engines, ready_timeout=30) as coordinator:
        handles.append(coordinator)
        yield coordinator


async def test_a_killed_engine_is_named_with_its_wave_promptly() -> None:
    """SIGKILL one engine process mid-run: the launcher names the rank and its wave and
    stops at once (well before the 20 s collective timeout would have)."""
    handles: list[Coordinator] = []
    factory = partial(_recording_coordinator, handles)
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


def _config(rank: int, count: int, inp: str, out: str, fe: SimFrontend, tmp: Path) -> EngineConfig:
    """An engine of these tests, with a 10 s collective timeout."""
    return sim_engine_config(rank, count, inp, out, fe, tmp, collective_timeout=10.0)


async def test_a_vanished_engine_shows_in_the_engine_view_and_gets_ready_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine's sockets close (as when its process dies): the coordinator logs the
    unsubscription and counts it; the engine restarted on the same rank subscribes
    late and gets READY."""
    caplog.set_level(logging.WARNING, logger="trio_dpcoord")
    with trio.fail_after(30):
        async with open_coordinator(2, ready_timeout=10) as coord:
            async with open_sim_frontend(coord, 2) as fe:

                def config(rank: int) -> EngineConfig:
                    return _config(
                        rank,
                        2,
                        coord.back_publish_address,
                        coord.back_output_address,
                        fe,
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
                    assert coord.statistics().ready_broadcasts == 2
                    view = coord.subscriptions()
                    assert (view.current, view.subscribed, view.unsubscribed) == (2, 3, 1)
                    nursery.cancel_scope.cancel()


async def _run_in(scope: trio.CancelScope, engine: SimEngine) -> None:
    with scope:
        await run_sim_engine(engine)


def _serve(tmp_path: Path, engines: int) -> AbstractAsyncContextManager[ServeProcess]:
    """The standalone coordinator on fixed ipc addresses, so a restart takes them over."""
    return open_serve(
        f"--engines={engines}",
        f"--front=ipc://{tmp_path}/front",
        f"--back-pub=ipc://{tmp_path}/bp",
        f"--back-out=ipc://{tmp_path}/bo",
        "--exit-on-stdin-eof",
        "--log-level=WARNING",
    )


async def test_coordinator_killed_and_restarted_under_live_engines(tmp_path: Path) -> None:
    """vLLM #32136 and a restart: SIGKILL the standalone coordinator under a live fleet;
    the front-end with coordinator_timeout raises within the bound, every engine logs
    the loss at once; a coordinator restarted on the same addresses gets every engine
    back (gate, READY), the other front-end gets its next publish, the wave moves on
    from what the engines report and no request is stranded."""
    async with _serve(tmp_path, 2) as first:
        endpoints = first.endpoints
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
                                fe,
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
                                    await strict.wait_for(
                                        lambda s: s.statistics().publishes_received > 0
                                    )
                                    task_status.started()
                                    await trio.sleep_forever()
                            lost.append(trio.current_time())

                        await nursery.start(strict_front_end)
                        for _ in range(4):  # in flight when the coordinator dies
                            await fe.submit(max_tokens=6)
                        first.process.send_signal(signal.SIGKILL)
                        killed_at = trio.current_time()
                        await first.process.wait()
                        while not all(e.coordinator_lost.is_set() for e in engines):  # noqa: ASYNC110
                            await trio.sleep(0.02)
                        engines_knew = trio.current_time() - killed_at
                        while not lost:  # noqa: ASYNC110 - set by the task above
                            await trio.sleep(0.05)
                        assert 2.0 <= lost[0] - killed_at < 6.0
                        assert engines_knew < 3.0
                        assert all(e.counters.coordinator_disconnects == 1 for e in engines)
                        await fe.wait_for(lambda f: f.pending == 0)  # the wave finished anyway

                        publishes = view.statistics().publishes_received
                        async with _serve(tmp_path, 2):  # the restart
                            await view.wait_for(
                                lambda v: v.statistics().publishes_received > publishes
                            )
                            assert view.statistics().disconnects == 1 and view.connected()
                            while not all(e.counters.coordinator_reconnects == 1 for e in engines):  # noqa: ASYNC110
                                await trio.sleep(0.02)
                            # The restarted coordinator starts at wave 0; the engines' reports
                            # take it past every wave it had reached before.
                            for rank in (0, 1, 0):
                                await fe.submit(max_tokens=2, engine=rank)
                                await fe.wait_for(lambda f: f.pending == 0)
                            await view.wait_for(
                                lambda v: (
                                    v.snapshot().current_wave > wave_before
                                    and not v.snapshot().engines_running
                                )
                            )
                            assert fe.completed == fe.sent == 10
                            nursery.cancel_scope.cancel()


_ClientFactory = Callable[[int], AbstractAsyncContextManager[tuple[CollectiveClient, AsyncSocket]]]


@asynccontextmanager
async def _collective(
    tmp_path: Path, ranks: int, round_timeout: float
) -> AsyncIterator[tuple[CollectiveHost, _ClientFactory]]:
    """A collective host over ipc, and a factory of rank clients (each a new DEALER with
    the rank's identity and a new incarnation: a new rank process)."""
    address = f"ipc://{tmp_path}/collective"
    async with open_context() as context:
        async with open_socket(
            context,
            zmq.ROUTER,
            bind=address,
            options={zmq.ROUTER_HANDOVER: 1, zmq.RCVHWM: 0, zmq.SNDHWM: 0},
        ) as router:
            host = CollectiveHost(router, ranks, timeout=round_timeout)

            @asynccontextmanager
            async def client(rank: int) -> AsyncIterator[tuple[CollectiveClient, AsyncSocket]]:
                async with open_socket(
                    context,
                    zmq.DEALER,
                    connect=address,
                    options={zmq.IDENTITY: engine_identity(rank), zmq.LINGER: 0},
                ) as dealer:
                    yield CollectiveClient(dealer, rank, timeout=round_timeout), dealer

            async with trio.open_nursery() as nursery:
                await nursery.start(host.run)
                yield host, client
                nursery.cancel_scope.cancel()


async def _all_step(
    clients: list[CollectiveClient], wave: int, step: int, unfinished: list[bool]
) -> list[AllReduceResult]:
    results: list[AllReduceResult | None] = [None] * len(clients)

    async def one(i: int) -> None:
        results[i] = await clients[i].step(
            wave=wave, step=step, has_unfinished=unfinished[i], pending_pause=False
        )

    async with trio.open_nursery() as nursery:
        for i in range(len(clients)):
            nursery.start_soon(one, i)
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


async def _wait_arrival(host: CollectiveHost, key: tuple[int, int], ranks: tuple[int, ...]) -> None:
    while host.open_rounds().get(key) != ranks:  # noqa: ASYNC110 - host state, test only
        await trio.sleep(0.01)


async def test_collective_rank_restarted_at_a_wave_boundary_rejoins(tmp_path: Path) -> None:
    """Host + 2 ranks over ipc: wave 1 in lock-step, rank 1's process dies at the wave
    boundary and a new one (same identity, new incarnation) steps wave 2 with rank 0."""
    with trio.fail_after(20):
        async with _collective(tmp_path, 2, round_timeout=5.0) as (host, client):
            async with client(0) as (rank_0, _):
                async with client(1) as (rank_1, _):
                    for step in (1, 2, 3):
                        results = await _all_step([rank_0, rank_1], 1, step, [True, step < 3])
                        assert results == [AllReduceResult(2 if step < 3 else 1, 0)] * 2
                # rank 1's socket is closed: its process is gone, idle after wave 1
                async with client(1) as (rank_1_again, _):
                    assert rank_1_again.incarnation != rank_1.incarnation
                    for step in (1, 2):
                        results = await _all_step([rank_0, rank_1_again], 2, step, [False, True])
                        assert results == [AllReduceResult(1, 0)] * 2
            assert host.completed_rounds == 5
            assert host.rejoins == 1 and host.duplicates == 0 and host.stale_dropped == 0
            assert host.failure is None and host.open_rounds() == {}


async def test_collective_stale_contribution_of_a_dead_rank_is_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 1 contributes to (2, 1) and (3, 1) and dies before rank 0 arrives: its
    restarted process contributing to (2, 1) again replaces the stale contribution (no
    duplicate; the sums count the new one) and the round only the dead process joined
    does not time out. The same process contributing twice is still a duplicate."""
    caplog.set_level(logging.WARNING, logger="trio_dpcoord.sim.collective")
    with trio.fail_after(20):
        async with _collective(tmp_path, 2, round_timeout=1.0) as (host, client):
            async with client(0) as (rank_0, _):
                async with client(1) as (rank_1, _):
                    await _all_step([rank_0, rank_1], 1, 1, [False, False])
                    for wave in (2, 3):  # rank 1 steps ahead alone, then dies mid-step
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(
                                partial(
                                    rank_1.step,
                                    wave=wave,
                                    step=1,
                                    has_unfinished=True,
                                    pending_pause=True,
                                )
                            )
                            await _wait_arrival(host, (wave, 1), (1,))
                            nursery.cancel_scope.cancel()
                    assert host.open_rounds() == {(2, 1): (1,), (3, 1): (1,)}
                async with client(1) as (rank_1_again, dealer):
                    # The new process arrives first (had rank 0 arrived first, the stale
                    # contribution would have completed the round, as it would in a
                    # real group).
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(
                            partial(
                                rank_1_again.step,
                                wave=2,
                                step=1,
                                has_unfinished=False,
                                pending_pause=False,
                            )
                        )
                        while host.rejoins == 0:  # noqa: ASYNC110 - host state, test only
                            await trio.sleep(0.01)
                        assert host.open_rounds() == {(2, 1): (1,)}
                        result = await rank_0.step(
                            wave=2, step=1, has_unfinished=False, pending_pause=False
                        )
                        assert result == AllReduceResult(0, 0)
                    assert host.stale_dropped == 2 and host.duplicates == 0
                    # (3, 1) held only the dead process's contribution: gone, no timeout.
                    await trio.sleep(1.5)
                    assert host.failure is None and host.open_rounds() == {}
                    results = await _all_step([rank_0, rank_1_again], 2, 2, [True, False])
                    assert results == [AllReduceResult(1, 0)] * 2

                    # The same process twice in one round: a duplicate, dropped and logged.
                    contribution = msgpack.packb([2, 3, 1, 0, rank_1_again.incarnation])
                    await dealer.send(contribution)
                    await dealer.send(contribution)
                    while host.duplicates == 0:  # noqa: ASYNC110 - host state, test only
                        await trio.sleep(0.01)
                    result = await rank_0.step(
                        wave=2, step=3, has_unfinished=False, pending_pause=False
                    )
                    assert result == AllReduceResult(1, 0)
            assert host.completed_rounds == 4 and host.rejoins == 1
    assert any("contributed twice to wave 2 step 3" in r.message for r in caplog.records)
    assert any("rank 1 rejoined (restarted) at wave 2" in r.message for r in caplog.records)


async def test_a_vanished_engine_is_restarted_and_the_cluster_goes_on() -> None:
    """restart_vanished: rank 1 is paused holding 3 requests pinned to it, then SIGKILLed
    while every engine is idle. The launcher reports it, the coordinator sees the
    unsubscription and a late subscription, the new rank 1 gets READY, the 3 stranded
    requests are resubmitted and every request completes, with no collective timeout and
    no process left behind."""
    handles: list[Coordinator] = []
    factory = partial(_recording_coordinator, handles)
    killed: list[int] = []
    subscriptions_after_kill: list[tuple[int, int]] = []
    subscriptions_after_restart: list[tuple[int, int, int]] = []
    bursts = 0

    async def kill_rank_1(frontend: SimFrontend, progress: Progress) -> None:
        nonlocal bursts
        bursts += 1
        if bursts == 3:  # the burst after the restart completed
            view = handles[0].subscriptions()
            subscriptions_after_restart.append(
                (view.current, view.unsubscribed, view.late_subscriptions)
            )
        if bursts != 2:
            return
        await frontend.pause_engines()
        for _ in range(3):  # kept by the paused rank 1: in flight on it when it dies
            await frontend.submit(max_tokens=4, engine=1)
        await frontend.resume_engines([0, 2])
        pid = progress.engine_pids[1]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        await frontend.wait_for(lambda f: 1 in f.lost_engines)
        coordinator = handles[0]
        await coordinator.wait_for(lambda c: c.subscriptions().unsubscribed == 1)
        view = coordinator.subscriptions()
        subscriptions_after_kill.append((view.current, view.unsubscribed))

    config = ClusterConfig(
        engines=3,
        wake_path="engine",
        load=LoadPlan(requests=60, burst=(10, 10), gap=(0.0, 0.05), pause_every=0),
        collective_timeout=10.0,
        restart_vanished=True,
    )
    lines: list[str] = []
    with trio.fail_after(40):
        report = await run_cluster(
            config, coordinator_factory=factory, log_line=lines.append, between_bursts=kill_rank_1
        )
    assert killed, "the hook never ran"
    assert report.ok, (report.to_json(), lines[-20:])
    assert report.engine_failures == [] and report.collective_timeouts == []
    assert len(report.engine_restarts) == 1
    assert re.fullmatch(
        rf"engine 1 \(pid {killed[0]}\) vanished idle after wave \d+: rank 1 exited "
        r"with status -9 \(SIGKILL\)",
        report.engine_restarts[0],
    ), report.engine_restarts[0]
    assert subscriptions_after_kill == [(2, 1)]
    assert subscriptions_after_restart == [(3, 1, 1)]
    assert handles[0].statistics().ready_broadcasts == 2
    assert report.resubmitted == 3
    assert report.requests == report.completed == 63
    summary = report.to_json()
    assert summary["ok"] is True and summary["resubmitted"] == 3
    assert report.engine_pids[1] != killed[0]
    for pid in (*report.engine_pids, *killed):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_curve_simulated_engines_work_and_a_keyless_engine_is_kept_out(
    tmp_path: Path,
) -> None:
    """Optional CURVE: simulated engines with the coordinator's key run waves;
    an engine without it never gets through the start-up gate (its subscription and
    announcement never arrive)."""
    _, secret = zmq.curve_keypair()
    with trio.fail_after(30):
        async with open_coordinator(2, ready_timeout=10, curve_secret_key=secret) as coord:
            async with open_sim_frontend(coord, 2) as fe:

                def config(rank: int, key: bytes | None) -> EngineConfig:
                    return dataclasses.replace(
                        _config(
                            rank,
                            2,
                            coord.back_publish_address,
                            coord.back_output_address,
                            fe,
                            tmp_path,
                        ),
                        curve_server_key=key,
                    )

                async with trio.open_nursery() as nursery:
                    keyless = SimEngine(config(1, None))
                    stranger = trio.CancelScope()
                    nursery.start_soon(_run_in, stranger, keyless)
                    nursery.start_soon(run_sim_engine, SimEngine(config(0, coord.curve_public_key)))
                    # Engine 0's announcement (output socket) and its subscription (input
                    # socket) travel on different sockets, in no order: wait for both.
                    await coord.wait_for(
                        lambda c: c.silent_engines() == [1] and c.subscriptions().current >= 1
                    )
                    assert coord.subscriptions().current == 1  # the keyless engine: nothing
                    stranger.cancel()
                    nursery.start_soon(run_sim_engine, SimEngine(config(1, coord.curve_public_key)))
                    await coord.wait_ready()
                    await fe.wait_for(lambda f: all(f.engine_ready))
                    assert not keyless.ready
                    await fe.submit(max_tokens=3, engine=1)
                    await fe.wait_for(lambda f: f.completed == 1)
                    await coord.wait_for(lambda c: c.snapshot() == WaveSnapshot(1, False))
                    assert coord.statistics().errors == 0
                    nursery.cancel_scope.cancel()
