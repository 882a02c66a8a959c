"""Prefix-aware engine choice inside vLLM's API server: ``TRIO_DPCOORD_VLLM_ROUTING=prefix``.

vLLM's ``DPLBAsyncMPClient.get_core_engine_for_request`` (the front-end's engine choice in
every API-server process of ``vllm serve --data-parallel-size N``) scores each engine by
its queue alone. With this variable set, the ``vllm.general_plugins`` entry point
(:func:`trio_dpcoord.vllm.register`) replaces that method with :func:`choose_core_engine`:
trio_dpcoord's :class:`~trio_dpcoord.routing.PrefixRouter`, which weighs the prompt tokens
an engine already holds in its prefix cache against the busiest engine's work.

What stays vLLM's, because vLLM has reasons we must not override (the original method
decides, and does its own bookkeeping):
- a request that names its engine (``data_parallel_rank``);
- a request already in flight under its id (streaming-input session affinity: every
  chunk of a resumable session goes where the first one went);
- late-interaction pooling (queries sharing a key are pinned where their embeddings are);
- a request without prompt token ids (prompt embeddings): nothing to match.

The load part is vLLM's own score, from the state vLLM's client keeps: the coordinator's
``lb_engines`` snapshot (waiting, running, KV usage) and the client's exact in-flight
counts, ``max(client_count x in_flight, waiting + running)`` plus vLLM's KV-pressure
penalty on waiting requests. The router weighs work in tokens, so the score is taken
times the mean prompt length this front-end has routed (a queued request stands for that
many tokens to prefill). After a choice the client's state is updated exactly as vLLM's
method updates it (the local waiting count, the rotating start, ``reqs_in_flight`` and
``engine_inflight``), so aborts, outputs and the next choices work unchanged.

What each engine holds is learnt one of two ways:
- *approximate* (the default): a prompt routed to an engine is taken as cached there;
- *exact*, when vLLM runs with ``--kv-events-config`` (a ``zmq`` publisher with
  ``enable_kv_cache_events``): each engine publishes its cache's ``BlockStored`` /
  ``BlockRemoved`` / ``AllBlocksCleared`` events, and :class:`_KVEventFollower` feeds them
  to the router. Only engines whose endpoint this process can connect to count: a
  wildcard bind (``tcp://*:5557``, vLLM's default) is taken as this host; a port 0 not
  yet resolved, or an ``inproc`` endpoint (inside the engine's own process), is not
  reachable, and then the router stays approximate.

With several API servers (``--api-server-count``) each keeps its own index; fed by its
own choices alone (approximate), a server would not know where another sent a
conversation's earlier turns. So the servers tell each other every route
(:mod:`._peers`, over ``ipc://`` sockets of this host) and each keeps the index one
server would. With ``TRIO_DPCOORD_VLLM_ROUTING_PEERS=0`` (or where those sockets cannot
be made) the router's ``rendezvous_slack`` is on instead (:data:`MULTI_SERVER_SLACK`): a
prompt no single engine is known to hold more of than the others goes to the engine that
rendezvous hashing of its first block past their common prefix ranks first, among the
engines within that many prompts of the least loaded; every server computes the same
engine for a conversation's first turn and, not knowing it, for its later ones. With the
exact feed every server reads every engine's events, so routes are not shared; the
rendezvous slack stays on there too (two servers, exact: 70-72 % on multi-turn).

``TRIO_DPCOORD_VLLM_ROUTING_OPTIONS`` (a JSON object of
:class:`~trio_dpcoord.routing.PrefixRouting` fields, e.g. ``{"reuse_weight": 2}``)
overrides the settings, for calibration; unknown or invalid fields are ignored with a
WARNING.

Nothing here imports vLLM, trio or zmq at module level: the plugin is imported by every
vLLM process, and only API-server processes that opted in need this.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..protocol import KVEventError, decode_kv_event_frames
from ..routing import PrefixRouter, PrefixRouting, RouteDecision, vllm_score
from ._loop import Tally, asyncio_context, cancel_from_any_thread
from ._peers import PeerRoutes, bind_publisher, peer_endpoints, peers_wanted

__all__ = [
    "OPTIONS_VARIABLE",
    "ROUTING_VARIABLE",
    "choose_core_engine",
    "install",
    "routing_options",
    "routing_setting",
    "routing_state",
]

logger = logging.getLogger(__name__)

ROUTING_VARIABLE = "TRIO_DPCOORD_VLLM_ROUTING"
"""Set to ``prefix`` to opt in; unset or empty leaves vLLM's engine choice untouched."""
OPTIONS_VARIABLE = "TRIO_DPCOORD_VLLM_ROUTING_OPTIONS"
"""A JSON object of :class:`PrefixRouting` fields overriding the plugin's settings."""
MULTI_SERVER_SLACK = 1.0
"""``rendezvous_slack`` with more than one API server that do not share their routes
(the exact feed, ``TRIO_DPCOORD_VLLM_ROUTING_PEERS=0``, or no ipc): within one prompt's
tokens of the best engine (in vLLM's score, about one request), the engine all servers
agree on. On a
real ``vllm serve`` with two API servers (``benchmarks/README.md``) 1 kept shared
documents and Mooncake conversations together 2-10 points of hit rate better than 0,
and 3 did no better than 1. Sharing the routes did better than either (70.5 % on
multi-turn against 64-65 %, one server 72.8 %), and needs no rendezvous."""
_OPTION_FIELDS = frozenset(
    f.name for f in dataclasses.fields(PrefixRouting) if f.name not in ("block_size", "feed")
)

