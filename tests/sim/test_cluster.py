"""The simulated DP engines, front-end and cluster runner, over real sockets.

In-process tests drive the engines (run_engine, several ranks in one trio run, the
collective over ipc) with a hand-held coordinator socket pair and check the wire
behaviour of docs/protocol.md §6; the cluster tests run real engine processes against the
embedded and the standalone coordinator for every wake path.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
import zmq

from tests.helpers import sim_engine_config
from trio_dpcoord import EngineLoad, WaveSnapshot, open_coordinator, protocol
from trio_dpcoord.protocol import IDLE_LOAD
from trio_dpcoord.sim import (
    ClusterConfig,
    CollectiveTimeoutError,
    EmbeddedCoordinator,
    EngineConfig,
    EngineProtocolError,
    LoadPlan,
    SimFrontend,
    WakePath,
    open_sim_frontend,
    run_cluster,
    run_engine,
)
from trio_dpcoord.trio_zmq import AsyncSocket, open_context, open_socket

# --------------------------------------------------------------------------- helpers


@dataclass
class HandCoordinator:
    """The two engine-facing coordinator sockets, driven by the test."""

    xpub: AsyncSocket
    pull: AsyncSocket
    input_address: str
    output_address: str
    wave: int = 0
    notified: list[int] = field(default_factory=list)

    # WaveView for the simulated front-end: a fixed wave stamp, "paused".
    def snapshot(self) -> WaveSnapshot:
        return WaveSnapshot(self.wave, False)

    def engine_loads(self) -> Sequence[EngineLoad]:
        return ()

    def notify_first_request(self, engine_index: int) -> None:
        self.notified.append(engine_index)

    async def open_gate(self, engines: int) -> None:
        for _ in range(engines):
            assert await self.xpub.recv() == protocol.SUBSCRIBE
        # every simulated engine announces itself (one zero stats report) before READY
        announced = [await self.next_output() for _ in range(engines)]
        assert sorted(o.engine_index for o in announced) == list(range(engines))
        await self.xpub.send(protocol.READY)

    async def start_dp_wave(self, wave: int, exclude: int | None) -> None:
        await self.xpub.send_multipart(protocol.encode_start_dp_wave(wave, exclude))

    async def next_output(self) -> protocol.EngineCoreOutputs:
        return protocol.decode_engine_core_outputs(await self.pull.recv())

    async def outputs_until(
        self, done: type[object] | None = None, **field_is: int
    ) -> list[protocol.EngineCoreOutputs]:
        """Collect engine outputs up to and including the first whose fields match."""
        seen = []
        while True:
            out = await self.next_output()
            seen.append(out)
            if all(getattr(out, k) == v for k, v in field_is.items()):
                return seen


@asynccontextmanager
async def hand_coordinator(tmp_path: Path) -> AsyncIterator[HandCoordinator]:
    async with open_context() as context:
        async with open_socket(context, zmq.XPUB, options={zmq.XPUB_VERBOSE: 1}) as xpub:
            async with open_socket(context, zmq.PULL) as pull:
                yield HandCoordinator(
                    xpub,
                    pull,
                    xpub.bind(f"ipc://{tmp_path}/back-pub"),
                    pull.bind(f"ipc://{tmp_path}/back-out"),
                )


def engine_config(
    rank: int,
    engines: int,
    coordinator: HandCoordinator | EmbeddedCoordinator,
    frontend: SimFrontend,
    tmp_path: Path,
    **overrides: object,
) -> EngineConfig:
    """An engine of these tests: a 1 s collective timeout, so that a stranded rank fails
    fast."""
    if isinstance(coordinator, HandCoordinator):
        inp, out = coordinator.input_address, coordinator.output_address
    else:
        inp, out = coordinator.back_publish_address, coordinator.back_output_address
    settings: dict[str, object] = {"collective_timeout": 1.0, **overrides}
    return sim_engine_config(rank, engines, inp, out, frontend, tmp_path, **settings)


class Failures(dict[int, BaseException]):
    """Fatal engine errors by rank, with an event set on the first one."""

    def __init__(self) -> None:
        super().__init__()
        self.event = trio.Event()


async def run_rank(config: EngineConfig, failures: Failures) -> None:
    """Run one rank in-process; record (instead of raise) the engine's fatal errors."""
    try:
        await run_engine(config)
    except (CollectiveTimeoutError, EngineProtocolError) as exc:
        failures[config.rank] = exc
        failures.event.set()


