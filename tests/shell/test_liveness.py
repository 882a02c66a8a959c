"""Dead peers noticed from the coordinator's side, without root: an engine
process frozen with SIGSTOP goes silent exactly like a partitioned node (its kernel
keeps the TCP connection open, nothing answers), so the coordinator's heartbeats are
the only way to notice it."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import zmq

from trio_dpcoord import Coordinator, Liveness, open_coordinator
from trio_dpcoord.core import CoordinatorCore

GUARD = 60.0

FAST = Liveness(heartbeat_interval=0.2, heartbeat_timeout=1.0)

# One vLLM-style engine peer (XSUB + PUSH) in its own process, with no heartbeat
# settings of its own, printing every broadcast it gets.
_PEER = textwrap.dedent(
    """
    import sys, trio
    from trio_dpcoord import protocol
    from trio_dpcoord.testing import connect_engines

    async def main() -> None:
        async with connect_engines(sys.argv[1], sys.argv[2], 1) as (peer,):
            while True:
                frames = await peer.next_broadcast_frames()
                print("READY" if frames == [protocol.READY] else "WAVE", flush=True)

    trio.run(main)
    """
)


@asynccontextmanager
async def _engine_process(coordinator: Coordinator) -> AsyncIterator[trio.Process]:
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-c",
            _PEER,
            coordinator.back_publish_address,
            coordinator.back_output_address,
        ],
        stdout=subprocess.PIPE,
    )
    try:
        yield process
    finally:
        with trio.CancelScope(shield=True):
            process.kill()
            await process.wait()
            assert process.stdout is not None
            await process.stdout.aclose()


@asynccontextmanager
async def _coordinator_with_engine_process(
    liveness: Liveness,
) -> AsyncIterator[tuple[Coordinator, trio.Process]]:
    """The opening of these tests: a one-engine coordinator with ``liveness`` on TCP
    loopback (heartbeats, and a frozen peer's connection left open by its kernel, are TCP
    matters), its engine in a process of its own (so that SIGSTOP freezes it), yielded
    once the gate has opened."""
    async with open_coordinator(
        1,
        back_publish_address="tcp://127.0.0.1:0",
        back_output_address="tcp://127.0.0.1:0",
        liveness=liveness,
    ) as coordinator:
        async with _engine_process(coordinator) as engine:
            await coordinator.wait_ready()
            yield coordinator, engine


def _metrics(coordinator: Coordinator) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What Prometheus would scrape, parsed (needs the metrics extra, as CI installs)."""
    prometheus = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from trio_dpcoord.metrics import CoordinatorCollector

    registry = prometheus.CollectorRegistry()
    registry.register(CoordinatorCollector(coordinator))
    text = prometheus.generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def _broadcasts(process: trio.Process, count: int) -> list[str]:
    assert process.stdout is not None
    text = ""
    while text.count("\n") < count:
        chunk = await process.stdout.receive_some(4096)
        assert chunk, "the engine process exited"
        text += chunk.decode()
    return text.split()


