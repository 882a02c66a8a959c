"""The in-process coordinator over real sockets, with bare engine peers."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import zmq

from trio_dpcoord import (
    Coordinator,
    CoordinatorClosedError,
    CoordinatorError,
    PrefixRouting,
    ReadyTimeoutError,
    Route,
    WaveSnapshot,
    open_coordinator,
    protocol,
)
from trio_dpcoord._shell.pumps import Pumps
from trio_dpcoord.core import Broadcast, CoordinatorCore
from trio_dpcoord.protocol import engine_identity
from trio_dpcoord.testing import (
    connect_engines,
    expect_broadcast,
    open_coordinator_with_engines,
)
from trio_dpcoord.trio_zmq import open_context, open_socket

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

GUARD = 20.0  # generous: real sockets on a shared 2-core machine


async def wave_is(coordinator: Coordinator, wave: int, running: bool) -> None:
    await coordinator.wait_for(lambda c: c.snapshot() == WaveSnapshot(wave, running))


async def test_gate_then_ready_to_every_engine(engine_addresses: dict[str, Any]) -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator(3, **engine_addresses) as coordinator:
            assert coordinator.back_publish_address.split("://")[0] in ("ipc", "tcp")
            assert not coordinator.back_publish_address.endswith(":0")
            async with connect_engines(
                coordinator.back_publish_address, coordinator.back_output_address, 2
            ) as first_two:
                await coordinator.wait_for(lambda c: c.subscriptions().current == 2)
                assert not coordinator.subscriptions().gate_open
                async with connect_engines(
                    coordinator.back_publish_address,
                    coordinator.back_output_address,
                    1,
                    first_index=2,
                ) as last:
                    await coordinator.wait_ready()
                    await expect_broadcast(first_two + last, [protocol.READY])
                    assert coordinator.statistics().ready_broadcasts == 1


async def test_late_subscription_gets_ready_again(engine_addresses: dict[str, Any]) -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(2, **engine_addresses) as (coordinator, engines):
            addresses = (coordinator.back_publish_address, coordinator.back_output_address)
            # engine 1 dies: its unsubscription is visible; it comes back: READY again
            async with connect_engines(*addresses, 1, first_index=1) as restarted:
                await coordinator.wait_for(lambda c: c.subscriptions().late_subscriptions == 1)
                await expect_broadcast(engines + restarted, [protocol.READY])
            await coordinator.wait_for(lambda c: c.subscriptions().unsubscribed == 1)
            view = coordinator.subscriptions()
            assert (view.current, view.subscribed, view.gate_open) == (2, 3, True)
            assert coordinator.statistics().ready_broadcasts == 2


async def test_current_first_request_excludes_its_target_over_the_wire(
    engine_addresses: dict[str, Any],
) -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(3, **engine_addresses) as (coordinator, engines):
            # move to wave 3, paused, the way engines do
            await engines[0].wave_complete(2)
            await wave_is(coordinator, 3, False)
            coordinator.notify_first_request(2)
            assert coordinator.snapshot() == WaveSnapshot(3, True)
            await expect_broadcast(engines, [b"\x02", b"\x92\x03\x02"])
            assert coordinator.snapshot() == WaveSnapshot(3, True)


async def test_stale_first_request_wakes_everyone_and_never_rewinds(
    engine_addresses: dict[str, Any],
) -> None:
    """R1 made deterministic: the notice is queued before the gate opens, wave 3
    completes while it waits, and only then is it handled."""
    with trio.fail_after(GUARD):
        async with open_coordinator(3, **engine_addresses) as coordinator:
            addresses = (coordinator.back_publish_address, coordinator.back_output_address)
            async with connect_engines(*addresses, 2) as engines:
                await engines[0].wave_complete(2)
                await wave_is(coordinator, 3, False)
                coordinator.notify_first_request(2)  # FirstRequest{wave 3, target 2} queued
                await engines[0].wave_complete(3)  # handled first: the wave moves to 4
                await wave_is(coordinator, 4, False)
                async with connect_engines(*addresses, 1, first_index=2) as last:
                    await coordinator.wait_ready()
                    everyone = engines + last
                    await expect_broadcast(everyone, [protocol.READY])
                    # the current wave (4), nobody excluded (nil)
                    await expect_broadcast(everyone, [b"\x02", b"\x92\x04\xc0"])
                    await wave_is(coordinator, 4, True)


async def test_wave_start_leaves_before_the_reports_queued_behind_it() -> None:
    """A start_wave that arrives in front of a long queue of stats reports is broadcast
    before that queue is applied: the listener takes small batches and, under load, waits
    for the broadcaster's send before applying the rest. The engines hold START_DP_WAVE
    while most of the reports are still unapplied (content and order, no timings: 20,000
    reports are several trio passes of work however fast the machine)."""
    behind = 20_000
    stats = [
        protocol.encode_engine_core_outputs(
            protocol.EngineCoreOutputs(
                engine_index=1, scheduler_stats=protocol.SchedulerStats(num_waiting_reqs=k)
            )
        )
        for k in range(behind)
    ]
    start = protocol.encode_engine_core_outputs(
        protocol.EngineCoreOutputs(engine_index=0, start_wave=0)
    )
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(2) as (coordinator, engines):
            before = coordinator.statistics().stats_applied
            applied_at_start: list[int] = []

            async def sender() -> None:
                for frame in (start, *stats):  # one pipe: FIFO, the wave start first
                    await engines[0].push.send(frame)

            async def engine_one() -> None:
                assert await engines[1].next_broadcast() == protocol.StartDPWave(0, 0)
                applied_at_start.append(coordinator.statistics().stats_applied - before)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                nursery.start_soon(engine_one)
            assert applied_at_start[0] < behind
            await coordinator.wait_for(lambda c: c.statistics().stats_applied - before == behind)
            assert coordinator.engine_loads()[1].waiting == behind - 1


async def test_engine_start_wave_rules_over_the_wire(
    engine_addresses: dict[str, Any],
) -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(3, **engine_addresses) as (coordinator, engines):
            await engines[2].start_wave(0)  # idle engine got a request: wake the others
            await expect_broadcast(engines, protocol.encode_start_dp_wave(0, 2))
            await wave_is(coordinator, 0, True)
            await engines[0].start_wave(0)  # rank-0 mirror: already running, ignored
            await engines[0].wave_complete(0)
            await wave_is(coordinator, 1, False)
            await engines[1].start_wave(0)  # stale: ignored
            await engines[1].start_wave(3)  # newer: jump
            # the ignored reports sent nothing: the next broadcast is the jump
            await expect_broadcast(engines, [b"\x02", b"\x92\x03\x01"])
            await wave_is(coordinator, 3, True)
            await engines[0].wave_complete(2)  # late report of an older wave: ignored
            await engines[2].wave_complete(3)
            await wave_is(coordinator, 4, False)
            assert coordinator.statistics().wave_starts == 2


async def test_concurrent_first_requests_coalesce_into_one_broadcast() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(4) as (coordinator, engines):

            async def route(index: int) -> None:
                await trio.lowlevel.checkpoint()
                coordinator.notify_first_request(index % 4)

            async with trio.open_nursery() as nursery:
                for i in range(100):
                    nursery.start_soon(route, i)
            first = await engines[0].next_broadcast()
            assert isinstance(first, protocol.StartDPWave)
            assert first.wave == 0
            # a marker broadcast proves nothing else was sent in between
            await engines[3].wave_complete(0)
            await engines[3].start_wave(1)
            assert await engines[0].next_broadcast() == protocol.StartDPWave(1, 3)
            for peer in engines[1:]:
                assert await peer.next_broadcast() == first
                assert await peer.next_broadcast() == protocol.StartDPWave(1, 3)
            assert coordinator.statistics().wave_starts == 2
            assert coordinator.statistics().commands == 1


async def test_route_wakes_paused_engines_once_with_the_current_wave(
    engine_addresses: dict[str, Any],
) -> None:
    """Coordinator.choose, one call: the engine vLLM's score picks from the live loads,
    the current wave to stamp, and, the engines being paused, one START_DP_WAVE of that
    wave to the others (the routed engine excluded); while they run, routing sends
    nothing: the next broadcast the engines see is the next wave's wake."""
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(3, **engine_addresses) as (coordinator, engines):
            await engines[0].wave_complete(2)
            await wave_is(coordinator, 3, False)
            await engines[0].stats(2, 2, wave=3, step=1)
            await engines[2].stats(1, 3, wave=3, step=1)
            await coordinator.wait_for(lambda c: c.statistics().stats_applied == 2)
            first = [coordinator.choose() for _ in range(4)]  # concurrent requests
            assert first[0] == Route(1, 3)  # engine 1 reported nothing: the idle one
            assert [route.wave for route in first] == [3, 3, 3, 3]
            assert coordinator.snapshot() == WaveSnapshot(3, True)
            await expect_broadcast(engines, [b"\x02", b"\x92\x03\x01"])
            while_running = [coordinator.choose([5, 6, 7]) for _ in range(3)]
            assert [route.wave for route in while_running] == [3, 3, 3]
            inflight = coordinator.chooser.statistics().inflight
            assert sum(inflight) == 7
            for route in first + while_running:
                coordinator.finished(route.engine_index)
            assert coordinator.chooser.statistics().inflight == (0, 0, 0)
            await engines[0].wave_complete(3)
            await wave_is(coordinator, 4, False)
            last = coordinator.choose()
            assert last.wave == 4
            # the wave-4 wake is the next broadcast: nothing went out while they ran
            await expect_broadcast(engines, [b"\x02", msgpack.packb([4, last.engine_index])])
            stats = coordinator.statistics()
            assert (stats.wave_starts, stats.commands) == (2, 2)
        with pytest.raises(CoordinatorClosedError):
            coordinator.choose()