@asynccontextmanager
async def hand_cluster(
    tmp_path: Path,
    engines: int,
    failures: Failures,
    *,
    wake_path: WakePath = "both",
    **engine_overrides: object,
) -> AsyncIterator[tuple[HandCoordinator, SimFrontend]]:
    """The opening of the engine-wire tests: the hand-driven coordinator sockets, a
    simulated front-end, and ``engines`` ranks run in-process (their fatal errors recorded
    in ``failures``), yielded once the gate has opened and every engine is ready. Leaving
    the block stops the ranks still running."""
    async with hand_coordinator(tmp_path) as coord:
        async with open_sim_frontend(coord, engines, wake_path=wake_path) as fe:
            async with trio.open_nursery() as nursery:
                for rank in range(engines):
                    config = engine_config(rank, engines, coord, fe, tmp_path, **engine_overrides)
                    nursery.start_soon(run_rank, config, failures)
                await coord.open_gate(engines)
                await fe.wait_for(lambda f: all(f.engine_ready))
                yield coord, fe
                nursery.cancel_scope.cancel()


def counts(outs: list[protocol.EngineCoreOutputs], engine: int) -> list[tuple[int, int]]:
    return [
        (o.scheduler_stats.num_running_reqs, o.scheduler_stats.num_waiting_reqs)
        for o in outs
        if o.engine_index == engine and o.scheduler_stats is not None
    ]


def wave_fields(outs: list[protocol.EngineCoreOutputs]) -> list[tuple[int, str, int]]:
    """(engine, "start_wave"|"wave_complete", wave) in arrival order."""
    result = []
    for o in outs:
        if o.start_wave is not None:
            result.append((o.engine_index, "start_wave", o.start_wave))
        if o.wave_complete is not None:
            result.append((o.engine_index, "wave_complete", o.wave_complete))
    return result


def assert_reaped(pids: Sequence[int | None]) -> None:
    for pid in pids:
        if pid is None:
            continue
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --------------------------------------------------------------------------- engine wire


async def test_engine_wakes_itself_mirrors_completes_and_honours_exclusion(
    tmp_path: Path,
) -> None:
    """§6.3-§6.6 on the wire, then an excluded rank strands its peer (collective timeout)."""
    failures = Failures()
    with trio.fail_after(20):
        async with hand_cluster(tmp_path, 2, failures, wake_path="engine") as (coord, fe):
            # A request reaches idle engine 1: it wakes itself and reports
            # start_wave before anything else (R5), then its load.
            await fe.submit(max_tokens=3, engine=1)
            first = await coord.next_output()
            assert (first.engine_index, first.start_wave) == (1, 0)
            assert first.scheduler_stats is None

            # Engine 1 now blocks in its first collective until rank 0 joins.
            await coord.start_dp_wave(0, 1)
            outs = await coord.outputs_until(engine_index=0, wave_complete=0)
            assert wave_fields(outs) == [(0, "start_wave", 0), (0, "wave_complete", 0)]
            assert counts([first, *outs], 1) == [(0, 1), (1, 0), (0, 0)]
            assert all(
                o.scheduler_stats.current_wave == 0 for o in outs if o.scheduler_stats is not None
            )
            await fe.wait_for(lambda f: f.completed == 1)
            await fe.wait_for(lambda f: f.engine_running == [False, False])
            assert fe.waves_completed == {0}
            assert fe.wave_regressions == 0

            # START_DP_WAVE [1, exclude 0]: only rank 1 wakes, and its first step
            # waits for rank 0 in vain.
            await coord.start_dp_wave(1, 0)
            await fe.wait_for(lambda f: f.engine_running == [False, True])
            await failures.event.wait()
    error = failures[1]
    assert isinstance(error, CollectiveTimeoutError)
    assert error.missing == (0,)
    assert str(error).startswith("collective timeout at wave 1 step 1: ranks [0] never arrived")
    assert 0 not in failures


async def test_legacy_engine_reports_only_stale_requests(tmp_path: Path) -> None:
    """Pre-0.33 engines (the front-end wake path): no start_wave for a current-wave
    request, start_wave(current) for a request stamped with a finished wave (R2)."""
    failures = Failures()
    with trio.fail_after(20):
        async with hand_cluster(
            tmp_path, 2, failures, wake_path="frontend", report_start_wave=False
        ) as (coord, fe):
            await fe.submit(max_tokens=2, engine=1)
            assert coord.notified == [1]  # the front-end's wake notice
            first = await coord.next_output()
            assert first.engine_index == 1 and first.start_wave is None
            assert counts([first], 1) == [(0, 1)]
            await coord.start_dp_wave(0, 1)  # what the coordinator answers
            outs = await coord.outputs_until(engine_index=0, wave_complete=0)
            assert wave_fields(outs) == [(0, "start_wave", 0), (0, "wave_complete", 0)]
            await fe.wait_for(lambda f: f.completed == 1)

            # Stamped 0 while the engines are at wave 1 and idle: report wave 1.
            await fe.wait_for(lambda f: f.engine_running == [False, False])
            await fe.submit(max_tokens=2, engine=1)
            outs = await coord.outputs_until(engine_index=1, start_wave=1)
            assert wave_fields(outs) == [(1, "start_wave", 1)]
            await coord.start_dp_wave(1, 1)
            outs = await coord.outputs_until(engine_index=0, wave_complete=1)
            assert wave_fields(outs) == [(0, "start_wave", 1), (0, "wave_complete", 1)]
            await fe.wait_for(lambda f: f.completed == 2)
    assert failures == {}


