"""Prometheus metrics of a coordinator (the optional ``[metrics]`` extra).

Embedded: register a :class:`CoordinatorCollector` in the application's own registry, so
that its existing ``/metrics`` includes the coordinator::

    from prometheus_client import CollectorRegistry
    from trio_dpcoord.metrics import CoordinatorCollector

    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(coordinator))

Standalone: ``trio-dpcoord serve --metrics-address HOST:PORT`` serves ``GET /metrics``
with :class:`MetricsEndpoint`, a small HTTP/1.1 server (h11) running as one more trio
task of the service: no thread, loopback unless ``--allow-remote``. A trio app without
an HTTP server of its own can do the same with :func:`serve_metrics`.

The collector reads the handle's cheap, thread-safe views (``snapshot()``,
``engine_loads()``, ``subscriptions()``, ``statistics()``) at every scrape; it keeps no
state of its own, so a scrape always shows the coordinator as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Final, TypeVar

import h11
import trio
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from ._errors import CoordinatorError
from ._shell.coordinator import Coordinator
from ._shell.endpoints import check_bind_address
from ._shell.supervision import RestartStatistics
from .core._coordinator import (
    CoordinatorStatistics,
    HistogramSnapshot,
    SubscriptionView,
    WaveStartCause,
)
from .core._wave import WaveSnapshot
from .protocol import EngineLoad

__all__ = [
    "CoordinatorCollector",
    "MetricsEndpoint",
    "coordinator_registry",
    "parse_metrics_address",
    "serve_metrics",
]

logger = logging.getLogger(__name__)

_NAMESPACE: Final = "trio_dpcoord"
_WAVE_START_CAUSES: Final = (
    WaveStartCause.ENGINE_START_WAVE,
    WaveStartCause.FIRST_REQUEST,
    WaveStartCause.LEGACY_FIRST_REQUEST,
    WaveStartCause.LATE_SUBSCRIPTION,
    WaveStartCause.RECOVERY,
)
_MAX_REQUEST_BYTES: Final = 16 * 1024
_CONNECTION_TIMEOUT: Final = 30.0
"""A scrape connection idle this long is closed (a slow or stuck client holds no task)."""


def _buckets(histogram: HistogramSnapshot) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` buckets, ``+Inf`` last, from per-bucket counts."""
    buckets: list[tuple[str, float]] = []
    total = 0
    for bound, count in zip(histogram.bounds, histogram.counts, strict=False):
        total += count
        buckets.append((repr(float(bound)), float(total)))
    buckets.append(("+Inf", float(histogram.count)))
    return buckets


