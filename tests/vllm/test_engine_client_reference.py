"""The trio engine client against vLLM 0.33.0's own DP engine cores (torch-free harness).

Two real ``DPEngineCoreProc`` processes (``tests/vllm_reference/engine_side.py``: vLLM's
``EngineCoreProc.run_engine_core``, its busy loop, input/output threads, handshake,
``add_request``/``START_DP_WAVE`` handling, two-phase pause and SIGTERM shutdown) connect
to the client's handshake address as vLLM's launcher makes them (``local_client=True``),
and :func:`trio_dpcoord.open_engine_client`, with the coordinator inside, answers them.
Stand-ins (named in ``engine_side.py``): ``EngineCore.__init__``, the model executor (a
forward pass is a round of a real cross-process collective, so the ranks step in lock
step as MoE ranks do), the scheduler (one token a step, token ``n`` at step ``n``,
``max_tokens`` steps), the config objects and the gloo all-reduce. Everything on the
wire, on both sides, is real code: vLLM's and ours.
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.vllm_real import free_port
from tests.vllm_reference import vllm_env
from tests.vllm_reference.dp_cluster import EngineFleet, open_engine_fleet, prepare_cluster_root
from trio_dpcoord import (
    EngineClient,
    EngineDeadError,
    RequestOutput,
    SamplingParams,
    UtilityCallError,
    WaveSnapshot,
    open_engine_client,
)

pytestmark = pytest.mark.vllm

GUARD = 240.0  # two engine processes and the client on a shared 2-core machine
LONG = SamplingParams(max_tokens=100_000)


@pytest.fixture(scope="module")
def cluster_root(vllm_root: Path) -> Path:
    return prepare_cluster_root()


def _private_dirs() -> set[Path]:
    """The embedded coordinator's private ``ipc://`` directories that exist now."""
    return set(Path(tempfile.gettempdir()).glob("trio-dpcoord-*"))


