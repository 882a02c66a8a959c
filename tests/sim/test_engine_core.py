"""The engine client drives simulated engine-core processes over real sockets.

``python -m trio_dpcoord.sim engine --handshake-address ...`` processes (the simulated
rank of trio_dpcoord/sim/engine.py: lock-step collective, waves, the coordinator's
sockets) speak vLLM's engine-core protocol; :func:`open_sim_engine_client` puts the very
client real vLLM engines get in front of them. Waves, aborts, utility calls, a killed
rank: what the client does with real engines, here with the simulated fleet.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from trio_dpcoord import (
    EngineClient,
    EngineDeadError,
    RequestOutput,
    SamplingParams,
    UtilityCallError,
)
from trio_dpcoord.sim import ClusterConfig, EngineCoreFleet, open_sim_engine_client
from trio_dpcoord.sim.engine_core import SIM_VLLM_VERSION

GUARD = 120.0  # engine processes on a shared 2-core machine


@asynccontextmanager
async def sim_fleet(
    engines: int, on_failure: Callable[[str], None] | None = None, **config: Any
) -> AsyncIterator[tuple[EngineClient, EngineCoreFleet]]:
    """``engines`` engine-core processes behind the client; engine exits go to
    ``on_failure`` (a test without it fails on any)."""
    seen: list[str] = []
    options = {"step_time": 0.005, "engine_log_level": "ERROR", **config}
    async with open_sim_engine_client(
        ClusterConfig(engines=engines, **options), on_failure=on_failure or seen.append
    ) as (client, fleet):
        yield client, fleet
        assert seen == []


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def read(stream: Any, count: int) -> list[RequestOutput]:
    outputs = []
    async for output in stream:
        outputs.append(output)
        if len(outputs) == count:
            break
    return outputs


async def wave_ends(client: EngineClient, after: int) -> int:
    """Wait until more than ``after`` waves completed and the fleet is idle."""
    coordinator = client.coordinator
    await coordinator.wait_for(
        lambda c: c.statistics().waves_completed > after and not c.snapshot().engines_running
    )
    return coordinator.statistics().waves_completed


@pytest.mark.parametrize("engines", [2, 4])
async def test_bursts_stream_tokens_and_waves_advance(engines: int) -> None:
    with trio.fail_after(GUARD):
        async with sim_fleet(engines) as (client, fleet):
            assert len(fleet.pids) == engines
            assert [client.ready_responses[r]["data_parallel_rank"] for r in range(engines)] == [
                *range(engines)
            ]
            assert {r["vllm_version"] for r in client.ready_responses.values()} == {
                SIM_VLLM_VERSION
            }
            waves = 0
            for burst in range(3):
                done: list[Any] = []

                async def one(max_tokens: int, done: list[Any] = done) -> None:
                    done.append((max_tokens, await client.complete([7, 8], params(max_tokens))))

                async with trio.open_nursery() as nursery:
                    for n in range(2 * engines):
                        nursery.start_soon(one, 3 + n % 4)
                for max_tokens, completion in done:
                    # the simulated engine's n-th token of a request is n
                    assert completion.token_ids == tuple(range(1, max_tokens + 1))
                    assert completion.finish_reason == "length"
                assert {c.engine_index for _, c in done} == set(range(engines)), burst
                # the idle gap: the engines end the wave, the coordinator sees it
                waves = await wave_ends(client, waves)
                assert client.coordinator.snapshot().current_wave == waves
            assert waves >= 3
            # a stream delivers one token per step, in order, the last with its reason
            async with client.generate([1], params(5), engine_index=engines - 1) as stream:
                outputs = [o async for o in stream]
            assert [o.new_token_ids for o in outputs] == [(1,), (2,), (3,), (4,), (5,)]
            assert [o.finish_reason for o in outputs] == [None] * 4 + ["length"]
            assert client.coordinator.statistics().errors == 0
            assert client.in_flight() == [] and client.statistics().calls_pending == 0


async def test_abort_utility_calls_and_pause() -> None:
    with trio.fail_after(GUARD):
        async with sim_fleet(3) as (client, _):
            # abort by id mid-stream: the stream ends at once; the engine drops the
            # request, so the wave can end (a request left running would hold it open)
            async with client.generate([1], params(10**6), engine_index=2) as stream:
                first = await read(stream, 2)
                await client.abort(stream.request_id)
                rest = [o async for o in stream]
            assert [o.new_token_ids for o in first] == [(1,), (2,)]
            assert [o.finish_reason for o in rest][-1:] == ["abort"]
            waves = await wave_ends(client, 0)
            assert [load.running for load in client.coordinator.engine_loads()] == [0, 0, 0]
            # a stream left early is aborted on its engine too
            async with client.generate([1], params(10**6)) as stream:
                await read(stream, 1)
            waves = await wave_ends(client, waves)

            # utility calls, answered as vLLM answers them
            assert await client.call_utility_all("is_scheduler_paused") == [False] * 3
            assert await client.call_utility("get_weight_version", engine_index=1) == "default"
            with pytest.raises(UtilityCallError, match="no method 'reset_everything'"):
                await client.call_utility("reset_everything", engine_index=0)

            # pause "keep": requests wait, unserved, until the resume
            await client.pause_scheduler("keep")
            assert await client.call_utility_all("is_scheduler_paused") == [True] * 3
            async with client.generate([1], params(3), engine_index=0) as held:
                with trio.move_on_after(0.5):
                    early = await read(held, 1)
                    pytest.fail(f"a paused engine stepped: {early}")
                await client.resume_scheduler()
                tokens = [o.new_token_ids async for o in held]
            assert tokens == [(1,), (2,), (3,)]
            assert held.finish_reason == "length"
            waves = await wave_ends(client, waves)

            # pause "abort": what is in flight ends aborted, from the engine
            async with client.generate([1], params(10**6), engine_index=1) as doomed:
                await read(doomed, 1)
                await client.pause_scheduler("abort")
                reasons = [o.finish_reason async for o in doomed]
            assert reasons[-1] == "abort"
            await client.resume_scheduler()
            completion = await client.complete([1], params(2))
            assert completion.token_ids == (1, 2)
            assert client.in_flight() == [] and client.statistics().calls_pending == 0


async def test_a_killed_engine_fails_its_requests_with_the_named_error() -> None:
    failures: list[str] = []
    both_exited = trio.Event()

    def exited(line: str) -> None:
        failures.append(line)
        if len(failures) == 2:
            both_exited.set()

    with trio.fail_after(GUARD):
        async with sim_fleet(2, exited, collective_timeout=2.0) as (client, fleet):
            async with (
                client.generate([1], params(10**6), engine_index=1) as doomed,
                client.generate([1], params(10**6), engine_index=0) as peer,
            ):
                await read(doomed, 1)
                await read(peer, 1)
                os.kill(fleet.pids[1], signal.SIGKILL)
                with pytest.raises(EngineDeadError) as killed:
                    async for _ in doomed:
                        pass
                assert killed.value.engine_index == 1
                # rank 0 steps in lock-step with the dead rank: its collective times
                # out, it says ENGINE_CORE_DEAD and exits; its request fails, no hang
                with pytest.raises(EngineDeadError) as broken:
                    async for _ in peer:
                        pass
                assert broken.value.engine_index == 0
            assert client.statistics().dead_engines == {0, 1}
            with pytest.raises(EngineDeadError, match="every engine is gone"):
                await client.complete([1], params(2))
            await both_exited.wait()  # the launcher saw both processes go, and how
    assert any("engine 1" in line and "SIGKILL" in line for line in failures), failures
    assert any("engine 0" in line and "status 3" in line for line in failures), failures
