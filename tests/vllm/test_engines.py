"""vLLM 0.33.0's engine-side DP code against our coordinator (and vLLM's, and broken ones).

N real ``DPEngineCoreProc`` processes (vLLM's ``EngineCoreProc.run_engine_core``: busy
loop, input/output threads, READY wait, START_DP_WAVE handling, ``add_request``'s
``start_wave``, ``_maybe_publish_request_counts``, ``_has_global_unfinished_reqs``, the
two-phase pause) step in lock-step through a real cross-process collective, under a
bursty load sent through vLLM's own front-end request path (``DPLBAsyncMPClient``), after
vLLM's own startup handshake (``wait_for_engine_startup``). See
``tests/vllm_reference/engine_side.py`` for what stands in for torch (model executor,
scheduler, KV cache, the gloo all-reduce) and ``frontend_side.py`` for the front-end.

Pass criteria (:func:`tests.vllm_reference.dp_cluster.failures`): every request
completes with all its tokens, no collective round stalls or times out, no engine or
front-end exception, the front-end never sees the wave go backwards, every engine ends
paused on the same wave. The negative controls (a coordinator that never wakes the
engines, one that broadcasts the previous wave) must fail those same checks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import zmq

from tests.vllm_reference import open_vllm_coordinator, vllm_env
from tests.vllm_reference.dp_cluster import (
    Addresses,
    ClusterResult,
    Coordinator,
    Scenario,
    failures,
    prepare_cluster_root,
    run_cluster,
)
from trio_dpcoord import protocol
from trio_dpcoord.testing import open_serve
from trio_dpcoord.trio_zmq import open_context, open_socket

pytestmark = pytest.mark.vllm

GUARD = 240.0  # generous: 2..4 engine processes and a front-end on a shared 2-core machine

KEY_ENGINE_METHODS = (
    "vllm.v1.engine.core:EngineCoreProc.run_engine_core",
    "vllm.v1.engine.core:EngineCoreProc.startup_handshake",
    "vllm.v1.engine.core:EngineCoreProc.process_input_sockets",
    "vllm.v1.engine.core:EngineCoreProc.process_output_sockets",
    "vllm.v1.engine.core:DPEngineCoreProc.run_busy_loop",
    "vllm.v1.engine.core:DPEngineCoreProc._handle_client_request",
    "vllm.v1.engine.core:DPEngineCoreProc.add_request",
    "vllm.v1.engine.core:DPEngineCoreProc._maybe_publish_request_counts",
    "vllm.v1.engine.core:DPEngineCoreProc._has_global_unfinished_reqs",
    "vllm.v1.engine.core:EngineCore.step",
    "vllm.v1.engine.core:EngineCore.execute_dummy_batch",
    "vllm.config.parallel:sync_dp_state",
)
KEY_FRONTEND_METHODS = (
    "vllm.v1.engine.utils:wait_for_engine_startup",
    "vllm.v1.engine.core_client:MPClient.__init__",
    "vllm.v1.engine.core_client:DPAsyncMPClient.add_request_async",
    "vllm.v1.engine.core_client:DPLBAsyncMPClient.get_core_engine_for_request",
    "vllm.v1.engine.core_client:DPAsyncMPClient._ensure_stats_update_task."
    "<locals>.run_engine_stats_update_task",
    "vllm.v1.engine.core_client:AsyncMPClient.get_output_async",
    "vllm.v1.engine.core_client:DPLBAsyncMPClient.process_engine_outputs",
)
PAUSE_METHODS = (
    "vllm.v1.engine.core:EngineCoreProc.pause_generation",
    "vllm.v1.engine.core:EngineCoreProc.pause_scheduler",
    "vllm.v1.engine.core:DPEngineCoreProc._pause_complete",
    "vllm.v1.engine.core:DPEngineCoreProc.resume_scheduler",
    "vllm.config.parallel:has_unfinished_dp",
)


@pytest.fixture(scope="module")
def cluster_root(vllm_root: Path) -> Path:
    """The import root of the engine and front-end processes."""
    return prepare_cluster_root()


def bursts(count: int, size: int, tokens: tuple[int, int] = (2, 12)) -> list[dict[str, Any]]:
    return [
        {"count": size, "min_tokens": tokens[0], "max_tokens": tokens[1], "gap": (0.0, 0.15)}
        for _ in range(count)
    ]


# --- coordinators -------------------------------------------------------------------


class Ours:
    """``trio-dpcoord serve`` (:func:`trio_dpcoord.testing.open_serve`); keeps the
    counters it writes on its clean exit."""

    def __init__(self) -> None:
        self.counters: dict[str, Any] | None = None
        self.output = ""

    @asynccontextmanager
    async def __call__(self, addresses: Addresses, engines: int) -> AsyncIterator[None]:
        async with open_serve(
            "--engines",
            str(engines),
            "--front",
            addresses.stats,
            "--back-pub",
            addresses.coordinator_input,
            "--back-out",
            addresses.coordinator_output,
            "--exit-on-stdin-eof",
            ready_timeout=30,
        ) as serve:
            yield
        self.counters = serve.final_counters
        self.output = f"stdout: {serve.stdout_lines}\nstderr: {serve.stderr[-3000:]}"


def vllms(root: Path) -> Coordinator:
    @asynccontextmanager
    async def vllm_coordinator(addresses: Addresses, engines: int) -> AsyncIterator[None]:
        """vLLM's real ``DPCoordinatorProc.run_coordinator`` in its own process."""
        async with open_vllm_coordinator(
            engines,
            front_publish_address=addresses.stats,
            back_output_address=addresses.coordinator_output,
            back_publish_address=addresses.coordinator_input,
            root=root,
        ):
            yield

    return vllm_coordinator