@asynccontextmanager
async def _reference_fleet(
    root: Path, work_dir: Path, **fleet_options: Any
) -> AsyncIterator[tuple[EngineClient, EngineFleet, int]]:
    """Two 0.33.0 engines and the client that serves them; yields (client, fleet, the
    handshake port). The client leaves first, then the engines get SIGTERM."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    async with (
        open_engine_fleet(root, vllm_env(root), work_dir, address, **fleet_options) as fleet,
        open_engine_client(2, address, startup_timeout=120.0) as client,
    ):
        yield client, fleet, port


async def _wave_state(client: EngineClient) -> list[list[Any]]:
    """Each rank's ``[current_wave, engines_running]`` as its busy loop sees them (the
    harness's ``collective_rpc`` probe, through vLLM's utility path)."""
    answers = await client.call_utility_all("collective_rpc", "dp_wave_state")
    return [answer[0] for answer in answers]


async def _wait_paused(client: EngineClient) -> int:
    """Until the coordinator and both engines agree the fleet is paused, at one wave;
    that wave."""
    while True:
        snapshot = client.coordinator.snapshot()
        loads = client.coordinator.engine_loads()
        if not snapshot.engines_running and all(
            load.running == load.waiting == 0 for load in loads
        ):
            wave = snapshot.current_wave
            if await _wave_state(client) == [[wave, False], [wave, False]]:
                return wave
        await trio.sleep(0.05)


async def _take(stream: AsyncIterator[RequestOutput], tokens: int) -> list[int]:
    """Read outputs until ``tokens`` token ids came; those ids."""
    received: list[int] = []
    async for output in stream:
        received.extend(output.new_token_ids)
        if len(received) >= tokens:
            break
    return received


async def test_the_client_drives_vllm_033_engines(cluster_root: Path, tmp_path: Path) -> None:
    dirs_before = _private_dirs()
    with trio.fail_after(GUARD):
        async with _reference_fleet(cluster_root, tmp_path) as (client, fleet, port):
            # start-up: vLLM's handshake with our client, both ranks' ready responses
            assert sorted(client.ready_responses) == [0, 1]
            assert {r["data_parallel_rank"] for r in client.ready_responses.values()} == {0, 1}
            assert client.coordinator.subscriptions().current == 2

            # utility calls, results matched to their calls, vLLM's failure message
            assert await client.call_utility_all("is_sleeping") == [False, False]
            assert await client.call_utility("is_scheduler_paused", engine_index=1) is False
            with pytest.raises(UtilityCallError, match="no_such_method"):
                await client.call_utility("no_such_method", engine_index=0)
            first_wave = await _wait_paused(client)

            # requests streamed to completion on both ranks: token n at step n
            async def one(max_tokens: int, results: list[tuple[int, tuple[int, ...]]]) -> None:
                done = await client.complete([1, 2, 3], SamplingParams(max_tokens=max_tokens))
                assert done.finish_reason == "length"
                assert done.token_ids == tuple(range(1, max_tokens + 1))
                results.append((done.engine_index, done.token_ids))

            waves = [first_wave]
            for burst in range(2):
                results: list[tuple[int, tuple[int, ...]]] = []
                async with trio.open_nursery() as nursery:
                    for i in range(6):
                        nursery.start_soon(one, 3 + (i + burst) % 5, results)
                assert len(results) == 6 and {rank for rank, _ in results} == {0, 1}
                waves.append(await _wait_paused(client))
            assert waves == [first_wave, first_wave + 1, first_wave + 2], waves

            # a stale-stamped request, with the client's first-request notice held back
            # (its view says "running"): the engine that gets it wakes the fleet itself
            # (0.33.0: start_wave for any request that finds it idle), its peer joins the
            # forward passes, and nobody goes back to the stale wave
            wave = waves[-1]
            engine_starts = client.coordinator.statistics().wave_starts_by_cause.get(
                "engine_start_wave", 0
            )
            real_snapshot = client.coordinator.snapshot
            client.coordinator.snapshot = lambda: WaveSnapshot(0, True)  # type: ignore[method-assign]
            try:
                async with client.generate(
                    [4], SamplingParams(max_tokens=4), engine_index=0
                ) as stale:
                    client.coordinator.snapshot = real_snapshot  # type: ignore[method-assign]
                    assert [t async for o in stale for t in o.new_token_ids] == [1, 2, 3, 4]
            finally:
                client.coordinator.snapshot = real_snapshot  # type: ignore[method-assign]
            assert await _wait_paused(client) == wave + 1
            counters = client.coordinator.statistics()
            assert counters.wave_starts_by_cause.get("engine_start_wave", 0) > engine_starts

            # an abort mid-stream: the stream ends with "abort", the engine drops it
            async with client.generate([5], LONG, engine_index=1) as stream:
                assert len(await _take(stream, 3)) >= 3
                await client.abort(stream.request_id)
                rest = [output async for output in stream]
            assert rest[-1].finish_reason == "abort" and stream.finish_reason == "abort"
            # ... and a stream left mid-way is aborted on its engine the same way
            async with client.generate([6], LONG, engine_index=0) as stream:
                await _take(stream, 2)
            await _wait_paused(client)  # both long requests are gone from the engines

            # pause_scheduler("keep") mid-stream: a request sent while paused waits in
            # the queue; resume_scheduler (vLLM's DP barrier) and both run to the end, the
            # first one's tokens neither lost nor repeated
            async with client.generate(
                [7], SamplingParams(max_tokens=30), engine_index=0
            ) as running:
                before = await _take(running, 2)
                await client.pause_scheduler(mode="keep")
                assert await client.call_utility_all("is_scheduler_paused") == [True, True]
                async with client.generate(
                    [8], SamplingParams(max_tokens=5), engine_index=1
                ) as queued:
                    assert await client.call_utility("is_scheduler_paused", engine_index=1) is True
                    await client.resume_scheduler()
                    assert await client.call_utility_all("is_scheduler_paused") == [False, False]
                    after = [t async for output in running for t in output.new_token_ids]
                    assert before + after == list(range(1, 31))
                    assert [t async for o in queued for t in o.new_token_ids] == [1, 2, 3, 4, 5]
            await _wait_paused(client)

            # pause_generation("abort") (0.33.0): the running request ends with "abort",
            # a request sent while paused is refused with finish reason "error", and after
            # the resume requests run again
            async with client.generate([9], LONG, engine_index=1) as doomed:
                await _take(doomed, 1)
                await client.pause_generation(mode="abort")
                assert [o.finish_reason async for o in doomed][-1] == "abort"
            refused = await client.complete([10], SamplingParams(max_tokens=3), engine_index=0)
            assert refused.finish_reason == "error" and refused.token_ids == ()
            await client.resume_scheduler()
            again = await client.complete([11], SamplingParams(max_tokens=3))
            assert again.token_ids == (1, 2, 3) and again.finish_reason == "length"
            final_wave = await _wait_paused(client)

            stats = client.statistics()
            assert (stats.requests_in_flight, stats.streams_open, stats.calls_pending) == (
                0,
                0,
                0,
            )
            assert stats.dead_engines == frozenset()
            assert client.coordinator.statistics().errors == 0
            assert stats.rejected == {}

        # clean shutdown: the client is gone (nothing listens on its port, its ipc
        # directory is removed); vLLM's SIGTERM shutdown stops both engines, cleanly,
        # paused at one wave. SO_REUSEADDR because the client closed the engines'
        # connections itself: they may sit in TIME_WAIT, which is not a listener
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))
            probe.listen()
        assert _private_dirs() <= dirs_before
        await fleet.stop()
    for rank, process in enumerate(fleet.processes):
        report = fleet.report(rank)
        assert process.returncode == 0, fleet.log_tail()
        assert report["exception"] is None, report["exception"]
        assert (report["current_wave"], report["engines_running"]) == (final_wave, False)
    assert fleet.collective.failure is None


async def test_a_killed_engine_fails_the_requests_naming_the_rank(
    cluster_root: Path, tmp_path: Path
) -> None:
    """Rank 1 is killed mid-request: its request fails with :class:`EngineDeadError`
    naming rank 1 (its output connection is lost). Rank 0, blocked in a forward pass
    whose peer is gone, fails when the collective gives up: vLLM's engine sends
    ENGINE_CORE_DEAD and exits, and its request fails naming rank 0. No hang, nothing
    left running."""
    with trio.fail_after(GUARD):
        async with _reference_fleet(cluster_root, tmp_path, collective_timeout=3.0) as (
            client,
            fleet,
            _,
        ):
            async with (
                client.generate([1], LONG, engine_index=0) as survivor,
                client.generate([2], LONG, engine_index=1) as doomed,
            ):
                await _take(doomed, 1)
                await _take(survivor, 1)
                fleet.processes[1].kill()
                with pytest.raises(EngineDeadError) as killed:
                    async for _ in doomed:
                        pass
                assert killed.value.engine_index == 1
                assert "rank 1" in str(killed.value)
                with pytest.raises(EngineDeadError) as stuck:
                    async for _ in survivor:
                        pass
                assert stuck.value.engine_index == 0
            assert client.statistics().dead_engines == {0, 1}
            with pytest.raises(EngineDeadError, match="every engine is gone"):
                await client.complete([3])
            stats = client.statistics()
            assert (stats.requests_in_flight, stats.streams_open, stats.calls_pending) == (
                0,
                0,
                0,
            )
    killed_status = fleet.processes[1].returncode
    assert killed_status is not None and killed_status < 0  # killed
    # rank 0 died of its collective (vLLM's fatal-error path logs it; the report of a
    # process that died that way may not have been written)
    assert "CollectiveError: rank 0" in fleet.log_tail(), fleet.log_tail()