PREFIX = "prefix"

_DEFAULT_BLOCK_SIZE = 16  # vLLM's default --block-size
_MEAN_WEIGHT = 1.0 / 16  # how fast the mean uncached prompt follows the traffic


def routing_setting() -> str | None:
    """``"prefix"`` when opted in; None when unset or empty; the raw value otherwise."""
    setting = os.environ.get(ROUTING_VARIABLE, "")
    return setting or None


def routing_options() -> dict[str, Any]:
    """The :class:`PrefixRouting` overrides of ``TRIO_DPCOORD_VLLM_ROUTING_OPTIONS``
    (``block_size`` and ``feed`` stay vLLM's); invalid ones are dropped with a WARNING."""
    raw = os.environ.get(OPTIONS_VARIABLE, "")
    if not raw:
        return {}
    try:
        given = json.loads(raw)
    except ValueError as exc:
        logger.warning("%s is not JSON (%s): ignored", OPTIONS_VARIABLE, exc)
        return {}
    if not isinstance(given, dict):
        logger.warning("%s is not a JSON object: ignored", OPTIONS_VARIABLE)
        return {}
    options: dict[str, Any] = {}
    for name, value in given.items():
        try:
            if name not in _OPTION_FIELDS:
                raise ValueError("not a setting of the prefix policy")
            PrefixRouting(**{name: value})
        except (TypeError, ValueError) as exc:
            logger.warning("%s: %s=%r ignored (%s)", OPTIONS_VARIABLE, name, value, exc)
            continue
        options[name] = value
    return options


# vLLM's original method, saved by install() (one per patched class).
_ORIGINALS: dict[type, Callable[[Any, Any], Any]] = {}
_STATES: weakref.WeakKeyDictionary[Any, RoutingState] = weakref.WeakKeyDictionary()


def install(client_class: type, late_interaction_index: Callable[[Any, int], int | None]) -> bool:
    """Replace ``client_class.get_core_engine_for_request`` with :func:`choose_core_engine`.

    ``late_interaction_index`` is vLLM's ``get_late_interaction_engine_index`` (as the
    method itself calls it). Returns False if it was installed already (idempotent).
    """
    current = client_class.__dict__.get("get_core_engine_for_request")
    if current is None:
        raise TypeError(f"{client_class.__name__} has no get_core_engine_for_request")
    if getattr(current, "_trio_dpcoord_prefix", False):
        return False
    _ORIGINALS[client_class] = current

    def get_core_engine_for_request(self: Any, request: Any) -> Any:
        return choose_core_engine(self, request, current, late_interaction_index)

    get_core_engine_for_request._trio_dpcoord_prefix = True  # type: ignore[attr-defined]
    get_core_engine_for_request.__doc__ = choose_core_engine.__doc__
    client_class.get_core_engine_for_request = get_core_engine_for_request  # type: ignore[attr-defined]

    original_shutdown = client_class.shutdown  # type: ignore[attr-defined]

    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _STATES.pop(self, None)
        if state is not None:
            state.stop()
        return original_shutdown(self, *args, **kwargs)

    client_class.shutdown = shutdown  # type: ignore[attr-defined]
    return True


fallbacks = 0
"""Requests for which the prefix-aware choice failed and vLLM's own was used instead."""


def routing_state(client: Any) -> RoutingState | None:
    """The routing state of a client that has routed a request (for tests and metrics)."""
    return _STATES.get(client)