class CoordinatorCollector(Collector):
    """A Prometheus collector for one :class:`~trio_dpcoord.Coordinator` handle.

    Every metric is named ``trio_dpcoord_*`` (override with ``namespace``); counters end
    in ``_total``, times are in seconds, per-engine series carry the label ``engine``
    (the DP rank).
    """

    def __init__(self, coordinator: Coordinator, *, namespace: str = _NAMESPACE) -> None:
        self._coordinator = coordinator
        self._namespace = namespace

    def _name(self, name: str) -> str:
        return f"{self._namespace}_{name}"

    def describe(self) -> Iterator[Metric]:
        """The metric families without samples, so a registry can refuse a clash."""
        for family in self._families():
            family.samples = []
            yield family

    def collect(self) -> Iterator[Metric]:
        yield from self._families()

    def _families(self) -> Iterator[Metric]:
        """Every family, from one reading of each of the handle's views."""
        coordinator = self._coordinator
        counters = coordinator.statistics()
        view = coordinator.subscriptions()
        yield from self._state_gauges(coordinator.snapshot(), counters, view)
        yield from self._event_counters(counters, view)
        yield from self._labelled_counters(counters)
        yield self._wake_latency(counters.wake_latency)
        yield from self._engine_load_gauges(coordinator.engine_loads())
        yield from self._restart_counters(coordinator.restarts())

    def _restart_counters(self, restarts: RestartStatistics) -> Iterator[Metric]:
        """Restarts after failures (docs/protocol.md §16): in place, and of the process."""
        yield _labelled(
            CounterMetricFamily(
                self._name("coordinator_restarts"),
                "Times the coordinator was restarted after a failure of its own: in place "
                "(a new core on the same sockets) or as a new process (serve --supervised).",
                labels=["kind"],
            ),
            [("in_place", restarts.restarts), ("process", restarts.process_restarts)],
        )
        yield CounterMetricFamily(
            self._name("seconds_without_coordinator"),
            "Seconds the engines were without a coordinator, over the restarts in place.",
            value=restarts.seconds_without_coordinator,
        )

    def _state_gauges(
        self, snapshot: WaveSnapshot, counters: CoordinatorStatistics, view: SubscriptionView
    ) -> Iterator[Metric]:
        """The wave, the gate, the subscriptions and the backlog, as they are now."""
        gauges = (
            ("current_wave", _HELP_CURRENT_WAVE, snapshot.current_wave),
            (
                "engines_running",
                "1 while the engines run a wave, 0 while paused.",
                int(snapshot.engines_running),
            ),
            (
                "engine_subscriptions",
                "Engines subscribed to the broadcast socket now.",
                view.current,
            ),
            (
                "startup_gate_open",
                "1 once READY went out to the expected engines.",
                int(view.gate_open),
            ),
            ("frontends_subscribed", "Front-ends subscribed to the front socket.", view.front_ends),
            (
                "engine_connections",
                "Peer connections open on the engine broadcast socket.",
                view.connections,
            ),
            (
                "engine_output_backlog_seconds",
                "How long the engine-output socket's queue had not been empty at the last "
                "read: 0 while keeping up, growing while behind.",
                counters.engine_output_backlog,
            ),
        )
        for suffix, documentation, value in gauges:
            yield GaugeMetricFamily(self._name(suffix), documentation, value=value)

    def _event_counters(
        self, counters: CoordinatorStatistics, view: SubscriptionView
    ) -> Iterator[Metric]:
        """Totals of messages, subscriptions, broadcasts and commands since the start."""
        counts = (
            (
                "waves_completed",
                "wave_complete reports accepted (a wave ended).",
                counters.waves_completed,
            ),
            (
                "engine_subscribe_events",
                "Engine subscriptions seen on the broadcast socket.",
                view.subscribed,
            ),
            ("engine_vanished", _HELP_VANISHED, view.unsubscribed),
            ("engine_late_subscriptions", _HELP_LATE, view.late_subscriptions),
            (
                "engine_messages",
                "Frames received on the engine-output socket, accepted or not.",
                counters.engine_messages,
            ),
            (
                "stats_applied",
                "Engine load reports taken in (each engine's newest of a batch written).",
                counters.stats_applied,
            ),
            (
                "stats_coalesced",
                "Load reports superseded in their batch by a newer one of their engine, "
                "so never written to the load table.",
                counters.stats_coalesced,
            ),
            ("ready_broadcasts", "READY broadcasts sent to engines.", counters.ready_broadcasts),
            (
                "front_publishes",
                "Publishes of [counts, wave, running] sent to front-ends.",
                counters.front_publishes,
            ),
            ("commands", _HELP_COMMANDS, counters.commands),
            ("unconfirmed_wake_expiries", _HELP_EXPIRIES, counters.unconfirmed_expiries),
        )
        for suffix, documentation, value in counts:
            yield CounterMetricFamily(self._name(suffix), documentation, value=value)

    def _labelled_counters(self, counters: CoordinatorStatistics) -> Iterator[Metric]:
        """Wave starts by cause, rejections by reason, lost connections by socket."""
        name = self._name
        by_cause = dict.fromkeys(_WAVE_START_CAUSES, 0) | dict(counters.wave_starts_by_cause)
        yield _labelled(
            CounterMetricFamily(
                name("wave_starts"), "START_DP_WAVE broadcasts sent, by cause.", labels=["cause"]
            ),
            sorted(by_cause.items()),
        )
        yield _labelled(
            CounterMetricFamily(
                name("rejected_inputs"),
                "Inputs rejected (logged and skipped), by reason.",
                labels=["reason"],
            ),
            sorted(counters.rejected.items()),
        )
        yield _labelled(
            CounterMetricFamily(
                name("connections_lost"),
                "Peer connections lost (closed, or silent past the heartbeat timeout), by socket.",
                labels=["socket"],
            ),
            sorted(counters.connections_lost.items()),
        )

    def _wake_latency(self, latency: HistogramSnapshot) -> Metric:
        return HistogramMetricFamily(
            self._name("wake_latency_seconds"),
            "From the decision to wake the engines to the START_DP_WAVE broadcast sent.",
            buckets=_buckets(latency),
            sum_value=latency.sum,
        )

    def _engine_load_gauges(self, loads: Sequence[EngineLoad]) -> Iterator[Metric]:
        """Each engine's latest load report, one series per rank."""
        per_engine = (
            ("engine_waiting_requests", "Requests waiting in each engine's scheduler."),
            ("engine_running_requests", "Requests running on each engine."),
            ("engine_kv_cache_usage_ratio", "KV-cache usage of each engine, 0 to 1."),
        )
        for field_index, (suffix, documentation) in enumerate(per_engine):
            yield _labelled(
                GaugeMetricFamily(
                    self._name(suffix),
                    f"{documentation} From its latest report.",
                    labels=["engine"],
                ),
                [(str(rank), load[field_index]) for rank, load in enumerate(loads)],
            )


_HELP_CURRENT_WAVE: Final = (
    "The wave the coordinator stamps on new requests (counts running->paused transitions)."
)
_HELP_VANISHED: Final = (
    "Engine unsubscriptions seen on the broadcast socket (an engine died or left)."
)
_HELP_LATE: Final = "Engines that subscribed after the start-up gate opened (answered with READY)."
_HELP_COMMANDS: Final = (
    "Commands handled: first-request notices, legacy FIRST_REQ, SCALE_ELASTIC_EP."
)
_HELP_EXPIRIES: Final = (
    "First-request wake-ups that no engine confirmed in time (taken as paused again)."
)

_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily)


