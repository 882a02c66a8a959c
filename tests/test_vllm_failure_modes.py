"""The failure modes vLLM users reported, each against the simulated fleet.

Issue numbers are the vLLM repository's. Engines run in-process (``SimEngine``, the
collective over ipc) against the real coordinator; the coordinator-loss case (#32136)
is in test_faults.py, where the standalone process is killed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from tests.helpers import sim_engine_config
from trio_dpcoord import (
    Coordinator,
    ReadyTimeoutError,
    WaveSnapshot,
    open_coordinator,
    open_frontend,
)
from trio_dpcoord.sim import EngineConfig, SimEngine, SimFrontend, open_sim_frontend
from trio_dpcoord.sim.engine import run_sim_engine


@dataclass
class Fleet:
    coordinator: Coordinator
    frontend: SimFrontend
    engines: list[SimEngine]


def _config(
    rank: int, count: int, coord: Coordinator, fe: SimFrontend, tmp: Path, **kw: object
) -> EngineConfig:
    settings: dict[str, object] = {"collective_timeout": 5.0, **kw}
    inp, out = coord.back_publish_address, coord.back_output_address
    return sim_engine_config(rank, count, inp, out, fe, tmp, **settings)


@asynccontextmanager
async def fleet(
    tmp_path: Path,
    count: int,
    *,
    wake_path: str = "engine",
    wake_confirm_timeout: float = 30.0,
    **engine_kw: object,
) -> AsyncIterator[Fleet]:
    async with open_coordinator(
        count, ready_timeout=10, wake_confirm_timeout=wake_confirm_timeout
    ) as coord:
        async with open_sim_frontend(coord, count, wake_path=wake_path) as fe:  # type: ignore[arg-type]
            engines = [
                SimEngine(_config(r, count, coord, fe, tmp_path, **engine_kw)) for r in range(count)
            ]
            async with trio.open_nursery() as nursery:
                for engine in engines:
                    nursery.start_soon(run_sim_engine, engine)
                await coord.wait_ready()
                await fe.wait_for(lambda f: all(f.engine_ready))
                yield Fleet(coord, fe, engines)
                nursery.cancel_scope.cancel()


async def test_start_dp_wave_during_a_pause_neither_rearms_nor_latches(tmp_path: Path) -> None:
    """#36594: a START_DP_WAVE arriving while the engines are paused (here: a front-end's
    first-request notice) must not make a paused engine step; #51476/#51481: nor may it
    leave the coordinator's engines_running True while the engines sleep, or the next
    engine's start_wave for that wave would be ignored and its request stranded."""
    with trio.fail_after(30):
        async with fleet(tmp_path, 2, wake_confirm_timeout=0.5) as f:
            coord, fe = f.coordinator, f.frontend
            await fe.submit(max_tokens=2)
            await coord.wait_for(lambda c: c.snapshot() == WaveSnapshot(1, False))
            await fe.pause_engines()  # consensus ends wave 1
            await coord.wait_for(lambda c: c.snapshot() == WaveSnapshot(2, False))
            steps = [e.counters.steps for e in f.engines]

            coord.notify_first_request(0)  # START_DP_WAVE [2, 0] reaches paused engines
            assert coord.snapshot() == WaveSnapshot(2, True)
            # the engines' counters change without a message to anyone: poll them
            while not all(e.counters.broadcasts_dropped == 1 for e in f.engines):  # noqa: ASYNC110
                await trio.sleep(0.02)
            # No engine confirms the start (they are paused): the coordinator does not
            # stay latched on running, it goes back to paused by itself.
            await coord.wait_for(lambda c: c.snapshot() == WaveSnapshot(2, False))
            assert [e.counters.steps for e in f.engines] == steps  # nobody was re-armed
            assert fe.engine_running == [False, False]

            await fe.resume_engines()
            # The next request (to the rank the notice excluded, too) wakes everyone:
            # its start_wave(2) is a real start, not a duplicate of a "running" wave 2.
            await fe.submit(max_tokens=3, engine=1)
            await fe.wait_for(lambda f: f.completed == 2)
            await coord.wait_for(lambda c: c.snapshot() == WaveSnapshot(3, False))
            assert fe.wave_regressions == 0
            assert coord.statistics().errors == 0