def choose_core_engine(
    client: Any,
    request: Any,
    original: Callable[[Any, Any], Any],
    late_interaction_index: Callable[[Any, int], int | None],
) -> Any:
    """trio_dpcoord's prefix-aware choice of ``client``'s engine for ``request``.

    vLLM's ``original`` method decides a pinned rank, streaming-input affinity,
    late-interaction pooling and prompts without token ids (see the module's docstring);
    every other request goes where :class:`PrefixRouter` says, and the client's state is
    updated as vLLM's method updates it.
    """
    engines: Sequence[Any] = client.core_engines
    token_ids = request.prompt_token_ids
    if (
        request.request_id in client.reqs_in_flight
        or token_ids is None
        or late_interaction_index(request.pooling_params, len(engines)) is not None
    ):
        return original(client, request)
    try:
        state = _STATES.get(client)
        if state is None or state.engine_count != len(engines):
            if state is not None:
                state.stop()  # the fleet was resized (elastic EP): start afresh
            state = _STATES[client] = RoutingState(client)
        if request.data_parallel_rank is not None:
            engine = original(client, request)
            state.observe(engines.index(engine), token_ids)
            return engine
        streaming: set[str] | None = getattr(client, "streaming_reqs", None)  # vLLM 0.33
        if streaming is not None:
            if request.resumable:
                streaming.add(request.request_id)
            else:
                streaming.discard(request.request_id)
        index = state.choose(client, token_ids)
    except Exception:
        # A request must not fail for want of a cache hint: vLLM's own choice serves it.
        global fallbacks
        fallbacks += 1
        logger.exception(
            "prefix-aware choice failed for request %s (%d so far); vLLM's choice used",
            request.request_id,
            fallbacks,
        )
        if request.request_id in client.reqs_in_flight:  # the pinned path got that far
            return client.reqs_in_flight[request.request_id]
        return original(client, request)
    # vLLM's bookkeeping after its own choice, so the next choices and aborts see it.
    client.lb_engines[index][0] += client.client_count
    client.eng_start_index = (client.eng_start_index + 1) % len(engines)
    engine = engines[index]
    client.reqs_in_flight[request.request_id] = engine
    client.engine_inflight[engine] += 1
    return engine