async def test_a_frozen_engine_is_dropped_then_gets_ready_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGSTOP: within the heartbeat timeout the engine shows as gone (subscriptions,
    counters, a WARNING naming the socket and the peer); SIGCONT: it reconnects,
    subscribes again and gets READY again."""
    caplog.set_level(logging.WARNING, logger="trio_dpcoord")
    with trio.fail_after(GUARD):
        async with _coordinator_with_engine_process(FAST) as (coordinator, engine):
            assert await _broadcasts(engine, 1) == ["READY"]
            # Harmless to a peer with no heartbeat settings of its own (as vLLM's
            # engines): libzmq answers the PINGs, nothing drops over 3 timeouts.
            await trio.sleep(3 * FAST.heartbeat_timeout)
            view = coordinator.subscriptions()
            assert (view.current, view.connections, view.connections_lost) == (1, 1, 0)

            os.kill(engine.pid, signal.SIGSTOP)
            stopped_at = trio.current_time()
            await coordinator.wait_for(lambda c: c.subscriptions().current == 0)
            noticed_after = trio.current_time() - stopped_at
            await coordinator.wait_for(
                lambda c: c.statistics().connections_lost.get("back_output") == 1
            )
            view = coordinator.subscriptions()
            assert (view.unsubscribed, view.connections, view.connections_lost) == (1, 0, 1)
            metrics = _metrics(coordinator)
            assert metrics[("trio_dpcoord_engine_connections", ())] == 0
            for socket in ("back_publish", "back_output"):
                key = ("trio_dpcoord_connections_lost_total", (("socket", socket),))
                assert metrics[key] == 1
            assert view.last_connection_lost_at is not None
            # Silent for the timeout before it is dropped: not a closed connection.
            assert noticed_after >= FAST.heartbeat_timeout * 0.9
            port = coordinator.back_publish_address.rsplit(":", 1)[1]
            lost = [r.getMessage() for r in caplog.records if "lost peer" in r.getMessage()]
            assert any(
                re.search(
                    rf"engine broadcast socket tcp://127\.0\.0\.1:{port} lost peer "
                    r"127\.0\.0\.1:\d+ \(connected since \d\d:\d\d:\d\d\.\d{3}\).*"
                    r"answered no heartbeat for 1 s",
                    message,
                )
                for message in lost
            ), lost

            os.kill(engine.pid, signal.SIGCONT)
            await coordinator.wait_for(lambda c: c.subscriptions().late_subscriptions == 1)
            assert await _broadcasts(engine, 1) == ["READY"]
            await coordinator.wait_for(lambda c: c.statistics().ready_broadcasts == 2)
            view = coordinator.subscriptions()
            assert (view.current, view.connections) == (1, 1)
            assert coordinator.statistics().errors == 0


async def test_a_pause_shorter_than_the_timeout_drops_nothing() -> None:
    """A peer silent for less than the heartbeat timeout (a short partition) stays."""
    liveness = Liveness(heartbeat_interval=0.2, heartbeat_timeout=3.0)
    with trio.fail_after(GUARD):
        async with _coordinator_with_engine_process(liveness) as (coordinator, engine):
            for _ in range(3):
                os.kill(engine.pid, signal.SIGSTOP)
                await trio.sleep(0.5)
                os.kill(engine.pid, signal.SIGCONT)
                await trio.sleep(0.5)
            view = coordinator.subscriptions()
            assert (view.current, view.unsubscribed, view.connections_lost) == (1, 0, 0)
            assert not any(coordinator.statistics().connections_lost.values())


def test_liveness_settings_become_socket_options() -> None:
    assert Liveness().socket_options() == {
        zmq.HEARTBEAT_IVL: 1000,
        zmq.HEARTBEAT_TIMEOUT: 3000,
        zmq.HEARTBEAT_TTL: 3000,
        zmq.TCP_KEEPALIVE: 1,
        zmq.TCP_KEEPALIVE_IDLE: 10,
        zmq.TCP_KEEPALIVE_INTVL: 2,
        zmq.TCP_KEEPALIVE_CNT: 3,
    }
    assert Liveness().notice_within == 4.0
    off = Liveness(heartbeat_interval=None, tcp_keepalive_idle=None)
    assert off.socket_options() == {} and off.notice_within is None
    with pytest.raises(ValueError, match="at most heartbeat_timeout"):
        Liveness(heartbeat_interval=5.0, heartbeat_timeout=1.0)
    with pytest.raises(ValueError, match="keepalive"):
        Liveness(tcp_keepalive_idle=0)


def test_heartbeats_only_where_they_help() -> None:
    """tcp:// peers get heartbeats; ipc:// and inproc:// ones (the kernel reports a dead
    peer, no partition can happen) only with local_heartbeats; keepalive stays as set."""
    tcp = Liveness().for_address("tcp://127.0.0.1:5555")
    assert tcp == Liveness() and zmq.HEARTBEAT_IVL in tcp.socket_options()
    for address in ("ipc:///tmp/x", "inproc://x"):
        local = Liveness().for_address(address)
        assert local.notice_within is None
        assert local.socket_options() == {
            key: value
            for key, value in Liveness().socket_options().items()
            if key not in (zmq.HEARTBEAT_IVL, zmq.HEARTBEAT_TIMEOUT, zmq.HEARTBEAT_TTL)
        }
        chosen = Liveness(local_heartbeats=True)
        assert chosen.for_address(address) == chosen


def test_the_core_counts_connections_per_socket() -> None:
    """Connection changes are inputs of the sans-IO core that cause no effect (they
    return nothing), and show in subscriptions() (the broadcast socket) and counters
    (every socket)."""
    core = CoordinatorCore(2)
    core.connection_opened("back_publish", 1.0)
    core.connection_opened("back_publish", 1.0)
    core.connection_opened("back_output", 1.0)
    core.connection_lost("back_publish", 5.0)
    core.connection_lost("back_output", 6.0)
    assert core.next_deadline() == float("inf")
    view = core.subscriptions()
    assert (view.connections, view.connections_lost, view.last_connection_lost_at) == (1, 1, 5.0)
    assert core.counters().connections_lost == {"back_publish": 1, "back_output": 1}
    assert core.counters().errors == 0
