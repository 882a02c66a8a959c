"""Prometheus metrics: an embedded registry and a live ``serve`` scraped over
HTTP, parsed with prometheus_client's own parser, checked against what the test did."""

from __future__ import annotations

import signal

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trio_dpcoord import WaveSnapshot, open_coordinator, protocol
from trio_dpcoord.metrics import CoordinatorCollector, serve_metrics
from trio_dpcoord.testing import (
    connect_engines,
    open_coordinator_with_engines,
    open_serve,
    serve_command,
)

GUARD = 30.0  # generous: real sockets (and a subprocess) on a shared 2-core machine

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(f"trio_dpcoord_{name}", tuple(sorted(labels.items())))]


def check_histogram(samples: Samples, name: str, count: int) -> None:
    """Cumulative buckets, non-decreasing, ``+Inf`` equal to the count."""
    buckets = sorted(
        (float(dict(labels)["le"]), v)
        for (sample, labels), v in samples.items()
        if sample == f"trio_dpcoord_{name}_bucket"
    )
    assert len(buckets) >= 2
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    assert buckets[-1] == (float("inf"), count)
    assert value(samples, f"{name}_count") == count
    assert value(samples, f"{name}_sum") >= 0


async def test_embedded_collector_shows_what_happened() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator_with_engines(2, wake_confirm_timeout=0.2) as (
            coordinator,
            engines,
        ):
            registry = CollectorRegistry()
            registry.register(CoordinatorCollector(coordinator))
            with pytest.raises(ValueError, match="Duplicated timeseries"):
                registry.register(CoordinatorCollector(coordinator))  # names are described
            await engines[0].stats(3, 5, 0.25, wave=0, step=1)
            await engines[1].stats(0, 2, 0.5, wave=0, step=1)
            await coordinator.wait_for(lambda c: c.statistics().stats_applied == 2)
            # An engine's start_wave wakes the other; rank 0 completes the wave.
            await engines[1].start_wave(0)
            for engine in engines:
                assert await engine.next_broadcast() == protocol.StartDPWave(0, 1)
            await engines[0].wave_complete(0)
            await coordinator.wait_for(lambda c: c.snapshot() == WaveSnapshot(1, False))
            # A front-end's first request wakes everyone but its target; nobody
            # confirms, so the start expires and the engines count as paused again.
            coordinator.notify_first_request(0)
            for engine in engines:
                assert await engine.next_broadcast() == protocol.StartDPWave(1, 0)
            await coordinator.wait_for(lambda c: c.statistics().unconfirmed_expiries == 1)
            await engines[0].send_raw([b"\xc1"])  # not msgpack
            await coordinator.wait_for(lambda c: c.statistics().errors == 1)
            await engines[1].unsubscribe()
            await coordinator.wait_for(lambda c: c.subscriptions().unsubscribed == 1)

            counters = coordinator.statistics()
            samples = parse(generate_latest(registry).decode())
            assert value(samples, "current_wave") == 1
            assert value(samples, "engines_running") == 0
            assert value(samples, "waves_completed_total") == 1
            assert value(samples, "wave_starts_total", cause="engine_start_wave") == 1
            assert value(samples, "wave_starts_total", cause="first_request") == 1
            assert value(samples, "wave_starts_total", cause="legacy_first_request") == 0
            check_histogram(samples, "wake_latency_seconds", count=2)
            assert value(samples, "engine_waiting_requests", engine="0") == 3
            assert value(samples, "engine_running_requests", engine="0") == 5
            assert value(samples, "engine_kv_cache_usage_ratio", engine="0") == 0.25
            assert value(samples, "engine_running_requests", engine="1") == 2
            assert value(samples, "engine_kv_cache_usage_ratio", engine="1") == 0.5
            assert value(samples, "engine_subscriptions") == 1
            assert value(samples, "engine_subscribe_events_total") == 2
            assert value(samples, "engine_vanished_total") == 1
            assert value(samples, "startup_gate_open") == 1
            assert value(samples, "ready_broadcasts_total") == 1
            assert value(samples, "unconfirmed_wake_expiries_total") == 1
            assert value(samples, "engine_messages_total") == 5  # 2 stats, 2 waves, 1 bad
            assert value(samples, "stats_applied_total") == 2
            assert value(samples, "stats_coalesced_total") == counters.stats_coalesced
            assert value(samples, "engine_output_backlog_seconds") == 0  # keeping up
            (reason,) = counters.rejected
            assert value(samples, "rejected_inputs_total", reason=reason) == 1
            assert value(samples, "commands_total") == counters.commands


async def test_serve_metrics_answers_scrapes_and_nothing_else() -> None:
    with trio.fail_after(GUARD):
        async with open_coordinator(1) as coordinator, trio.open_nursery() as nursery:
            registry = CollectorRegistry()
            registry.register(CoordinatorCollector(coordinator))
            url = await nursery.start(serve_metrics, registry)
            assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
            async with httpx.AsyncClient() as client:
                for _ in range(2):  # one keep-alive connection, two scrapes
                    response = await client.get(url)
                    assert response.status_code == 200
                    assert value(parse(response.text), "startup_gate_open") == 0
                head = await client.head(url)
                assert head.status_code == 200 and head.content == b""
                assert (await client.get(url.replace("/metrics", "/"))).status_code == 404
                posted = await client.post(url, content=b"x")
                assert posted.status_code == 405 and posted.headers["allow"] == "GET, HEAD"
            nursery.cancel_scope.cancel()


async def test_standalone_serve_metrics_over_http() -> None:
    with trio.fail_after(GUARD):
        options = ("--engines=1", "--metrics-address=127.0.0.1:0", "--log-level=WARNING")
        async with open_serve(*options) as serve:
            endpoints = serve.endpoints
            url = endpoints["metrics"]
            assert url.startswith("http://127.0.0.1:")
            async with connect_engines(endpoints["back_pub"], endpoints["back_out"], 1) as (
                engine,
            ):
                assert await engine.next_broadcast_frames() == [protocol.READY]
                await engine.stats(2, 1, 0.125, wave=0, step=1)
                await engine.start_wave(0)  # after the stats on the same socket
                assert await engine.next_broadcast() == protocol.StartDPWave(0, 0)
                async with httpx.AsyncClient() as client:
                    response = await client.get(url)
                assert response.status_code == 200
                samples = parse(response.text)
                assert value(samples, "engine_waiting_requests", engine="0") == 2
                assert value(samples, "engine_running_requests", engine="0") == 1
                assert value(samples, "engine_kv_cache_usage_ratio", engine="0") == 0.125
                assert value(samples, "wave_starts_total", cause="engine_start_wave") == 1
                assert value(samples, "engines_running") == 1
                assert value(samples, "engine_messages_total") == 2
                assert value(samples, "ready_broadcasts_total") == 1
                check_histogram(samples, "wake_latency_seconds", count=1)
            assert await serve.stop(signal.SIGTERM) == 0, serve.stderr
            final = serve.final_counters
            assert final is not None
            assert final["engine_messages"] == 2 and final["errors"] == 0


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("0.0.0.0:0", "refusing to bind"),
        ("127.0.0.1", "expected HOST:PORT"),
        ("127.0.0.1:99999", "expected HOST:PORT"),
    ],
)
async def test_serve_refuses_a_bad_metrics_address(address: str, message: str) -> None:
    with trio.fail_after(GUARD):
        result = await trio.run_process(
            serve_command("--engines=1", f"--metrics-address={address}"),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 2
    assert result.stdout == b""
    assert message in result.stderr.decode()