async def test_route_with_the_prefix_policy_follows_the_cached_history() -> None:
    """``open_coordinator(routing="prefix")``: choose() sends a conversation's next turn
    where its history went, and a pinned request observed there draws its follow-up."""
    with pytest.raises(ValueError, match='need routing="prefix"'):
        async with open_coordinator(2, prefix_routing=PrefixRouting()):
            pass  # pragma: no cover - refused before binding
    history = list(range(64))
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(
            2, routing="prefix", prefix_routing=PrefixRouting(block_size=16)
        ) as (coordinator, _):
            first = coordinator.choose(history)
            assert coordinator.choose([*history, 99, 100]).engine_index == first.engine_index
            pinned = 1 - first.engine_index
            other = list(range(1000, 1064))
            assert coordinator.observe(pinned, other)
            assert coordinator.choose([*other, 7]).engine_index == pinned
            router = coordinator.chooser.statistics().router
            assert router is not None and router.decisions == 4


def _bad_outputs(vectors: dict[str, dict[str, object]]) -> list[tuple[str, list[bytes]]]:
    def vector_frames(name: str) -> list[bytes]:
        hexes = vectors[name]["frames_hex"]
        assert isinstance(hexes, list)
        return [bytes.fromhex(h) for h in hexes]

    stats = protocol.SchedulerStats(num_running_reqs=1)
    return [
        ("undecodable_engine_output", [b"\xc1not msgpack"]),
        ("undecodable_engine_output", [msgpack.packb({"engine_index": 0})]),
        ("undecodable_engine_output", [msgpack.packb([0, [], None, "nope"])]),
        ("undecodable_engine_output", [b""]),
        ("non_control_output_request_batch", vector_frames("eco_normal_output_batch")),
        ("non_control_output_utility_reply", vector_frames("eco_utility_output")),
        (
            "non_control_output_mixed",
            [
                protocol.encode_engine_core_outputs(
                    protocol.EngineCoreOutputs(engine_index=1, scheduler_stats=stats, start_wave=9)
                )
            ],
        ),
        (
            "unknown_engine_index",
            [
                protocol.encode_engine_core_outputs(
                    protocol.EngineCoreOutputs(engine_index=7, start_wave=9)
                )
            ],
        ),
        (
            "unknown_engine_index",
            [
                protocol.encode_engine_core_outputs(
                    protocol.EngineCoreOutputs(engine_index=99, scheduler_stats=stats)
                )
            ],
        ),
        ("multipart_engine_output", [b"\x02", b"\x92\x01\x01"]),
    ]