def chosen(name: str, root: Path) -> Coordinator:
    """``"ours"`` (a fresh :class:`Ours`) or ``"vllm"``."""
    return Ours() if name == "ours" else vllms(root)


def broken(kind: str) -> Coordinator:
    """A tiny coordinator peer that gets one thing wrong, on purpose.

    ``never-wakes``: gates on the engines' subscriptions and sends READY, tracks the wave
    from the engines' reports and publishes it, but never broadcasts START_DP_WAVE.
    ``previous-wave``: like a correct coordinator, except that the wave it broadcasts to
    engines (and publishes to front-ends) is the previous one.
    """

    @asynccontextmanager
    async def peer(addresses: Addresses, engines: int) -> AsyncIterator[None]:
        linger: dict[int, int | bytes] = {zmq.LINGER: 0}
        xpub = {**linger, zmq.XPUB_VERBOSE: 1}  # one subscription message per engine
        async with AsyncExitStack() as stack:
            context = await stack.enter_async_context(open_context())
            pub, pull, front = [
                await stack.enter_async_context(
                    open_socket(context, kind, bind=address, options=options)
                )
                for kind, address, options in (
                    (zmq.XPUB, addresses.coordinator_input, xpub),
                    (zmq.PULL, addresses.coordinator_output, linger),
                    (zmq.XPUB, addresses.stats, xpub),
                )
            ]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_broken_loop, kind, engines, pub, pull, front)
                yield
                nursery.cancel_scope.cancel()

    return peer


async def _broken_loop(kind: str, engines: int, pub: Any, pull: Any, front: Any) -> None:
    subscribed = 0
    while subscribed < engines:
        if await pub.recv() == protocol.SUBSCRIBE:
            subscribed += 1
    await pub.send(protocol.READY)
    wave, running = 0, False
    lag = 1 if kind == "previous-wave" else 0
    while True:
        out = protocol.decode_engine_core_outputs(await pull.recv())
        if out.wave_complete is not None:
            wave, running = out.wave_complete + 1, False
        elif out.start_wave is not None and not running:
            wave, running = max(wave, out.start_wave), True
            if kind == "previous-wave":
                await pub.send_multipart(
                    protocol.encode_start_dp_wave(max(wave - lag, 0), out.engine_index)
                )
        else:
            continue
        await front.send(msgpack.packb([None, max(wave - lag, 0), running]))


# --- the runs -----------------------------------------------------------------------


async def run(
    root: Path, tmp_path: Path, coordinator: Coordinator, scenario: Scenario, guard: float = GUARD
) -> ClusterResult:
    with trio.fail_after(guard):
        return await run_cluster(root, vllm_env(root), tmp_path, coordinator, scenario)