class RoutingState:
    """One client's router, its mean prompt length and (exact mode) its event followers.

    The router's ranks are the client's engine indexes (so that every API server hashes
    the same engine alike for the rendezvous); its rotation starts where vLLM's does for
    this client (``n x client_index // client_count``) and advances with it, one a
    choice, so API servers spread their first choices over the engines as vLLM does.
    """

    def __init__(self, client: Any) -> None:
        self.engine_count: int = len(client.core_engines)
        start = (self.engine_count * int(client.client_index)) // int(client.client_count)
        cache_config = getattr(client.vllm_config, "cache_config", None)
        block_size = getattr(cache_config, "block_size", None)
        if not isinstance(block_size, int) or block_size < 1:
            block_size = _DEFAULT_BLOCK_SIZE
        capacity_tokens = getattr(cache_config, "kv_cache_size_tokens", None)
        options: dict[str, Any] = {}
        if isinstance(capacity_tokens, int) and capacity_tokens >= block_size:
            options["capacity_blocks"] = capacity_tokens // block_size
        sources = _event_sources(client, self.engine_count)
        share = sources is None and int(client.client_count) > 1 and peers_wanted()
        endpoints = _peer_endpoints(client) if share else None
        publisher = None
        if endpoints is not None:
            try:
                publisher = bind_publisher(client.ctx, endpoints[int(client.client_index)])
            except Exception as exc:  # no ipc here: the rendezvous instead
                logger.warning("shared routes unavailable (%s): rendezvous instead", exc)
        if int(client.client_count) > 1 and publisher is None:
            options["rendezvous_slack"] = MULTI_SERVER_SLACK
        options.update(routing_options())
        self.router = PrefixRouter(
            self.engine_count,
            PrefixRouting(
                block_size=block_size,
                feed="exact" if sources is not None else "approximate",
                **options,
            ),
            start=start,
        )
        self.peers: PeerRoutes | None = None
        if endpoints is not None and publisher is not None:
            self.peers = PeerRoutes(
                self.router, client.ctx, endpoints, int(client.client_index), publisher
            )
            self.router.share_routes = True
        self.mean_uncached_tokens = 0.0
        """The mean of the prompt tokens this server's requests had to compute where they
        went (not cached there): what a queued request stands for in tokens."""
        self.follower: _KVEventFollower | None = None
        if sources is not None:
            self.follower = _KVEventFollower(self, client, sources)
        routing = self.router.routing
        logger.info(
            "%s=%s: prefix-aware engine choice over %d engines (%s, block size %d, "
            "%d blocks an engine, reuse weight %g, rendezvous slack %g)",
            ROUTING_VARIABLE,
            PREFIX,
            self.engine_count,
            "exact, from vLLM's KV events" if self.follower else "approximate",
            block_size,
            routing.capacity_blocks,
            routing.reuse_weight,
            routing.rendezvous_slack,
        )

    def _learn_uncached(self, decision: RouteDecision, length: int) -> None:
        uncached = float(length - decision.cached_tokens)
        if self.mean_uncached_tokens == 0.0:
            self.mean_uncached_tokens = uncached
        else:
            self.mean_uncached_tokens += _MEAN_WEIGHT * (uncached - self.mean_uncached_tokens)

    def choose(self, client: Any, token_ids: Sequence[int]) -> int:
        """The engine index for a prompt, from vLLM's loads and the prefix index."""
        if self.follower is not None:
            self.follower.ensure_started()
        engines = client.core_engines
        # vLLM's score in tokens, a queued request standing for the mean uncached prompt
        # (the first request: its own length): with nothing cached anywhere, the least
        # of it (rotation on ties, from vLLM's start) is vLLM's own choice
        unit = max(1.0, self.mean_uncached_tokens or float(len(token_ids)))
        work = [0.0] * self.engine_count
        for index in range(self.engine_count):
            waiting, running, kv_usage = client.lb_engines[index]
            score = vllm_score(
                waiting,
                running,
                kv_usage,
                client.engine_inflight[engines[index]],
                client.client_count,
            )
            work[index] = score * unit
        decision = self.router.choose(token_ids, work, time.monotonic())
        self._learn_uncached(decision, len(token_ids))
        if self.peers is not None:
            self.peers.ensure_started()
            self.peers.publish(self.router.take_routed())
        return decision.engine_index

    def observe(self, engine_index: int, token_ids: Sequence[int]) -> None:
        """A pinned request's prompt is cached where vLLM sent it (believed so at once
        with the approximate feed, provisionally with the exact one)."""
        decision = self.router.observe(engine_index, token_ids, time.monotonic())
        self._learn_uncached(decision, len(token_ids))
        if self.peers is not None:
            self.peers.publish(self.router.take_routed())

    def receive_kv_events(self, engine_index: int, seq: int, payload: bytes) -> bool:
        return self.router.receive_kv_events(engine_index, seq, payload, time.monotonic())

    def stop(self) -> None:
        """Stop following KV events; log what the router did (at the client's shutdown)."""
        if self.follower is not None:
            self.follower.stop()
        if self.peers is not None:
            self.peers.stop()
        counters = self.router.counters
        logger.info(
            "prefix-aware engine choice (%s): %d decisions, %d guard fallbacks, %d KV event "
            "batches applied, %d rejected, %d sequence gaps; %d of %d prompt tokens believed "
            "cached where they went",
            self.router.feed,
            counters.decisions,
            counters.guard_fallbacks,
            counters.event_batches,
            counters.rejected_event_batches,
            counters.event_gaps,
            counters.cached_tokens,
            counters.prompt_tokens,
        )


def subscribe_endpoint(endpoint: str) -> str | None:
    """Where a SUB socket of this host connects for a publisher bound at ``endpoint``.

    A wildcard host (``*``, ``0.0.0.0``, ``::``) is this host; ``ipc://`` is as given;
    a tcp port 0 (not resolved yet) and ``inproc://`` (another process's) are unreachable:
    None.
    """
    if endpoint.startswith("ipc://"):
        return endpoint
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        return None
    host, _, port = endpoint[6:].rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return None
    if host in ("*", "0.0.0.0"):
        host = "127.0.0.1"
    elif host in ("::", "[::]", "[*]"):
        host = "[::1]"
    return f"tcp://{host}:{port}"


def _peer_endpoints(client: Any) -> list[str] | None:
    """The API servers' shared-route endpoints (:mod:`._peers`), or None when this
    client has no coordinator address to name them by."""
    address = getattr(client, "stats_update_address", None)
    if not isinstance(address, str) or not address:
        logger.warning("no stats_update_address: API servers cannot share routes")
        return None
    return peer_endpoints(address, int(client.client_count))