async def test_bad_engine_input_is_counted_and_the_next_message_still_works(
    vectors: dict[str, dict[str, object]],
) -> None:
    cases = _bad_outputs(vectors)
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(2) as (coordinator, engines):
            for wave, (reason, frames) in enumerate(cases):
                before = coordinator.statistics().rejected.get(reason, 0)
                await engines[0].send_raw(frames)
                await engines[1].start_wave(wave)
                # the valid report right behind the bad one is handled exactly
                await expect_broadcast(engines, protocol.encode_start_dp_wave(wave, 1))
                assert coordinator.statistics().rejected[reason] == before + 1, reason
                await engines[0].wave_complete(wave)
                await wave_is(coordinator, wave + 1, False)
            assert coordinator.statistics().errors == len(cases)
            assert coordinator.statistics().wave_starts == len(cases)


async def test_unexpected_frame_on_the_broadcast_socket_is_counted() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(1) as (coordinator, engines):
            await engines[0].sub.send(b"\x92\x01\x02")  # an upstream payload, not a sub
            await coordinator.wait_for(
                lambda c: c.statistics().rejected.get("unexpected_broadcast_socket_frame") == 1
            )
            await engines[0].start_wave(0)
            await expect_broadcast(engines, protocol.encode_start_dp_wave(0, 0))