async def test_engines_report_a_start_dp_wave_older_than_one_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator's wave going back, as engines see it: a START_DP_WAVE older than
    one received before is counted and logged by every rank that receives it (what the
    restart benchmarks count over a fleet), and changes nothing else; a newer one after
    it is no regression."""
    failures = Failures()
    regression = re.compile(r"rank (\d): START_DP_WAVE\((\d+)\) after START_DP_WAVE\((\d+)\)")

    def seen() -> list[tuple[str, ...]]:
        return sorted(
            match.groups() for r in caplog.records if (match := regression.search(r.getMessage()))
        )

    with trio.fail_after(20):
        async with hand_cluster(tmp_path, 2, failures) as (coord, fe):
            await coord.start_dp_wave(2, None)
            await coord.outputs_until(engine_index=0, wave_complete=2)
            await coord.start_dp_wave(1, None)
            while len(seen()) < 2:  # noqa: ASYNC110 - the engines log it as they read it
                await trio.sleep(0.01)
            await coord.start_dp_wave(3, None)
            await coord.outputs_until(engine_index=0, wave_complete=3)
            await fe.wait_for(lambda f: f.engine_wave == [3, 3] and not any(f.engine_running))
    assert seen() == [("0", "1", "2"), ("1", "1", "2")]
    assert failures == {}
    assert fe.wave_regressions == 0


async def test_invalid_broadcast_kills_the_engine_like_vllm(tmp_path: Path) -> None:
    failures = Failures()
    with trio.fail_after(20):
        async with hand_cluster(tmp_path, 1, failures) as (coord, _fe):
            await coord.xpub.send_multipart([b"\x07", b"\x90"])
            await failures.event.wait()
    assert isinstance(failures[0], EngineProtocolError)
    assert "invalid broadcast" in str(failures[0])


async def test_two_phase_pause_and_resume_with_a_kept_request(tmp_path: Path) -> None:
    """§6.8 / R6 against the real coordinator: pausing ends a wave; a request kept by a
    paused engine wakes nobody; resuming it wakes the group and the request completes."""
    failures = Failures()
    with trio.fail_after(30):
        async with open_coordinator(2, ready_timeout=10) as coord:
            async with open_sim_frontend(coord, 2, wake_path="engine") as fe:
                async with trio.open_nursery() as nursery:
                    for rank in range(2):
                        nursery.start_soon(
                            run_rank, engine_config(rank, 2, coord, fe, tmp_path), failures
                        )
                    await coord.wait_ready()
                    await fe.wait_for(lambda f: all(f.engine_ready))
                    await fe.submit(max_tokens=2)
                    await coord.wait_for(lambda c: c.snapshot() == WaveSnapshot(1, False))
                    assert fe.completed == 1

                    await fe.pause_engines()  # both agree at the next sync point: wave 1 ends
                    await coord.wait_for(lambda c: c.snapshot() == WaveSnapshot(2, False))

                    await fe.submit(max_tokens=2, engine=1)
                    await coord.wait_for(lambda c: c.engine_loads()[1][0] == 1)
                    assert coord.snapshot() == WaveSnapshot(2, False)  # nobody woke
                    assert fe.engine_running == [False, False]

                    await fe.resume_engines([0])
                    await fe.resume_engines([1])  # engine 1 wakes the group
                    await fe.wait_for(lambda f: f.completed == 2)
                    await coord.wait_for(lambda c: c.snapshot() == WaveSnapshot(3, False))
                    assert coord.statistics().errors == 0
                    assert fe.wave_regressions == 0
                    nursery.cancel_scope.cancel()
    assert failures == {}


# --------------------------------------------------------------------------- clusters


@pytest.mark.parametrize(
    ("mode", "wake_path", "engines"),
    [
        ("inproc", "engine", 2),
        ("inproc", "frontend", 4),
        ("inproc", "both", 4),
        ("standalone", "engine", 4),
        ("standalone", "frontend", 2),
        ("standalone", "both", 2),
    ],
)
async def test_cluster_completes_every_request(mode: str, wake_path: str, engines: int) -> None:
    config = ClusterConfig(
        engines=engines,
        mode=mode,  # type: ignore[arg-type]
        wake_path=wake_path,  # type: ignore[arg-type]
        load=LoadPlan(requests=60, seed=7, burst=(4, 15), gap=(0.0, 0.08), pause_every=2),
        collective_timeout=5.0,
    )
    lines: list[str] = []
    with trio.fail_after(90):
        report = await run_cluster(config, log_line=lines.append)
    assert report.failures == [], lines
    assert report.engine_failures == []
    assert report.collective_timeouts == []
    assert (report.requests, report.completed) == (60, 60)
    assert report.wave_regressions == 0
    assert report.errors == 0 and report.coordinator_errors == 0
    assert report.ok
    assert report.waves >= 2 and report.pauses >= 1
    assert len(report.wake_latencies) >= 1
    assert (report.notifications > 0) == (wake_path != "engine")
    assert len(report.engine_pids) == engines
    assert (report.coordinator_pid is not None) == (mode == "standalone")
    assert_reaped([*report.engine_pids, report.coordinator_pid])


@dataclass
class _Counters:
    errors: int = 0


class NeverBroadcastingCoordinator:
    """A broken coordinator: opens the start-up gate (READY) but never sends
    START_DP_WAVE, whatever the engines report."""

    def __init__(self, xpub: AsyncSocket, pull: AsyncSocket, engines: int) -> None:
        self._xpub = xpub
        self._pull = pull
        self._engines = engines
        self._ready = trio.Event()
        self.back_publish_address = xpub.last_endpoint or ""
        self.back_output_address = pull.last_endpoint or ""
        self.start_waves: list[int] = []

    def statistics(self) -> _Counters:
        return _Counters()

    def snapshot(self) -> WaveSnapshot:
        return WaveSnapshot(0, False)

    def engine_loads(self) -> Sequence[EngineLoad]:
        return (IDLE_LOAD,) * self._engines

    def notify_first_request(self, engine_index: int) -> None:
        pass

    def expect_shutdown(self) -> None:
        pass  # it logs nothing about engines leaving

    async def wait_ready(self) -> None:
        await self._ready.wait()

    async def serve(self) -> None:
        for _ in range(self._engines):
            await self._xpub.recv()
        await self._xpub.send(protocol.READY)
        self._ready.set()
        while True:
            out = protocol.decode_engine_core_outputs(await self._pull.recv())
            if out.start_wave is not None:
                self.start_waves.append(out.engine_index)


async def test_broken_coordinator_strands_engines_and_the_run_fails(tmp_path: Path) -> None:
    broken: list[NeverBroadcastingCoordinator] = []

    @asynccontextmanager
    async def open_broken(engines: int) -> AsyncIterator[EmbeddedCoordinator]:
        async with open_context() as context:
            async with open_socket(context, zmq.XPUB, options={zmq.XPUB_VERBOSE: 1}) as xpub:
                async with open_socket(context, zmq.PULL) as pull:
                    xpub.bind(f"ipc://{tmp_path}/broken-pub")
                    pull.bind(f"ipc://{tmp_path}/broken-out")
                    coordinator = NeverBroadcastingCoordinator(xpub, pull, engines)
                    broken.append(coordinator)
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(coordinator.serve)
                        yield coordinator
                        nursery.cancel_scope.cancel()

    def factory(engines: int) -> AbstractAsyncContextManager[EmbeddedCoordinator]:
        return open_broken(engines)

    config = ClusterConfig(
        engines=3,
        wake_path="engine",
        load=LoadPlan(requests=1, pause_every=0),
        collective_timeout=1.0,
    )
    lines: list[str] = []
    with trio.fail_after(60):
        report = await run_cluster(config, coordinator_factory=factory, log_line=lines.append)
    assert not report.ok
    assert report.completed == 0
    # The chooser sends the only request to engine 0, which wakes itself, reports
    # start_wave and steps alone: the collective names the two sleeping ranks.
    assert broken[0].start_waves == [0]
    assert len(report.collective_timeouts) == 1, lines
    assert re.search(
        r"^trio_dpcoord\.sim engine rank 0: collective timeout at wave 0 step 1: "
        r"ranks \[1, 2\] never arrived",
        report.collective_timeouts[0],
    )
    assert report.engine_failures[0].startswith("engine 0 ")
    assert report.engine_failures[0].endswith("exited with status 3")
    assert_reaped(report.engine_pids)