def _event_sources(client: Any, ranks: int) -> list[tuple[str, bytes]] | None:
    """(endpoint, topic) per engine index if every engine's KV events can be followed."""
    sources_of = getattr(client, "get_kv_event_sources", None)
    if sources_of is None:
        return None
    by_rank: dict[int, Any] = sources_of()
    if not by_rank:
        return None
    found: list[tuple[str, bytes]] = []
    for engine in client.core_engines:
        rank = int.from_bytes(engine, "little")  # vLLM's engine identity: its rank
        config = by_rank.get(rank)
        if config is None:
            logger.warning("no KV events from engine %d: prefix choice stays approximate", rank)
            return None
        endpoint = getattr(config, "endpoint", None)
        enabled = getattr(config, "enable_kv_cache_events", False)
        publisher = getattr(config, "publisher", None)
        address = subscribe_endpoint(endpoint) if isinstance(endpoint, str) else None
        if not enabled or publisher != "zmq" or address is None:
            logger.warning(
                "engine %d's KV events (publisher %r, endpoint %r) cannot be followed from "
                "here: prefix choice stays approximate",
                rank,
                publisher,
                endpoint,
            )
            return None
        topic = getattr(config, "topic", "") or ""
        found.append((address, topic.encode()))
    return found


class _KVEventFollower:
    """Feeds each engine's KV-event batches to the router: asyncio tasks in vLLM's loop.

    Why asyncio tasks, and not trio: vLLM's API server is an asyncio process, and the
    router is read by ``get_core_engine_for_request``, which vLLM calls synchronously in
    that loop. A trio run would need a thread of its own (a stray thread, and a lock
    around the router on every choice); a task in vLLM's loop reading a ``zmq.asyncio``
    SUB socket, as vLLM's own stats task reads the coordinator's, updates the router
    between choices with no lock and no thread. One task per engine owns its socket.

    Frames are vLLM's ``ZmqEventPublisher``'s: ``(topic, seq as 8 bytes big-endian,
    msgpack EventBatch)``. A frame that is not is logged and counted (the router's
    ``rejected_event_batches``) and the task goes on; the router forgets an engine's exact
    knowledge on a sequence gap, so a lost batch never leaves blocks believed cached.
    Started on the first choice (vLLM builds the client before its loop runs requests);
    stopped by the client's ``shutdown()``.
    """

    def __init__(self, state: RoutingState, client: Any, sources: list[tuple[str, bytes]]) -> None:
        self._state = state
        self._context = client.ctx
        self._sources = sources
        self._tasks: list[asyncio.Task[None]] = []
        self._applied = Tally()

    @property
    def applied(self) -> int:
        """Event batches received from the engines so far (applied or rejected)."""
        return self._applied.value

    async def wait_applied(self, count: int) -> None:
        """Return once ``count`` batches have been received (for tests)."""
        await self._applied.reached(count)

    def ensure_started(self) -> None:
        if self._tasks:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not in vLLM's loop (yet): the next choice made there starts them
        for engine_index, (address, topic) in enumerate(self._sources):
            self._tasks.append(loop.create_task(self._follow(engine_index, address, topic)))
        logger.info(
            "following vLLM's KV events at %s", ", ".join(address for address, _ in self._sources)
        )

    def stop(self) -> None:
        """Cancel the tasks (from any thread: vLLM may shut down from another)."""
        for task in self._tasks:
            cancel_from_any_thread(task)
        self._tasks.clear()

    async def _follow(self, engine_index: int, address: str, topic: bytes) -> None:
        import zmq

        socket = asyncio_context(self._context).socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.SUBSCRIBE, topic)
            socket.connect(address)
            while True:
                frames = await socket.recv_multipart()
                self._receive(engine_index, frames)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:  # vLLM terminated the context at shutdown
            logger.debug("KV events of engine %d: %s; no longer following", engine_index, exc)
        finally:
            with contextlib.suppress(Exception):
                socket.close(linger=0)

    def _receive(self, engine_index: int, frames: list[bytes]) -> None:
        try:
            seq, payload = decode_kv_event_frames(frames)
        except KVEventError:
            self._state.router.counters.rejected_event_batches += 1
            logger.warning(
                "KV events of engine %d: %d frames, not (topic, seq, batch); ignored",
                engine_index,
                len(frames),
            )
        else:
            try:
                self._state.receive_kv_events(engine_index, seq, payload)
            except Exception:  # a batch the router could not apply: not worth the task
                self._state.router.counters.rejected_event_batches += 1
                logger.exception("KV event batch of engine %d could not be applied", engine_index)
        self._applied.add()