def _labelled(family: _Family, samples: Iterable[tuple[str, float]]) -> _Family:
    """``family`` with one sample per ``(label value, value)``."""
    for label, value in samples:
        family.add_metric([label], value)
    return family


def parse_metrics_address(text: str, *, allow_remote: bool) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) to ``(host, port)``, with the bind rules of
    the other sockets: loopback unless ``allow_remote``. Raises :class:`CoordinatorError`
    with a one-line reason."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise CoordinatorError(f"bad metrics address {text!r}: expected HOST:PORT")
    check_bind_address(f"tcp://{host}:{port_text}", allow_remote=allow_remote)
    return host.strip("[]"), int(port_text)


async def _send(stream: trio.SocketStream, connection: h11.Connection, *events: h11.Event) -> None:
    for event in events:
        data = connection.send(event)
        if data:
            await stream.send_all(data)


def _response(
    status: int, body: bytes, content_type: str, *extra: tuple[str, str]
) -> tuple[h11.Response, h11.Data]:
    headers = [("content-type", content_type), ("content-length", str(len(body))), *extra]
    return h11.Response(status_code=status, headers=headers), h11.Data(data=body)


def _reusable(connection: h11.Connection) -> bool:
    """Both sides finished the exchange and may start the next (keep-alive)."""
    return connection.states == {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}


async def _handle_connection(stream: trio.SocketStream, registry: CollectorRegistry) -> None:
    """Answer HTTP/1.1 requests on one connection: ``GET /metrics`` (and ``HEAD``),
    404 or 405 for anything else; keep-alive until the client closes or idles."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_REQUEST_BYTES)
    async with stream:
        while True:
            request: h11.Request | None = None
            try:
                with trio.move_on_after(_CONNECTION_TIMEOUT):
                    while True:
                        event = connection.next_event()
                        if event is h11.NEED_DATA:
                            connection.receive_data(await stream.receive_some(_MAX_REQUEST_BYTES))
                            continue
                        if isinstance(event, h11.Request):
                            request = event
                        elif isinstance(event, h11.EndOfMessage):
                            break
                        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                            return
                if request is None or connection.our_state is not h11.SEND_RESPONSE:
                    return  # idle too long, or the client went away
                path = request.target.split(b"?", 1)[0]
                if request.method not in (b"GET", b"HEAD"):
                    head, body = _response(
                        405, b"method not allowed\n", "text/plain", ("allow", "GET, HEAD")
                    )
                elif path != b"/metrics":
                    head, body = _response(404, b"not found: try /metrics\n", "text/plain")
                else:
                    head, body = _response(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                    if request.method == b"HEAD":
                        body = h11.Data(data=b"")
                await _send(stream, connection, head, body, h11.EndOfMessage())
                if not _reusable(connection):
                    return
                connection.start_next_cycle()
            except h11.RemoteProtocolError as exc:
                if connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    head, body = _response(exc.error_status_hint, b"bad request\n", "text/plain")
                    await _send(stream, connection, head, body, h11.EndOfMessage())
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return


class MetricsEndpoint:
    """A bound ``/metrics`` listener for one registry: :meth:`bind` it, then run
    :meth:`serve` in a nursery (binding first lets a bad address fail before anything
    else starts)."""

    def __init__(self, registry: CollectorRegistry, listeners: list[trio.SocketListener]) -> None:
        self.registry = registry
        self._listeners = listeners
        host, port = listeners[0].socket.getsockname()[:2]
        if ":" in host:
            host = f"[{host}]"
        self.url = f"http://{host}:{port}/metrics"
        """Where the metrics are, with the real port."""

    @classmethod
    async def bind(
        cls, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0
    ) -> MetricsEndpoint:
        """Bind ``host:port`` (``port=0`` picks a free one); :class:`CoordinatorError` if
        that fails. Check the address first with :func:`parse_metrics_address`: this
        binds what it is given."""
        try:
            listeners = await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:
            raise CoordinatorError(f"cannot bind the metrics address {host}:{port}: {exc}") from exc
        return cls(registry, listeners)

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Answer scrapes until cancelled (one task per connection); started value: the URL.
        The listeners are closed when it ends."""
        registry = self.registry

        async def handler(stream: trio.SocketStream) -> None:
            await _handle_connection(stream, registry)

        logger.info("serving Prometheus metrics on %s", self.url)
        # The listeners are bound: connections queue until serve_listeners accepts them.
        task_status.started(self.url)
        await trio.serve_listeners(handler, self._listeners)


async def serve_metrics(
    registry: CollectorRegistry,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` of ``registry`` on ``host:port`` until cancelled.

    ``url = await nursery.start(serve_metrics, registry, host, port)``: the started
    value is the URL with the real port. See :class:`MetricsEndpoint`.
    """
    endpoint = await MetricsEndpoint.bind(registry, host, port)
    await endpoint.serve(task_status=task_status)


def coordinator_registry(coordinator: Coordinator) -> CollectorRegistry:
    """A fresh registry holding only ``coordinator``'s collector (what ``serve`` exposes)."""
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(coordinator))
    return registry