def assert_healthy(result: ClusterResult) -> None:
    found = failures(result)
    assert not found, "\n".join(found) + "\n" + result.log_tail()
    assert result.collective_rounds > 0
    for engine in result.engines:
        missing = [m for m in KEY_ENGINE_METHODS if m not in engine["called"]]
        assert not missing, f"engine {engine['rank']} never ran {missing}"
    missing = [m for m in KEY_FRONTEND_METHODS if m not in result.frontend["called"]]
    assert not missing, f"the front-end never ran {missing}"
    waves = result.frontend["wave_history"]
    assert waves[-1] == result.engines[0]["current_wave"] > 0


def assert_clean_counters(ours: Ours) -> None:
    """Our coordinator exited cleanly, rejected nothing and counted no error."""
    assert ours.counters is not None, f"serve did not exit cleanly; {ours.output}"
    assert ours.counters["errors"] == 0
    assert ours.counters["rejected"] == {}
    assert ours.counters["ready_broadcasts"] >= 1
    assert ours.counters["stats_applied"] > 0  # _maybe_publish_request_counts reached it


@pytest.mark.parametrize("dp_size", [2, 4])
async def test_bursty_load_with_our_coordinator(
    cluster_root: Path, tmp_path: Path, dp_size: int
) -> None:
    scenario = Scenario(dp_size=dp_size, bursts=bursts(6, 2 * dp_size))
    ours = Ours()
    result = await run(cluster_root, tmp_path, ours, scenario)
    assert_healthy(result)
    assert all(e["forward_passes"] > 0 for e in result.engines)
    assert_clean_counters(ours)


async def test_bursty_load_with_vllm_coordinator(cluster_root: Path, tmp_path: Path) -> None:
    scenario = Scenario(dp_size=3, bursts=bursts(6, 6))
    result = await run(cluster_root, tmp_path, vllms(cluster_root), scenario)
    assert_healthy(result)


@pytest.mark.parametrize("coordinator", ["ours", "vllm"])
@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
async def test_pause_and_resume(
    cluster_root: Path, tmp_path: Path, mode: str, coordinator: str
) -> None:
    """vLLM's two-phase pause (all engines, through ``pause_generation_async``) in the
    middle of a wave, then ``resume_scheduler_async`` (its DP all-reduce barrier)."""
    scenario = Scenario(
        dp_size=2,
        bursts=[
            {"count": 4, "min_tokens": 3, "max_tokens": 6},
            {"count": 4, "min_tokens": 40, "max_tokens": 60, "pause": mode},
            {"count": 4, "min_tokens": 3, "max_tokens": 6},
        ],
    )
    result = await run(cluster_root, tmp_path, chosen(coordinator, cluster_root), scenario)
    assert_healthy(result)
    for engine in result.engines:
        missing = [m for m in PAUSE_METHODS if m not in engine["called"]]
        assert not missing, f"engine {engine['rank']} never ran {missing}"
    fe = result.frontend
    outcomes = sorted(set(fe["finished"].values()))
    if mode == "keep":
        assert fe["progress_while_paused"] == [{}]  # nothing stepped while paused
        assert outcomes == ["LENGTH"]
    elif mode == "wait":
        assert len(fe["rejected"]) == 1
        assert outcomes == ["ERROR", "LENGTH"]
    else:
        assert len(fe["rejected"]) == 1
        assert "ABORT" in outcomes


@pytest.mark.parametrize("coordinator", ["ours", "vllm"])
async def test_coordinator_started_after_the_engines(
    cluster_root: Path, tmp_path: Path, coordinator: str
) -> None:
    """The engines start, connect to the coordinator's addresses before anything is bound
    there and wait for its READY; the startup handshake completes only after it."""
    scenario = Scenario(dp_size=2, bursts=bursts(3, 4), coordinator_delay=3.0)
    inner = chosen(coordinator, cluster_root)
    started: list[float] = []

    @asynccontextmanager
    async def late(addresses: Addresses, engines: int) -> AsyncIterator[None]:
        started.append(time.time())
        async with inner(addresses, engines):
            yield

    result = await run(cluster_root, tmp_path, late, scenario)
    assert_healthy(result)
    if isinstance(inner, Ours):
        assert_clean_counters(inner)
    assert result.frontend["handshake_done_at"] > started[0]