async def test_stats_fill_the_load_table() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(3) as (coordinator, engines):
            await engines[1].stats(3, 12, 0.4375, wave=0, step=1)
            await engines[2].stats(0, 4, 0.1, wave=0, step=1)
            await coordinator.wait_for(lambda c: c.statistics().stats_applied == 2)
            assert coordinator.engine_loads() == (
                (0, 0, 0.0),
                (3, 12, 0.4375),
                (0, 4, 0.1),
            )


async def test_commands_before_the_gate_are_applied_after_it() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator(2) as coordinator:
            coordinator.notify_first_request(1)
            assert coordinator.snapshot() == WaveSnapshot(0, True)
            addresses = (coordinator.back_publish_address, coordinator.back_output_address)
            async with connect_engines(*addresses, 2) as engines:
                await expect_broadcast(engines, [protocol.READY])
                await expect_broadcast(engines, [b"\x02", b"\x92\x00\x01"])


async def test_notify_first_request_rejects_bad_engines_and_a_stopped_coordinator() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator(2) as coordinator:
            with pytest.raises(ValueError, match="out of range"):
                coordinator.notify_first_request(2)
            with pytest.raises(ValueError, match="out of range"):
                coordinator.notify_first_request(-1)
            with pytest.raises(TypeError):
                coordinator.notify_first_request("1")  # type: ignore[arg-type]
            assert coordinator.snapshot() == WaveSnapshot(0, False)
        with pytest.raises(CoordinatorClosedError):
            coordinator.notify_first_request(0)


async def test_wait_ready_times_out_with_a_clear_error() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator(3, ready_timeout=0.3) as coordinator:
            addresses = (coordinator.back_publish_address, coordinator.back_output_address)
            async with connect_engines(*addresses, 1, first_index=1) as engines:
                await engines[0].stats(0, 0)  # an engine that announces itself before READY
                await coordinator.wait_for(
                    lambda c: c.subscriptions().current == 1 and c.silent_engines() == [0, 2]
                )
                with pytest.raises(ReadyTimeoutError, match="1 of 3 engines subscribed") as info:
                    await coordinator.wait_ready()
                assert "never heard from" in str(info.value)
                assert str(info.value).endswith(": [0, 2]")


async def test_cancellation_with_engines_connected_closes_everything(
    engine_addresses: dict[str, Any],
) -> None:
    with trio.fail_after(GUARD):
        with trio.CancelScope() as scope:
            async with open_coordinator_with_engines(2, **engine_addresses) as (
                coordinator,
                engines,
            ):
                endpoint = coordinator.back_publish_address
                await engines[0].start_wave(0)
                await coordinator.wait_for(lambda c: c.snapshot().engines_running)
                scope.cancel()
                await trio.sleep_forever()
        assert scope.cancelled_caught
        with pytest.raises(CoordinatorClosedError):
            coordinator.notify_first_request(0)
        if endpoint.startswith("ipc://"):
            path = Path(endpoint[len("ipc://") :])
            assert not path.exists()
            assert not path.parent.exists()  # the private directory is gone too


async def test_default_ipc_directory_is_private() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator(1) as coordinator:
            path = Path(coordinator.back_publish_address[len("ipc://") :])
            assert path.exists()
            assert (os.stat(path.parent).st_mode & 0o777) == 0o700
        assert not path.parent.exists()


async def test_an_error_in_the_block_propagates_unchanged() -> None:
    class Boom(Exception):
        pass

    with trio.fail_after(GUARD), pytest.raises(Boom):
        async with open_coordinator(1):
            raise Boom


