"""A coordinator that fails from inside is restarted in place (docs/protocol.md §16).

Over real sockets, with bare engine peers (``trio_dpcoord.testing``): a failure is
injected with the documented hook (``testing.inject_coordinator_failure``), the service
swaps in a new core in recovering mode on the same sockets, and the engines see what the
protocol requires: no READY again (they never disconnected), one recovery wake for the
wave the failed core had reached, and then waves as before, never going back. The
application's block and the engine client's streams go on.
"""

from __future__ import annotations

import logging

import pytest
import trio

from tests.shell.test_engine_client import _fleet
from trio_dpcoord import (
    Coordinator,
    CoordinatorError,
    SamplingParams,
    open_coordinator,
    protocol,
)
from trio_dpcoord.testing import (
    connect_engines,
    expect_broadcast,
    inject_coordinator_failure,
    open_coordinator_with_engines,
)

GUARD = 30.0


def start(wave: int, exclude: int | None) -> list[bytes]:
    return protocol.encode_start_dp_wave(wave, exclude)


async def _restarted(coordinator: Coordinator, count: int) -> None:
    await coordinator.wait_for(lambda c: c.restarts().restarts >= count)


@pytest.mark.trio
async def test_a_failure_restarts_in_place_and_the_waves_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dpcoord")
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(2) as (coordinator, engines):
            await engines[1].start_wave(0)
            await expect_broadcast(engines, start(0, 1))
            await engines[0].wave_complete(0)
            await engines[0].start_wave(1)
            await expect_broadcast(engines, start(1, 0))
            inject_coordinator_failure(coordinator)
            await _restarted(coordinator, 1)
            # the wave the failed core had reached, to everyone, and no READY: the
            # engines never disconnected, their subscriptions were carried over
            await expect_broadcast(engines, start(1, None))
            assert coordinator.snapshot().current_wave == 1
            view = coordinator.subscriptions()
            assert (view.current, view.gate_open) == (2, True)
            # waves go on from there, never back
            await engines[1].start_wave(1)  # the running wave: no second broadcast
            await engines[0].wave_complete(1)
            await coordinator.wait_for(lambda c: not c.snapshot().engines_running)
            assert coordinator.snapshot().current_wave == 2
            await engines[1].start_wave(2)
            await expect_broadcast(engines, start(2, 1))
            counters = coordinator.restarts()
            assert counters.restarts == 1
            assert counters.last_failure is not None
            assert counters.last_failure.startswith("AssertionError: a failure injected")
            assert counters.seconds_without_coordinator >= 0.0
    restarts = [r for r in caplog.records if "restarted in place" in r.getMessage()]
    assert len(restarts) == 1 and restarts[0].levelno == logging.INFO
    message = restarts[0].getMessage()
    assert "without a coordinator for" in message and "wave 1, 2 engine subscriptions" in message
    failures = [r for r in caplog.records if r.getMessage().startswith("coordinator failed")]
    assert len(failures) == 1 and failures[0].levelno == logging.ERROR


@pytest.mark.trio
async def test_a_failure_applying_engine_outputs_loses_only_that_message() -> None:
    """The listener fails on a start_wave: it is lost, the recovery wake covers it (its
    peers still wake), and the load report behind it is applied by the new core."""
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(2) as (coordinator, engines):
            inject_coordinator_failure(coordinator, "engine_output")
            await engines[1].start_wave(0)
            await engines[1].stats(3, 1, 0.5, wave=0, step=0)
            await _restarted(coordinator, 1)
            await expect_broadcast(engines, start(0, None))
            await coordinator.wait_for(lambda c: c.engine_loads()[1].waiting == 3)
            assert coordinator.snapshot().engines_running
            # the engines' word settles it: rank 0 mirrors the start, then ends the wave
            await engines[0].start_wave(0)
            await engines[0].wave_complete(0)
            await coordinator.wait_for(lambda c: c.snapshot().current_wave == 1)
            assert coordinator.statistics().wave_starts_by_cause == {"recovery": 1}


@pytest.mark.trio
async def test_a_restart_before_the_gate_keeps_counting_subscriptions() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator(2) as coordinator:
            address, output = coordinator.back_publish_address, coordinator.back_output_address
            async with connect_engines(address, output, 1) as first:
                await coordinator.wait_for(lambda c: c.subscriptions().current == 1)
                inject_coordinator_failure(coordinator)
                await _restarted(coordinator, 1)
                assert not coordinator.subscriptions().gate_open
                async with connect_engines(address, output, 1, first_index=1) as second:
                    await coordinator.wait_ready()
                    # READY once, then the recovery wake behind it (the wave was 0)
                    await expect_broadcast([*first, *second], [protocol.READY])
                    await expect_broadcast([*first, *second], start(0, None))


@pytest.mark.trio
async def test_without_restart_a_failure_ends_the_block() -> None:
    with trio.fail_after(GUARD), pytest.raises(CoordinatorError, match="task failed"):
        async with open_coordinator_with_engines(1, restart=False) as (coordinator, _):
            inject_coordinator_failure(coordinator)
            await trio.sleep_forever()


@pytest.mark.trio
async def test_a_crash_loop_ends_with_coordinator_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trio_dpcoord")
    with trio.fail_after(GUARD), pytest.raises(CoordinatorError, match="task failed"):
        async with open_coordinator_with_engines(1, max_restarts=2) as (coordinator, _):
            for count in (1, 2):
                inject_coordinator_failure(coordinator)
                await _restarted(coordinator, count)
            inject_coordinator_failure(coordinator)
            await trio.sleep_forever()
    assert any("not restarting it again" in r.getMessage() for r in caplog.records)


@pytest.mark.trio
async def test_the_engine_clients_streams_survive_a_restart() -> None:
    """The coordinator inside open_engine_client fails mid-stream: every request still
    completes, whole, and the client never notices but in its coordinator's counters."""
    with trio.fail_after(GUARD):
        async with _fleet(2) as (client, _engines):
            outputs: list[tuple[int, ...]] = []

            async def one(prompt: int) -> None:
                done = await client.complete([prompt], SamplingParams(max_tokens=20))
                outputs.append(done.token_ids)

            async with trio.open_nursery() as nursery:
                for prompt in range(6):
                    nursery.start_soon(one, prompt)
                await trio.sleep(0.05)
                inject_coordinator_failure(client.coordinator)
                await _restarted(client.coordinator, 1)
            assert len(outputs) == 6 and all(len(tokens) == 20 for tokens in outputs)
            assert client.coordinator.restarts().restarts == 1


@pytest.mark.trio
async def test_metrics_count_the_restarts() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from tests.integrations.test_metrics import parse, value
    from trio_dpcoord.metrics import CoordinatorCollector

    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(2) as (coordinator, engines):
            registry = CollectorRegistry()
            registry.register(CoordinatorCollector(coordinator))
            inject_coordinator_failure(coordinator)
            await _restarted(coordinator, 1)
            await expect_broadcast(engines, start(0, None))
            await coordinator.wait_for(lambda c: c.statistics().wave_starts == 1)
            samples = parse(generate_latest(registry).decode())
    assert value(samples, "coordinator_restarts_total", kind="in_place") == 1
    assert value(samples, "coordinator_restarts_total", kind="process") == 0
    assert value(samples, "seconds_without_coordinator_total") >= 0
    assert value(samples, "wave_starts_total", cause="recovery") == 1