@pytest.mark.parametrize("coordinator", ["ours", "vllm"])
async def test_stress_sync_every_step_and_requests_at_wave_ends(
    cluster_root: Path, tmp_path: Path, coordinator: str
) -> None:
    scenario = Scenario(
        dp_size=3, bursts=bursts(8, 3, (1, 4)), dp_sync_interval=1, requests_at_wave_end=6
    )
    result = await run(cluster_root, tmp_path, chosen(coordinator, cluster_root), scenario)
    assert_healthy(result)
    assert result.frontend["extra_sent"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("coordinator", ["ours", "vllm"])
async def test_stress_long_run(cluster_root: Path, tmp_path: Path, coordinator: str) -> None:
    """The stress mode, longer and wider: 4 engines, 120 bursts, 100 requests at wave ends."""
    scenario = Scenario(
        dp_size=4,
        bursts=bursts(120, 6, (1, 6)),
        dp_sync_interval=1,
        requests_at_wave_end=100,
        timeout=120.0,
        seed=7,
    )
    result = await run(
        cluster_root, tmp_path, chosen(coordinator, cluster_root), scenario, guard=900.0
    )
    assert_healthy(result)
    assert result.frontend["extra_sent"] == 100


@pytest.mark.parametrize("kind", ["ours", "never-wakes", "previous-wave"])
async def test_one_request_at_a_time_needs_the_wake(
    cluster_root: Path, tmp_path: Path, kind: str
) -> None:
    """One request per wave, so each wave starts on one engine and the other must be woken
    by START_DP_WAVE: healthy with our coordinator; the negative controls (a coordinator
    that never wakes the engines, one that broadcasts the previous wave) fail the checks."""
    scenario = Scenario(dp_size=2, bursts=bursts(3, 1), collective_timeout=3.0, timeout=20.0)
    ours = Ours()
    result = await run(cluster_root, tmp_path, ours if kind == "ours" else broken(kind), scenario)
    if kind == "ours":
        assert_healthy(result)
        assert_clean_counters(ours)
        # every wave started on one engine: our START_DP_WAVE woke the other. (Not one wave
        # per burst: a request that follows the last one's end within the gap may find
        # the wave still running, on a loaded machine, and join it.)
        assert ours.counters is not None
        waves = result.engines[0]["current_wave"]
        assert waves >= 1, waves
        assert ours.counters["wave_starts"] >= waves
        return
    found = failures(result)
    assert any(f.startswith("collective: collective timeout") for f in found), found
    assert any(f.endswith("never finished") for f in found), found
    assert any(" exception: " in f for f in found), found


def test_the_checks_are_not_vacuous() -> None:
    """Each pass criterion of :func:`failures` flags a report that breaks it."""

    def result(**frontend: Any) -> ClusterResult:
        engine = {"rank": 0, "exception": None, "current_wave": 2, "engines_running": False}
        return ClusterResult(
            frontend={
                "exception": None,
                "handshake": "all engines READY",
                "sent": {"req-1": 3},
                "finished": {"req-1": "LENGTH"},
                "tokens": {"req-1": 3},
                "rejected": [],
                "wave_history": [0, 1, 2],
                **frontend,
            },
            engines=[engine, {**engine, "rank": 1}],
            collective_failure=None,
            collective_rounds=10,
            open_rounds={},
            logs={},
        )

    assert failures(result()) == []
    assert failures(result(wave_history=[0, 2, 1])) == [
        "the front-end saw the wave go backwards: [0, 2, 1]"
    ]
    assert failures(result(tokens={"req-1": 2})) == ["req-1: 2 of 3 tokens"]
    assert failures(result(finished={})) == ["req-1 never finished"]
    assert failures(result(finished={"req-1": "ERROR"})) == ["req-1 finished with ERROR"]
    stalled = result()
    stalled.open_rounds = {(0, 7): (1,)}
    assert failures(stalled) == [
        "collective rounds left open (channel, round) -> ranks: {(0, 7): (1,)}"
    ]
    apart = result()
    apart.engines[1]["current_wave"] = 3
    assert failures(apart) == ["engines ended on different waves: ['2', '3']"]
    running = result()
    running.engines[0]["engines_running"] = True
    assert failures(running) == ["an engine ended still running"]