async def test_a_failing_task_surfaces_as_coordinator_error() -> None:
    with trio.fail_after(GUARD), pytest.raises(CoordinatorError, match="task failed") as info:
        async with open_coordinator_with_engines(1, restart=False) as (coordinator, _engines):
            # break an invariant of our own: an empty frame list for the broadcaster
            coordinator._pumps.outgoing.send_nowait([Broadcast([], None, 0.0)])
            await trio.sleep_forever()
    assert isinstance(info.value.__cause__, BaseExceptionGroup)


async def test_bad_bind_address_fails_at_once() -> None:
    with pytest.raises(CoordinatorError, match="bad address"):
        async with open_coordinator(1, back_publish_address="udp://1.2.3.4:5"):
            pass
    with pytest.raises(CoordinatorError, match="allow_remote"):
        async with open_coordinator(1, back_output_address="tcp://0.0.0.0:0"):
            pass


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
async def test_an_ipv6_tcp_address_is_bound_in_ipv6_mode() -> None:
    """vLLM puts a socket in IPv6 mode for a bracketed host; so do we, or the bind fails."""
    with trio.fail_after(GUARD):
        async with open_coordinator(
            1, back_publish_address="tcp://[::1]:0", back_output_address="tcp://[::1]:0"
        ) as coordinator:
            assert coordinator.back_publish_address.startswith("tcp://[::1]:")
            async with open_context() as context:
                async with open_socket(context, zmq.XSUB, options={zmq.IPV6: 1}) as sub:
                    sub.connect(coordinator.back_publish_address)
                    await sub.send(protocol.SUBSCRIBE)
                    assert await sub.recv() == protocol.READY


async def test_remote_bind_needs_the_opt_in_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    async with open_coordinator(
        1, back_output_address="tcp://0.0.0.0:0", allow_remote=True
    ) as coordinator:
        assert coordinator.back_output_address.startswith("tcp://0.0.0.0:")
    assert "unauthenticated" in caplog.text


async def test_raw_pyzmq_engine_gets_vllm_bytes() -> None:
    """A peer set up exactly as vLLM's engine does (identity, XSUB, 0x01) sees READY."""
    with trio.fail_after(GUARD):
        async with open_coordinator(1) as coordinator, open_context() as context:
            async with open_socket(
                context,
                zmq.XSUB,
                connect=coordinator.back_publish_address,
                options={zmq.IDENTITY: engine_identity(0)},
            ) as sub:
                await sub.send(b"\x01")
                assert await sub.recv_multipart() == [b"READY"]


async def test_front_end_subscriptions_are_tracked_and_answered_with_a_publish() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator(2, front_address="") as coordinator, open_context() as context:
            assert coordinator.front_address is not None
            async with open_socket(context, zmq.XSUB, connect=coordinator.front_address) as sub:
                await sub.send(protocol.SUBSCRIBE)
                await coordinator.wait_for(lambda c: c.subscriptions().front_ends == 1)
                async with connect_engines(
                    coordinator.back_publish_address, coordinator.back_output_address, 2
                ):
                    await coordinator.wait_ready()
                    publish = protocol.decode_front_publish(await sub.recv())
                    assert publish == protocol.FrontPublish((protocol.IDLE_LOAD,) * 2, 0, False)
            await coordinator.wait_for(lambda c: c.subscriptions().front_ends == 0)