@pytest.mark.parametrize("wake_path", ["engine", "frontend"])
async def test_the_first_request_at_wave_0_wakes_every_rank(tmp_path: Path, wake_path: str) -> None:
    """#51983: at a cold start (everyone at wave 0) a request to one rank must wake all
    of them, both with 0.33 engines (start_wave) and with older engines that rely on the
    front-end's first-request notice."""
    with trio.fail_after(30):
        async with fleet(
            tmp_path, 3, wake_path=wake_path, report_start_wave=wake_path == "engine"
        ) as f:
            await f.frontend.submit(max_tokens=2, engine=2)
            await f.frontend.wait_for(lambda fe: fe.completed == 1)
            await f.coordinator.wait_for(lambda c: c.snapshot() == WaveSnapshot(1, False))
            # every rank ran wave 0 and ended it (each counts it when its own loop ends it)
            while [e.counters.waves for e in f.engines] != [1, 1, 1]:  # noqa: ASYNC110
                await trio.sleep(0.02)
            assert all(e.counters.steps >= 1 and e.current_wave == 1 for e in f.engines)
            await f.frontend.wait_for(lambda fe: fe.waves_completed == {0})
            assert (f.frontend.notifications == 1) == (wake_path == "frontend")


async def test_the_gate_timeout_bounds_the_wait_and_names_the_missing_ranks(tmp_path: Path) -> None:
    """#52330: with ranks 1 and 3 never started, wait_ready fails after ready_timeout
    (not later) and names exactly those ranks."""
    async with open_coordinator(4, ready_timeout=1.5) as coord:
        async with open_sim_frontend(coord, 4) as fe:
            engines = [SimEngine(_config(r, 4, coord, fe, tmp_path)) for r in (0, 2)]
            async with trio.open_nursery() as nursery:
                for engine in engines:
                    nursery.start_soon(run_sim_engine, engine)
                started = trio.current_time()
                with trio.fail_after(10), pytest.raises(ReadyTimeoutError) as caught:
                    await coord.wait_ready()
                waited = trio.current_time() - started
                nursery.cancel_scope.cancel()
    assert waited < 1.5 + 1.0
    message = str(caught.value)
    assert "2 of 4 engines subscribed" in message
    assert message.endswith(f"ranks never heard from on {coord.back_output_address}: [1, 3]")
    assert coord.silent_engines() == [1, 3]
    assert not any(e.ready for e in engines)


async def test_load_is_balanced_from_the_first_request(tmp_path: Path) -> None:
    """#22910, #47420: before any load report, a burst must spread over all ranks
    instead of going to rank 0."""
    with trio.fail_after(30):
        async with fleet(tmp_path, 4) as f:
            for _ in range(8):
                await f.frontend.submit(max_tokens=50)  # none finishes during the burst
            spread = f.frontend.per_engine_pending()
            assert min(spread) >= 1 and max(spread) - min(spread) <= 1, spread
            await f.frontend.wait_for(lambda fe: fe.completed == 8)


async def test_a_remote_front_end_balances_before_any_publish() -> None:
    """The same for a front-end of the standalone coordinator: no engine ever reported
    (the gate is closed, so no publish came), the in-flight counts alone spread it."""
    async with open_coordinator(4, front_address="", ready_timeout=None) as coord:
        assert coord.front_address is not None
        async with open_frontend(coord.front_address, engine_count=4) as front:
            chosen = Counter(front.choose() for _ in range(8))
            assert front.statistics().publishes_received == 0
    assert chosen == {0: 2, 1: 2, 2: 2, 3: 2}
