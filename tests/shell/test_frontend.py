"""open_frontend against an in-process coordinator's front socket, over real sockets."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq

from trio_dpcoord import (
    Coordinator,
    CoordinatorClosedError,
    CoordinatorError,
    EngineLoad,
    Frontend,
    WaveSnapshot,
    open_coordinator,
    open_frontend,
    protocol,
)
from trio_dpcoord.routing import vllm_score
from trio_dpcoord.testing import (
    EnginePeer,
    connect_engines,
    expect_broadcast,
    open_coordinator_with_engines,
)
from trio_dpcoord.trio_zmq import open_context, open_socket

GUARD = 20.0  # generous: real sockets on a shared 2-core machine


def vector_frames(vectors: dict[str, dict[str, Any]], name: str) -> list[bytes]:
    return [bytes.fromhex(h) for h in vectors[name]["frames_hex"]]


@pytest.fixture
def front_address(transport: str, tmp_path: Path) -> str:
    return "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp_path / 'front'}"


@asynccontextmanager
async def frontend_with_engines(
    engines: int, front_address: str = "", **frontend_options: Any
) -> AsyncIterator[tuple[Coordinator, list[EnginePeer], Frontend]]:
    """The usual opening of these tests: a coordinator with its front socket on
    ``front_address`` (a private ``ipc://`` path by default), ``engines`` engine peers
    past READY (:func:`~trio_dpcoord.testing.open_coordinator_with_engines`), and a
    front-end following it (``open_frontend(front, **frontend_options)``)."""
    async with open_coordinator_with_engines(engines, front_address=front_address) as (
        coordinator,
        peers,
    ):
        assert coordinator.front_address is not None
        async with open_frontend(coordinator.front_address, **frontend_options) as frontend:
            yield coordinator, peers, frontend


async def test_snapshot_follows_wave_changes(front_address: str) -> None:
    with trio.fail_after(GUARD):
        async with frontend_with_engines(3, front_address) as (coordinator, engines, frontend):
            await frontend.wait_for(lambda f: f.statistics().publishes_received > 0)
            assert frontend.snapshot() == WaveSnapshot(0, False)
            await engines[2].start_wave(0)
            await frontend.wait_for(lambda f: f.snapshot() == WaveSnapshot(0, True))
            await engines[0].wave_complete(0)
            await frontend.wait_for(lambda f: f.snapshot() == WaveSnapshot(1, False))
            await engines[1].start_wave(4)
            await frontend.wait_for(lambda f: f.snapshot() == WaveSnapshot(4, True))
            assert frontend.snapshot() == coordinator.snapshot()
            assert frontend.statistics().rejected == {}


async def test_loads_follow_stats_publishes(front_address: str) -> None:
    with trio.fail_after(GUARD):
        async with frontend_with_engines(3, front_address) as (_coordinator, engines, frontend):
            await frontend.wait_for(lambda f: f.engine_count == 3)
            assert frontend.engine_loads() == (EngineLoad(0, 0, 0.0),) * 3
            await engines[1].stats(3, 12, 0.4375, wave=0, step=1)
            await engines[2].stats(0, 4, 0.1, wave=0, step=1)
            expected = (EngineLoad(0, 0, 0.0), EngineLoad(3, 12, 0.4375), EngineLoad(0, 4, 0.1))
            await frontend.wait_for(lambda f: f.engine_loads() == expected)
            assert frontend.statistics().last_publish_time is not None
            assert frontend.coordinator_silent_for() >= 0.0


async def test_choose_spreads_before_any_stats_and_follows_the_score_after() -> None:
    with trio.fail_after(GUARD):
        async with frontend_with_engines(3, engine_count=3) as (_coordinator, engines, frontend):
            # before any publish at all: the in-flight counts spread the requests
            first = [frontend.choose() for _ in range(6)]
            assert Counter(first) == {0: 2, 1: 2, 2: 2}, first
            assert frontend.statistics().inflight == (2, 2, 2)
            for engine in first:
                frontend.finished(engine)
            assert frontend.statistics().inflight == (0, 0, 0)
            # the all-zero publish changes nothing: still no pile-up on rank 0
            await frontend.wait_for(lambda f: f.statistics().publishes_received > 0)
            second = [frontend.choose() for _ in range(3)]
            assert sorted(second) == [0, 1, 2]
            for engine in second:
                frontend.finished(engine)
            # after stats: the score decides
            await engines[0].stats(4, 4, 0.0, wave=0, step=1)
            await engines[1].stats(0, 1, 0.0, wave=0, step=1)
            await engines[2].stats(0, 3, 0.0, wave=0, step=1)
            loads = (EngineLoad(4, 4, 0.0), EngineLoad(0, 1, 0.0), EngineLoad(0, 3, 0.0))
            await frontend.wait_for(lambda f: f.engine_loads() == loads)
            assert [
                vllm_score(ld.waiting, ld.running, ld.kv_cache_usage, 0, 1) for ld in loads
            ] == [8.0, 1.0, 3.0]
            assert frontend.choose() == 1  # lowest score
            assert frontend.choose() == 1  # (1+1 waiting) + 1 running = 2 < 3
            # engine 1 now scores 3 like engine 2; the scan start has moved past 1
            assert frontend.choose() == 2


async def test_prefix_routing_keeps_a_conversation_on_its_rank_over_real_sockets() -> None:
    with trio.fail_after(GUARD):
        async with frontend_with_engines(3, engine_count=3, routing="prefix") as (
            _coordinator,
            engines,
            frontend,
        ):
            assert frontend.routing == "prefix"
            history = list(range(1000, 1256))
            first = frontend.choose(history)
            # The coordinator's next publish shows the request waiting there.
            for rank, engine in enumerate(engines):
                await engine.stats(int(rank == first), 0, 0.0, wave=0, step=1)
            await frontend.wait_for(lambda f: f.engine_loads()[first] == EngineLoad(1, 0, 0.0))
            assert frontend.choose([*history, *range(32)]) == first
            elsewhere = frontend.choose(list(range(5000, 5256)))
            assert elsewhere != first
            pinned = 3 - first - elsewhere
            frontend.observe(pinned, list(range(7000, 7100)))
            assert frontend.choose([*range(7000, 7100), 1, 2]) == pinned
            counters = frontend.statistics().router
            assert counters is not None and counters.decisions == 5
            assert frontend.statistics().inflight[first] == 2


async def test_second_client_starts_its_scan_elsewhere() -> None:
    with trio.fail_after(GUARD):
        async with frontend_with_engines(4, client_index=1, client_count=2, engine_count=4) as (
            _coordinator,
            _engines,
            frontend,
        ):
            assert frontend.choose() == 2  # (4 engines x client 1) // 2 clients


async def test_scale_resizes_the_coordinator_table() -> None:
    with trio.fail_after(GUARD):
        async with frontend_with_engines(3) as (coordinator, engines, frontend):
            await frontend.wait_for(lambda f: f.engine_count == 3)
            frontend.resize(2)
            await coordinator.wait_for(lambda c: c.engine_count == 2)
            await engines[0].stats(1, 2, 0.25, wave=0, step=1)
            await frontend.wait_for(lambda f: f.engine_loads() == ((1, 2, 0.25), (0, 0, 0.0)))
            frontend.resize(4)
            await coordinator.wait_for(lambda c: c.engine_count == 4)
            await engines[1].stats(0, 5, 0.5, wave=0, step=2)
            grown = ((1, 2, 0.25), (0, 5, 0.5), (0, 0, 0.0), (0, 0, 0.0))
            await frontend.wait_for(lambda f: f.engine_loads() == grown)
            with pytest.raises(ValueError):
                frontend.resize(0)
            assert coordinator.statistics().commands == 2


async def test_notify_first_request_wakes_the_engines_with_exact_bytes(
    vectors: dict[str, dict[str, Any]],
) -> None:
    with trio.fail_after(GUARD):
        async with frontend_with_engines(3) as (coordinator, engines, frontend):
            await engines[0].wave_complete(2)
            await frontend.wait_for(lambda f: f.snapshot() == WaveSnapshot(3, False))
            frontend.notify_first_request(1)
            assert frontend.snapshot() == WaveSnapshot(3, True)  # at once, locally
            frontend.notify_first_request(2)  # coalesced: the snapshot says running
            # START_DP_WAVE wave 3, exclude engine 1, exactly vLLM's bytes
            await expect_broadcast(engines, vector_frames(vectors, "start_dp_wave_exclude_int"))
            await coordinator.wait_for(lambda c: c.snapshot() == WaveSnapshot(3, True))
            assert coordinator.statistics().commands == 1
            # the next wave-state publish confirms it; then a marker proves nothing
            # else was broadcast in between
            await engines[0].wave_complete(3)
            await frontend.wait_for(lambda f: f.snapshot() == WaveSnapshot(4, False))
            await engines[2].start_wave(4)
            await expect_broadcast(engines, [b"\x02", b"\x92\x04\x02"])


async def test_a_bad_publish_is_counted_and_the_next_one_applied() -> None:
    """A fake coordinator publishes junk, then a valid publish: the front-end survives."""
    with trio.fail_after(GUARD):
        async with open_context() as context:
            async with open_socket(
                context, zmq.XPUB, bind="tcp://127.0.0.1:0", options={zmq.XPUB_VERBOSE: 1}
            ) as xpub:
                address = xpub.last_endpoint
                assert address is not None
                async with open_frontend(address) as frontend:
                    assert await xpub.recv() == protocol.SUBSCRIBE
                    await xpub.send(b"\xc1 not msgpack")
                    await xpub.send(b"\x93\xc0\x02")  # a wave, then nothing: truncated
                    await xpub.send(
                        protocol.encode_front_publish(
                            protocol.FrontPublish((EngineLoad(1, 2, 0.5),), 7, True)
                        )
                    )
                    await frontend.wait_for(lambda f: f.statistics().publishes_received == 1)
                    assert frontend.snapshot() == WaveSnapshot(7, True)
                    assert frontend.engine_loads() == ((1, 2, 0.5),)
                    assert frontend.statistics().rejected == {"undecodable_front_publish": 2}
                    # a wave-only publish keeps the counts
                    await xpub.send(b"\x93\xc0\x08\xc2")
                    await frontend.wait_for(lambda f: f.statistics().publishes_received == 2)
                    assert frontend.snapshot() == WaveSnapshot(8, False)
                    assert frontend.engine_loads() == ((1, 2, 0.5),)
                    # and commands reach the coordinator's side of the socket verbatim
                    frontend.resize(3)
                    assert await xpub.recv() == protocol.encode_scale_elastic_ep(3)
                    frontend.notify_first_request(0)
                    assert await xpub.recv() == b"\x92\x00\x08"


async def test_silence_grows_when_the_coordinator_is_gone() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(1, front_address="") as (coordinator, _engines):
            assert coordinator.front_address is not None
            front = coordinator.front_address
        # the coordinator has stopped; nothing will ever publish again
        async with open_frontend(front, engine_count=1) as frontend:
            before = frontend.coordinator_silent_for()
            await trio.sleep(0.2)
            assert frontend.coordinator_silent_for() >= before + 0.2
            assert frontend.statistics().publishes_received == 0
            assert frontend.choose() == 0


async def test_choose_needs_an_engine_count() -> None:
    async with open_frontend("tcp://127.0.0.1:1") as frontend:
        assert frontend.engine_loads() == ()
        with pytest.raises(CoordinatorError, match="engine count unknown"):
            frontend.choose()


async def test_closed_frontend_refuses_commands_and_waits() -> None:
    async with open_frontend("tcp://127.0.0.1:1") as frontend:
        pass
    assert isinstance(frontend, Frontend)
    with pytest.raises(CoordinatorClosedError):
        frontend.resize(2)
    with pytest.raises(CoordinatorClosedError):
        await frontend.wait_for(lambda f: f.statistics().publishes_received > 0)


async def test_bad_address_fails_at_once() -> None:
    with pytest.raises(CoordinatorError, match="cannot connect"):
        async with open_frontend("bogus://nowhere"):
            pass


async def test_an_error_in_the_block_propagates_unchanged() -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with open_frontend("tcp://127.0.0.1:1"):
            raise Boom


async def test_frontend_with_the_curve_key_follows_a_curve_coordinator() -> None:
    _, secret = zmq.curve_keypair()
    with trio.fail_after(20):
        async with open_coordinator(1, front_address="", curve_secret_key=secret) as coordinator:
            assert coordinator.front_address is not None
            async with open_frontend(
                coordinator.front_address, curve_server_key=coordinator.curve_public_key
            ) as frontend:
                await coordinator.wait_for(lambda c: c.subscriptions().front_ends == 1)
                async with connect_engines(
                    coordinator.back_publish_address,
                    coordinator.back_output_address,
                    1,
                    curve_server_key=coordinator.curve_public_key,
                ) as engines:
                    await engines[0].start_wave(0)
                    await frontend.wait_for(lambda f: f.snapshot() == WaveSnapshot(0, True))