async def test_a_due_timed_publish_waits_for_the_publishes_decided_before_it(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Publishes leave in the order they were decided, timed ones included.

    Regression (a flaky ``test_pause_and_resume[keep-ours]``): when the timed publish fell
    due while wave publishes were still queued (the publisher was busy sending), it was
    built from the state *after* them and sent *before* them, so the front-end saw the
    wave go back (``3, 2, 3``) or a stale "paused" during a running wave. The pump is
    driven directly so that the race is deterministic: the decisions are queued while the
    sender is not waiting, with the timed publish already due (the clock is frozen).
    """
    core = CoordinatorCore(2, publish_to_front_ends=True)
    pumps = Pumps(core)
    now = trio.current_time()
    with pumps.lock:
        for _ in range(2):
            pumps.dispatch(core.receive_engine_subscription(protocol.SUBSCRIBE, now))
        for out in (
            protocol.EngineCoreOutputs(engine_index=0, wave_complete=0),
            protocol.EngineCoreOutputs(engine_index=1, start_wave=1),
            protocol.EngineCoreOutputs(engine_index=0, wave_complete=1),
        ):
            frames = [protocol.encode_engine_core_outputs(out)]
            pumps.dispatch(core.receive_engine_output(frames, now))
        assert core.next_deadline() <= now  # the first timed publish is due at once
    with trio.fail_after(GUARD):
        async with (
            open_context() as context,
            open_socket(context, zmq.XPUB, bind="inproc://engines") as engines,
            open_socket(context, zmq.PAIR, bind="inproc://front") as front,
            open_socket(context, zmq.PAIR, connect="inproc://front") as front_end,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(pumps.timer)  # the timed publish, queued behind the others
            await nursery.start(pumps.broadcaster, engines, front)
            received = [protocol.decode_front_publish(await front_end.recv()) for _ in range(4)]
            nursery.cancel_scope.cancel()
    assert [(p.current_wave, p.engines_running) for p in received] == [
        (1, False),
        (1, True),
        (2, False),
        (2, False),
    ]
    assert received[-1].counts is not None  # the timed one, last


async def test_a_first_request_start_nobody_confirms_is_not_latched() -> None:
    """Paused engines drop START_DP_WAVE: without an engine's report the coordinator
    goes back to paused, publishes it, and accepts the next start_wave of that wave."""
    with trio.fail_after(GUARD):
        async with (
            open_coordinator(2, front_address="", wake_confirm_timeout=0.3) as coordinator,
            open_context() as context,
        ):
            assert coordinator.front_address is not None
            async with open_socket(context, zmq.XSUB, connect=coordinator.front_address) as sub:
                await sub.send(protocol.SUBSCRIBE)
                await coordinator.wait_for(lambda c: c.subscriptions().front_ends == 1)
                addresses = (coordinator.back_publish_address, coordinator.back_output_address)
                async with connect_engines(*addresses, 2) as engines:
                    await expect_broadcast(engines, [protocol.READY])
                    coordinator.notify_first_request(1)
                    await expect_broadcast(engines, [b"\x02", b"\x92\x00\x01"])
                    # the engines say nothing (they are paused): back to paused
                    await wave_is(coordinator, 0, False)
                    publishes = []
                    while (publish := protocol.decode_front_publish(await sub.recv())) != (
                        protocol.FrontPublish(None, 0, False)
                    ):
                        publishes.append(publish)
                    assert protocol.FrontPublish(None, 0, True) in publishes
                    # resumed, engine 1 reports its kept request: a real start, not a duplicate
                    await engines[1].start_wave(0)
                    await expect_broadcast(engines, [b"\x02", b"\x92\x00\x01"])
                    await wave_is(coordinator, 0, True)
                    # once an engine confirmed (rank 0's mirror), nothing expires
                    await engines[0].wave_complete(0)
                    await wave_is(coordinator, 1, False)
                    coordinator.notify_first_request(0)
                    await expect_broadcast(engines, [b"\x02", b"\x92\x01\x00"])
                    await engines[0].start_wave(1)  # the mirror confirms wave 1
                    await trio.sleep(0.6)  # past the confirmation timeout
                    assert coordinator.snapshot() == WaveSnapshot(1, True)


async def test_curve_keeps_out_peers_without_the_key() -> None:
    """Optional CURVE (off by default): an engine without the coordinator's key can
    neither subscribe nor push; one with it works as usual."""
    _, secret = zmq.curve_keypair()
    with trio.fail_after(GUARD):
        async with open_coordinator(1, curve_secret_key=secret) as coordinator:
            assert coordinator.curve_public_key is not None
            addresses = (coordinator.back_publish_address, coordinator.back_output_address)
            async with connect_engines(*addresses, 1) as strangers:
                await strangers[0].start_wave(7)  # queued by the stranger, never delivered
                async with connect_engines(
                    *addresses, 1, curve_server_key=coordinator.curve_public_key
                ) as engines:
                    await expect_broadcast(engines, [protocol.READY])
                    await engines[0].start_wave(0)
                    await expect_broadcast(engines, [b"\x02", b"\x92\x00\x00"])
                    # only the keyed engine was heard: one subscription, one message
                    assert coordinator.subscriptions().subscribed == 1
                    assert coordinator.statistics().engine_messages == 1
                    assert coordinator.snapshot() == WaveSnapshot(0, True)
