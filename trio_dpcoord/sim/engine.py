"""A simulated MoE DP engine (one DP rank), faithful to docs/protocol.md §6 (checklist §6.9).

Sockets, as a vLLM ``DPEngineCoreProc`` has them:

* XSUB to the coordinator's broadcast socket, identity = rank (2 bytes LE), sends ``01``
  and blocks until ``READY``; then handles ``START_DP_WAVE [W, exclude]``;
* PUSH to the coordinator's output socket: stats-only, ``start_wave`` and (rank 0)
  ``wave_complete`` ``EngineCoreOutputs`` frames from the codec;
* DEALER (identity = rank) to the front-end's request ROUTER: ``ADD`` requests (wave stamp
  at index 12), sim commands (UTILITY, see :mod:`.messages`);
* PUSH to the front-end's completion PULL: per-step ``EngineCoreOutputs`` with outputs,
  ``finish_reason`` and ``finished_requests``, plus status events;
* the per-step collective with every other rank (:mod:`.collective`), rank 0 hosting it.

The busy loop follows §6.5 step by step; the scheduler is a toy: a waiting queue, at
most ``max_running`` running requests, one token per running request per step, a request
finishes (``finish_reason`` 1, length) after ``max_tokens`` tokens.
With ``EngineConfig.prefix_cache_blocks`` the engine is the lock-step prefix model's rank
(:mod:`.prefix`) instead: an LRU prefix cache, chunked prefill of the uncached prompt
tokens under a token budget, steps that last ``step_time + step_per_token * tokens``,
vLLM's ``prefix_cache_stats`` in the scheduler stats it attaches to its outputs, and,
with ``kv_events_address``, vLLM's KV-cache events on a PUB socket (:mod:`.kv_events`).

Deliberate deviations from vLLM's engines, each harmless to the coordinator protocol:

* **Announcement.** Right after connecting, before waiting for READY, the engine pushes
  one zero stats report (a valid stats-only ``EngineCoreOutputs`` with its rank, wave 0,
  step 0) to the coordinator, and again after every reconnection. vLLM engines first
  report after READY; announcing earlier lets a stuck start-up gate name the ranks it
  never heard from (``ReadyTimeoutError``, vLLM issue #52330), and lets a restarted
  coordinator learn every rank's load at once.
* **Coordinator watch.** A ZeroMQ socket monitor (plus ZMTP heartbeats) on the
  broadcast XSUB: when the connection to the coordinator drops, the engine logs an ERROR
  naming the address and its wave at once (vLLM engines wait silently, vLLM issue #32136),
  keeps running (ZeroMQ reconnects; the XSUB re-sends its subscription, so a restarted
  coordinator sees it and answers READY), and with ``coordinator_timeout`` exits with
  :class:`CoordinatorLostError` if it stays gone that long.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import deque
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Final, TypeAlias

import msgpack
import trio
import zmq

from .. import ConnectionMonitor, Liveness, open_connection_monitor, protocol
from ..testing import rank_identity
from ..trio_zmq import AsyncSocket, curve_client_options, open_context, open_socket
from . import messages
from .collective import CollectiveClient, CollectiveHost, CollectiveTimeoutError
from .kv_events import EventBatchEncoder, kv_event_frames
from .prefix import DEFAULT_BLOCK_SIZE, RankCache, RankModel
from .traces import Request as _TraceRequest

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "DIAGNOSED_EXIT_STATUSES",
    "EXIT_COLLECTIVE_TIMEOUT",
    "EXIT_COORDINATOR_LOST",
    "EXIT_PROTOCOL_ERROR",
    "CoordinatorLostError",
    "EngineConfig",
    "EngineCounters",
    "EngineProtocolError",
    "SimEngine",
    "run_engine",
    "run_sim_engine",
]

logger = logging.getLogger(__name__)

_Context: TypeAlias = zmq.Context[zmq.Socket[bytes]]

HEARTBEAT_OPTIONS: Final = Liveness().socket_options()
"""The coordinator's own heartbeat and keepalive options, on the engine's side."""

_FINISH_LENGTH = 1
_FINISH_ABORT = 2


# Exit statuses of ``python -m trio_dpcoord.sim engine`` for the failures it diagnoses
# itself; a launcher never restarts such a rank (its DP group is broken).
EXIT_COLLECTIVE_TIMEOUT: Final = 3  # CollectiveTimeoutError
EXIT_PROTOCOL_ERROR: Final = 4  # EngineProtocolError
EXIT_COORDINATOR_LOST: Final = 5  # CoordinatorLostError
DIAGNOSED_EXIT_STATUSES: Final = frozenset(
    {EXIT_COLLECTIVE_TIMEOUT, EXIT_PROTOCOL_ERROR, EXIT_COORDINATOR_LOST}
)


class EngineProtocolError(Exception):
    """The coordinator sent something a vLLM engine would die on (docs/protocol.md §4.1)."""


class CoordinatorLostError(Exception):
    """The connection to the coordinator stayed down for ``coordinator_timeout`` s."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one simulated DP rank needs to know."""

    rank: int
    engine_count: int
    back_publish_address: str
    """The coordinator's back-publish socket (XPUB: READY, START_DP_WAVE)."""
    back_output_address: str
    """The coordinator's back-output socket (PULL: stats, wave reports)."""
    request_address: str
    """The front-end's request ROUTER."""
    completion_address: str
    """The front-end's completion PULL."""
    collective_address: str
    """Where rank 0 binds the collective ROUTER and every rank connects."""
    step_time: float = 0.002
    """Seconds one forward pass (real or dummy) takes."""
    tokens_per_request: int = 8
    """Tokens generated for a request that carries no ``max_tokens``."""
    max_running: int = 8
    """Per-step capacity: how many requests one step advances."""
    sync_interval: int = 16
    """``dp_sync_interval``: the all-reduce runs on step 1 and every multiple of this."""
    collective_timeout: float = 10.0
    report_start_wave: bool = True
    """vLLM >= 0.33 behaviour: report ``start_wave`` for every request reaching an idle
    engine. False emulates older engines (report only for stale-wave requests), which
    rely on the front-end to wake the other ranks."""
    coordinator_timeout: float | None = None
    """Exit (:class:`CoordinatorLostError`) when the coordinator stays unreachable this
    long; None: log the loss and keep waiting for it to come back."""
    curve_server_key: bytes | None = None
    """The coordinator's CURVE public key when it runs with CURVE (off by default):
    both coordinator sockets then connect as CURVE clients."""
    prefix_cache_blocks: int = 0
    """0 (the default): the toy scheduler, one token per running request per step, every
    step ``step_time`` long. N > 0: the prefix-cache engine (see :class:`SimEngine`):
    an LRU prefix cache of N blocks of ``block_size`` tokens, chunked prefill of the
    uncached prompt tokens, steps of ``step_time + step_per_token * tokens``."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV-cache block (vLLM's ``--block-size``, 16)."""
    token_budget: int = 2048
    """Tokens one step may process (vLLM's ``max_num_batched_tokens``; 2048 is one of
    its defaults): decodes first, then prefill chunks."""
    step_per_token: float = 0.0
    """Seconds each processed token adds to a step (the lock-step model's ``b``,
    :data:`~trio_dpcoord.sim.prefix.STEP_PER_TOKEN_S`, is 2e-5); with the prefix cache only."""
    kv_events_address: str | None = None
    """Publish KV-cache events here (a ZeroMQ PUB socket this rank binds), as vLLM does
    with ``--kv-events-config``; needs the prefix cache."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.engine_count:
            raise ValueError(f"rank {self.rank} out of range for {self.engine_count} engines")
        if self.step_time < 0 or self.collective_timeout <= 0:
            raise ValueError("step_time must be >= 0 and collective_timeout > 0")
        if self.coordinator_timeout is not None and self.coordinator_timeout <= 0:
            raise ValueError("coordinator_timeout must be positive")
        if self.tokens_per_request < 1 or self.max_running < 1 or self.sync_interval < 1:
            raise ValueError("tokens_per_request, max_running and sync_interval must be >= 1")
        if self.prefix_cache_blocks < 0 or self.block_size < 1 or self.token_budget < 1:
            raise ValueError("need prefix_cache_blocks >= 0, block_size and token_budget >= 1")
        if not self.step_per_token >= 0:
            raise ValueError("step_per_token must be >= 0")
        if self.kv_events_address is not None and not self.prefix_cache_blocks:
            raise ValueError("kv_events_address needs a prefix cache (prefix_cache_blocks > 0)")


@dataclass(slots=True)
class _Request:
    request_id: str
    remaining: int
    generated: int = 0
    prompt: tuple[int, ...] = ()
    prefill_left: int = 0
    """Prompt tokens still to compute (the prefix-cache engine; 0 for the toy)."""


@dataclass(frozen=True, slots=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Announce:
    """The connection to the coordinator is back: report this rank's load again."""


_Input = (
    protocol.EngineCoreRequest | protocol.StartDPWave | messages.UtilityCall | _Abort | _Announce
)


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    dummy_steps: int = 0
    waves: int = 0
    requests_finished: int = 0
    start_waves_sent: int = 0
    broadcasts_dropped: int = 0
    bad_requests: int = 0
    stats_sent: int = 0
    coordinator_disconnects: int = 0
    coordinator_reconnects: int = 0
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache (vLLM's ``prefix_cache_stats.queries``)."""
    prefix_hits: int = 0
    """Of those, tokens found cached (``prefix_cache_stats.hits``)."""
    computed_tokens: int = 0
    """Tokens processed by real steps (prefill chunks plus decodes; the prefix cache)."""
    kv_event_batches: int = 0


class SimEngine:
    """One DP rank's state machine and busy loop; sockets are handed in by :func:`run_engine`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.rank = config.rank
        # §6.2 state
        self.current_wave = 0
        self.step_counter = 0
        self.engines_running = False
        self.pending_pause = False
        self.ignore_start_dp_wave = False
        self.scheduler_paused = False
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.counters = EngineCounters()
        self._last_counts: tuple[int, int] | None = None
        self._pause_calls: list[int] = []
        self.coordinator_lost = trio.Event()
        """Set when the connection to the coordinator dropped (and not cleared)."""
        self._ready = trio.Event()
        self._input_send, self._input_receive = trio.open_memory_channel[_Input](math.inf)
        self._coordinator: AsyncSocket | None = None
        self._frontend: AsyncSocket | None = None
        self._collective: CollectiveClient | None = None
        self._prefix: RankModel | None = None
        """The prefix-cache engine's cache and its query/hit tallies (None: the toy)."""
        self._lookups = 0
        self._reported = (0, 0, 0)
        """(requests, queries, hits) as of the last report: vLLM reports deltas."""
        self._kv_events: EventBatchEncoder | None = None
        self._kv_publisher: AsyncSocket | None = None
        self._kv_seq = 0
        if config.prefix_cache_blocks:
            cache = RankCache(config.prefix_cache_blocks)
            if config.kv_events_address is not None:
                cache.changes = []
                self._kv_events = EventBatchEncoder(config.block_size)
            self._prefix = RankModel(cache)

    @property
    def ready(self) -> bool:
        """Whether READY arrived from the coordinator."""
        return self._ready.is_set()

    # --- receivers -------------------------------------------------------------------

    async def _broadcast_receiver(
        self, sub: AsyncSocket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await sub.send(protocol.SUBSCRIBE)
        task_status.started()
        while True:
            frames = await sub.recv_multipart()
            try:
                message = protocol.decode_engine_broadcast(frames)
            except protocol.ProtocolError as exc:
                # A vLLM engine's input thread raises here and the engine dies (§4.1).
                raise EngineProtocolError(
                    f"rank {self.rank}: invalid broadcast from the coordinator at wave "
                    f"{self.current_wave}: {exc}"
                ) from exc
            if message == "READY":
                if not self._ready.is_set():
                    logger.debug("rank %d: READY at wave %d", self.rank, self.current_wave)
                    self._ready.set()
                continue
            assert isinstance(message, protocol.StartDPWave)
            self._input_send.send_nowait(message)

    async def _request_receiver(
        self, dealer: AsyncSocket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            frames = await dealer.recv_multipart()
            try:
                kind = protocol.decode_request_type(frames[0])
                if kind is protocol.RequestType.ADD:
                    self._input_send.send_nowait(protocol.decode_engine_request(frames))
                elif kind is protocol.RequestType.UTILITY:
                    self._input_send.send_nowait(messages.decode_utility_call(frames))
                elif kind is protocol.RequestType.ABORT and len(frames) == 2:
                    ids = msgpack.unpackb(frames[1])
                    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                        raise protocol.ProtocolError("ABORT payload must be a list of str")
                    self._input_send.send_nowait(_Abort(tuple(ids)))
                else:
                    raise protocol.ProtocolError(f"unexpected {kind.name} on the request socket")
            except (protocol.ProtocolError, ValueError, msgpack.UnpackException) as exc:
                self.counters.bad_requests += 1
                logger.warning(
                    "rank %d: dropping a bad front-end message at wave %d: %s",
                    self.rank,
                    self.current_wave,
                    exc,
                )

    # --- sending (only the busy loop sends on these sockets) ------------------------

    async def _to_coordinator(self, out: protocol.EngineCoreOutputs) -> None:
        assert self._coordinator is not None
        await self._coordinator.send(protocol.encode_engine_core_outputs(out))

    async def _to_frontend(self, frame: bytes) -> None:
        assert self._frontend is not None
        await self._frontend.send(frame)

    async def _status(self, event: str, wave: int, call_id: int = 0) -> None:
        await self._to_frontend(messages.status_output(self.rank, event, wave, call_id))

    async def _send_start_wave(self, wave: int) -> None:
        self.counters.start_waves_sent += 1
        logger.debug("rank %d: start_wave(%d)", self.rank, wave)
        await self._to_coordinator(
            protocol.EngineCoreOutputs(engine_index=self.rank, start_wave=wave)
        )

    async def _maybe_publish_stats(self) -> None:
        """§6.6: a stats-only message whenever (running, waiting) changed."""
        counts = (len(self.running), len(self.waiting))
        if counts == self._last_counts:
            return
        self._last_counts = counts
        self.counters.stats_sent += 1
        stats = protocol.SchedulerStats(
            num_running_reqs=counts[0],
            num_waiting_reqs=counts[1],
            step_counter=self.step_counter,
            current_wave=self.current_wave,
            kv_cache_usage=self._kv_usage(),
        )
        await self._to_coordinator(
            protocol.EngineCoreOutputs(engine_index=self.rank, scheduler_stats=stats)
        )

    # --- input handling (§6.3, §6.4, §6.8) --------------------------------------------

    def _has_unfinished(self) -> bool:
        """Local work the scheduler can run (a paused scheduler keeps but does not run it)."""
        return not self.scheduler_paused and bool(self.waiting or self.running)

    async def _handle(self, item: _Input) -> None:
        if isinstance(item, protocol.EngineCoreRequest):
            await self._on_add(item)
        elif isinstance(item, protocol.StartDPWave):
            self._on_start_dp_wave(item)
        elif isinstance(item, messages.UtilityCall):
            await self._on_utility(item)
        elif isinstance(item, _Announce):
            self._last_counts = None  # force a report of the current counts
            await self._maybe_publish_stats()
        else:
            await self._on_abort(item)

    async def _on_add(self, request: protocol.EngineCoreRequest) -> None:
        tokens = request.max_tokens or self.config.tokens_per_request
        self.waiting.append(
            _Request(request.request_id, max(1, tokens), prompt=request.prompt_token_ids)
        )
        stamped = request.current_wave
        if stamped > self.current_wave:
            logger.debug(
                "rank %d: adopting wave %d from a request (was %d)",
                self.rank,
                stamped,
                self.current_wave,
            )
            self.current_wave = stamped
        if self.config.report_start_wave:
            # vLLM 0.33.0: wake itself first (R5), then tell the coordinator.
            if not self.engines_running and not self.scheduler_paused:
                self.engines_running = True
                await self._send_start_wave(self.current_wave)
        elif stamped < self.current_wave and not self.engines_running:
            # Pre-0.33 engines reported only requests stamped for a finished wave (R2);
            # the local work makes this rank step anyway.
            await self._send_start_wave(self.current_wave)

    def _on_start_dp_wave(self, start: protocol.StartDPWave) -> None:
        if self.ignore_start_dp_wave:
            self.counters.broadcasts_dropped += 1
            logger.debug(
                "rank %d: paused, dropping START_DP_WAVE(%d) at wave %d",
                self.rank,
                start.wave,
                self.current_wave,
            )
            return
        if start.exclude_engine_index == self.rank or start.wave < self.current_wave:
            return
        if start.wave != self.current_wave:
            logger.debug(
                "rank %d: wave %d -> %d by START_DP_WAVE", self.rank, self.current_wave, start.wave
            )
        self.current_wave = start.wave
        self.engines_running = True

    async def _on_utility(self, call: messages.UtilityCall) -> None:
        if call.method == messages.PAUSE_SCHEDULER:
            self.scheduler_paused = True
            if self.ignore_start_dp_wave:  # already paused: nothing to agree on
                await self._status(messages.EVENT_PAUSED, self.current_wave, call.call_id)
                return
            # §6.8: every rank must reach the next sync point to agree.
            self.pending_pause = True
            self.engines_running = True
            self._pause_calls.append(call.call_id)
            logger.debug("rank %d: pause requested at wave %d", self.rank, self.current_wave)
        elif call.method == messages.RESUME_SCHEDULER:
            self.scheduler_paused = False
            self.ignore_start_dp_wave = False
            logger.debug("rank %d: resumed at wave %d", self.rank, self.current_wave)
            await self._status(messages.EVENT_RESUMED, self.current_wave, call.call_id)
            # Requests kept during the pause: wake the group as a new request would.
            if self._has_unfinished() and not self.engines_running:
                self.engines_running = True
                if self.config.report_start_wave:
                    await self._send_start_wave(self.current_wave)
        else:
            await self._other_utility(call)

    async def _other_utility(self, call: messages.UtilityCall) -> None:
        """A utility call the simulation has no rule for (a hook: the engine-core
        engine answers vLLM's other calls here)."""
        self.counters.bad_requests += 1
        logger.warning(
            "rank %d: unknown command %r at wave %d", self.rank, call.method, self.current_wave
        )

    async def _on_abort(self, abort: _Abort) -> None:
        ids = set(abort.request_ids)
        dropped = [r for r in (*self.waiting, *self.running) if r.request_id in ids]
        if not dropped:
            return
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        self.running = [r for r in self.running if r.request_id not in ids]
        await self._report_aborted(dropped)

    async def _report_aborted(self, dropped: list[_Request]) -> None:
        """Tell the front-end which requests an ABORT removed (a hook: vLLM's engines
        send nothing for a request their client aborted)."""
        await self._send_outputs([(r, _FINISH_ABORT) for r in dropped])

    async def _send_outputs(
        self,
        items: list[tuple[_Request, int | None]],
        stats: protocol.SchedulerStats | None = None,
    ) -> None:
        outputs = tuple(
            protocol.EngineCoreOutput(
                r.request_id, (r.generated,) if reason != _FINISH_ABORT else (), reason
            )
            for r, reason in items
        )
        finished = tuple(r.request_id for r, reason in items if reason is not None)
        await self._to_frontend(
            protocol.encode_engine_core_outputs(
                protocol.EngineCoreOutputs(
                    engine_index=self.rank,
                    outputs=outputs,
                    scheduler_stats=stats,
                    timestamp=trio.current_time(),
                    finished_requests=finished or None,
                    weight_version="default",
                )
            )
        )

    # --- the busy loop (§6.5) ---------------------------------------------------------

    async def _real_step(self) -> None:
        if self._prefix is not None:
            await self._prefill_step(self._prefix)
            return
        while self.waiting and len(self.running) < self.config.max_running:
            self.running.append(self.waiting.popleft())
        await trio.sleep(self.config.step_time)
        items = self._sample(self.running)
        self.running = [r for r in self.running if r.remaining > 0]
        await self._send_outputs(items)

    def _sample(self, requests: list[_Request]) -> list[tuple[_Request, int | None]]:
        """One new token for each of ``requests``: the outputs to send, a request
        finishing (length) when it has all its tokens."""
        items: list[tuple[_Request, int | None]] = []
        for request in requests:
            request.generated += 1
            request.remaining -= 1
            if request.remaining <= 0:
                items.append((request, _FINISH_LENGTH))
                self.counters.requests_finished += 1
            else:
                items.append((request, None))
        return items

    # --- the prefix-cache engine (EngineConfig.prefix_cache_blocks > 0) -----------------

    async def _prefill_step(self, ledger: RankModel) -> None:
        """One step as the lock-step prefix model takes it (:mod:`.prefix`), on this rank.

        Up to ``token_budget`` tokens, in vLLM's scheduler's order: one per decoding
        request, then the next chunk of the prompts being computed, then waiting requests
        while budget is left, each looked up in the prefix cache as it is scheduled (as
        vLLM does), its blocks cached, and only its uncached tokens computed; a request
        whose prompt completes samples its first token in that step. The step lasts
        ``step_time + step_per_token * tokens``; the collective that follows makes every
        rank wait for the busiest one.
        """
        cfg = self.config
        budget = cfg.token_budget
        stepped = [r for r in self.running if r.prefill_left == 0][:budget]
        budget -= len(stepped)
        for request in self.running:
            if budget == 0:
                break
            if request.prefill_left > 0:
                budget -= self._prefill_chunk(request, budget, stepped)
        while self.waiting and budget > 0 and len(self.running) < cfg.max_running:
            request = self.waiting.popleft()
            self._look_up(ledger, request)
            self.running.append(request)
            budget -= self._prefill_chunk(request, budget, stepped)
        tokens = cfg.token_budget - budget
        self.counters.computed_tokens += tokens
        await trio.sleep(cfg.step_time + cfg.step_per_token * tokens)
        items = self._sample(stepped)
        self.running = [r for r in self.running if r.remaining > 0]
        await self._send_outputs(items, self._step_stats(ledger))
        await self._publish_kv_events(ledger.cache)

    @staticmethod
    def _prefill_chunk(request: _Request, budget: int, stepped: list[_Request]) -> int:
        """Compute up to ``budget`` of the request's prompt tokens; returns how many. A
        request whose prompt is done joins ``stepped`` (it samples a token)."""
        chunk = min(request.prefill_left, budget)
        request.prefill_left -= chunk
        if request.prefill_left == 0:
            stepped.append(request)
        return chunk

    def _kv_usage(self) -> float:
        """The KV-cache usage an engine reports: the toy's running share of
        ``max_running`` (times 0.9); with the prefix cache, the blocks its running
        requests hold over the cache's size (at most 1), as vLLM counts it."""
        if self._prefix is None:
            return min(1.0, len(self.running) / self.config.max_running) * 0.9
        size = self.config.block_size
        held = sum(-(-(len(r.prompt) + r.generated) // size) for r in self.running)
        return min(1.0, held / self._prefix.cache.capacity_blocks)

    def _look_up(self, ledger: RankModel, request: _Request) -> None:
        """Match the prompt's cached blocks, cache its blocks, set what is left to compute
        (the model's own rule, :meth:`RankModel.admit`: whole blocks, the last prompt
        token always computed, as vLLM). Only the ledger's cache and tallies serve here:
        the job it queues is dropped, this engine schedules its own requests."""
        if self._kv_events is not None:
            self._kv_events.remember(request.prompt)
        hits = ledger.hits
        ledger.admit(
            _TraceRequest(0.0, request.prompt, request.remaining, 0), self.config.block_size
        )
        ledger.queue.clear()
        request.prefill_left = len(request.prompt) - (ledger.hits - hits)
        self._lookups += 1

    def _step_stats(self, ledger: RankModel) -> protocol.SchedulerStats:
        """The scheduler stats vLLM attaches to a step's outputs: this rank's counts and
        the prefix-cache lookups since the previous report."""
        counts = (self._lookups, ledger.queries, ledger.hits)
        requests, queries, hits = (
            now - then for now, then in zip(counts, self._reported, strict=True)
        )
        self._reported = counts
        self.counters.prefix_queries, self.counters.prefix_hits = ledger.queries, ledger.hits
        return protocol.SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            step_counter=self.step_counter,
            current_wave=self.current_wave,
            kv_cache_usage=self._kv_usage(),
            prefix_cache_stats=protocol.PrefixCacheStats(
                requests=requests, queries=queries, hits=hits
            ),
        )

    async def _publish_kv_events(self, cache: RankCache) -> None:
        """This step's stores and evictions as one vLLM ``EventBatch`` on the KV PUB."""
        changes, encoder, publisher = cache.changes, self._kv_events, self._kv_publisher
        if not changes or encoder is None or publisher is None:
            return
        payload = encoder.encode(time.time(), self.rank, changes)
        encoder.forget(key for stored, key in changes if not stored and key not in cache.blocks)
        changes.clear()
        if len(encoder) > 4 * cache.capacity_blocks:  # blocks of prompts too long to cache
            encoder.retain(cache.blocks)
        await publisher.send_multipart(kv_event_frames(self._kv_seq, payload))
        self._kv_seq += 1
        self.counters.kv_event_batches += 1

    async def _busy_loop(self) -> None:
        assert self._collective is not None
        receive = self._input_receive
        while True:
            was_running = self.engines_running
            if not self.engines_running and not self._has_unfinished():
                await self._handle(await receive.receive())  # idle: block, no busy loop
            while True:
                try:
                    item = receive.receive_nowait()
                except trio.WouldBlock:
                    break
                await self._handle(item)
            await self._maybe_publish_stats()

            real = self._has_unfinished()
            if not real and not self.engines_running:
                continue  # fully idle (e.g. an excluded START_DP_WAVE), no collective
            if self.step_counter == 0:  # the first step of a wave on this rank
                await self._status(messages.EVENT_RUNNING, self.current_wave)
            if real:
                await self._real_step()
                await self._maybe_publish_stats()
            else:
                self.counters.dummy_steps += 1
                await trio.sleep(self.config.step_time)  # a dummy batch for the peers
            self.counters.steps += 1

            self.step_counter += 1
            sync = self.step_counter == 1 or self.step_counter % self.config.sync_interval == 0
            result = await self._collective.step(
                wave=self.current_wave,
                step=self.step_counter,
                has_unfinished=self._has_unfinished(),
                pending_pause=self.pending_pause,
            )
            if sync:
                size = self.config.engine_count
                pause_consensus = result.pending_pause == size
                if pause_consensus:
                    self.ignore_start_dp_wave = True
                    self.pending_pause = False
                self.engines_running = result.unfinished > 0 or result.pending_pause % size != 0
            else:
                self.engines_running = True

            if not self.engines_running:
                ended = self.current_wave
                if self.rank == 0:
                    await self._to_coordinator(
                        protocol.EngineCoreOutputs(engine_index=0, wave_complete=ended)
                    )
                self.counters.waves += 1
                self.current_wave += 1
                self.step_counter = 0
                logger.debug("rank %d: wave %d complete -> %d", self.rank, ended, self.current_wave)
                await self._status(messages.EVENT_IDLE, ended)
                if self.ignore_start_dp_wave:
                    calls, self._pause_calls = self._pause_calls, []
                    for call_id in calls:
                        await self._status(messages.EVENT_PAUSED, self.current_wave, call_id)
            elif not was_running and self.rank == 0 and not self.pending_pause:
                # §6.5 step 7 / R8: mirror the paused -> running edge to the coordinator.
                await self._send_start_wave(self.current_wave)

    async def _announce(self) -> None:
        """A zero stats report before READY (see the module docstring): the coordinator
        hears this rank's index even while its start-up gate is still closed."""
        self.counters.stats_sent += 1
        stats = protocol.SchedulerStats(
            num_running_reqs=0,
            num_waiting_reqs=0,
            step_counter=0,
            current_wave=0,
            kv_cache_usage=0.0,
        )
        await self._to_coordinator(
            protocol.EngineCoreOutputs(engine_index=self.rank, scheduler_stats=stats)
        )

    async def _watch_coordinator(self, monitor: ConnectionMonitor) -> None:
        """Say at once when the coordinator's connection drops; give up after
        ``coordinator_timeout`` if configured; re-announce when it is back."""
        address = self.config.back_publish_address
        timeout = self.config.coordinator_timeout
        while True:
            if monitor.connected or timeout is None:
                await monitor.wait_changed()
            else:
                with trio.move_on_after(max(0.0, timeout - monitor.down_for())):
                    await monitor.wait_changed()
                if not monitor.connected and monitor.down_for() >= timeout:
                    raise CoordinatorLostError(
                        f"rank {self.rank}: the coordinator at {address} has been unreachable "
                        f"for {timeout:g} s (wave {self.current_wave}); giving up"
                    )
            if not monitor.connected:
                self.counters.coordinator_disconnects += 1
                self.coordinator_lost.set()
                logger.error(
                    "rank %d: lost the coordinator at %s during wave %d (running=%s); "
                    "waiting for it to come back",
                    self.rank,
                    address,
                    self.current_wave,
                    self.engines_running,
                )
            elif monitor.reconnects > self.counters.coordinator_reconnects:
                self.counters.coordinator_reconnects = monitor.reconnects
                logger.warning(
                    "rank %d: reconnected to the coordinator at %s at wave %d",
                    self.rank,
                    address,
                    self.current_wave,
                )
                self._input_send.send_nowait(_Announce())

    async def _greet_frontend(self, dealer: AsyncSocket) -> None:
        """The first message on the request socket, once READY came (a hook: the
        engine-core engine sends vLLM's ready response and finishes its handshake)."""
        await dealer.send(messages.encode_hello(self.config.rank))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect every socket, wait for READY, say hello, then step forever."""
        cfg = self.config
        async with AsyncExitStack() as stack:
            context = await stack.enter_async_context(open_context())
            router = await self._open_collective(stack, context)
            sub, monitor = await self._connect_coordinator(stack, context)
            dealer = await self._connect_frontend(stack, context)
            if cfg.kv_events_address is not None:
                self._kv_publisher = await stack.enter_async_context(
                    # vLLM's KVEventsConfig.hwm default; a PUB drops beyond it.
                    open_socket(
                        context, zmq.PUB, bind=cfg.kv_events_address, options={zmq.SNDHWM: 100_000}
                    )
                )
            # Entered last, exited first: tasks stop before their sockets close.
            nursery = await stack.enter_async_context(trio.open_nursery())
            if router is not None:
                host = CollectiveHost(router, cfg.engine_count, timeout=cfg.collective_timeout)
                await nursery.start(host.run)
            await nursery.start(self._broadcast_receiver, sub)
            await self._announce()
            await nursery.start(monitor.run)
            nursery.start_soon(self._watch_coordinator, monitor)
            await self._ready.wait()
            await nursery.start(self._request_receiver, dealer)
            await self._greet_frontend(dealer)
            logger.info("rank %d of %d ready", cfg.rank, cfg.engine_count)
            task_status.started()
            try:
                await self._busy_loop()
            except CollectiveTimeoutError:
                logger.error(
                    "rank %d: collective failed at wave %d step %d",
                    cfg.rank,
                    self.current_wave,
                    self.step_counter,
                )
                raise

    async def _open_collective(
        self, stack: AsyncExitStack, context: _Context
    ) -> AsyncSocket | None:
        """This rank's link to the step collective; rank 0 also hosts it (the ROUTER it
        returns, None on the other ranks)."""
        cfg = self.config
        router: AsyncSocket | None = None
        if cfg.rank == 0:
            router = await stack.enter_async_context(
                open_socket(
                    context,
                    zmq.ROUTER,
                    bind=cfg.collective_address,
                    # A restarted rank reconnects with the same identity: route to it.
                    options={zmq.RCVHWM: 0, zmq.SNDHWM: 0, zmq.ROUTER_HANDOVER: 1},
                )
            )
        collective = await stack.enter_async_context(
            open_socket(
                context,
                zmq.DEALER,
                connect=cfg.collective_address,
                options={zmq.IDENTITY: rank_identity(cfg.rank), zmq.RCVHWM: 0, zmq.SNDHWM: 0},
            )
        )
        self._collective = CollectiveClient(collective, cfg.rank, timeout=cfg.collective_timeout)
        return router

    async def _connect_coordinator(
        self, stack: AsyncExitStack, context: _Context
    ) -> tuple[AsyncSocket, ConnectionMonitor]:
        """The coordinator's broadcast (XSUB, watched from before it connects, so the
        first handshake counts) and its output (PUSH, kept for sending)."""
        cfg = self.config
        security = curve_client_options(cfg.curve_server_key)
        sub = await stack.enter_async_context(
            open_socket(
                context,
                zmq.XSUB,
                options={zmq.IDENTITY: rank_identity(cfg.rank), **HEARTBEAT_OPTIONS, **security},
            )
        )
        monitor = await stack.enter_async_context(
            open_connection_monitor(context, sub, f"rank {cfg.rank} coordinator link")
        )
        sub.connect(cfg.back_publish_address)
        self._coordinator = await stack.enter_async_context(
            open_socket(
                context,
                zmq.PUSH,
                connect=cfg.back_output_address,
                options={zmq.SNDHWM: 0, **HEARTBEAT_OPTIONS, **security},
            )
        )
        return sub, monitor

    async def _connect_frontend(self, stack: AsyncExitStack, context: _Context) -> AsyncSocket:
        """The front-end's completion PUSH (kept for sending) and its request DEALER."""
        cfg = self.config
        self._frontend = await stack.enter_async_context(
            open_socket(context, zmq.PUSH, connect=cfg.completion_address, options={zmq.SNDHWM: 0})
        )
        return await stack.enter_async_context(
            open_socket(
                context,
                zmq.DEALER,
                connect=cfg.request_address,
                options={zmq.IDENTITY: rank_identity(cfg.rank), zmq.RCVHWM: 0, zmq.SNDHWM: 0},
            )
        )


async def run_engine(config: EngineConfig) -> None:
    """Run one simulated DP rank until cancelled.

    Raises :class:`CollectiveTimeoutError` when a step's collective times out (some rank
    never arrived), :class:`EngineProtocolError` when the coordinator broadcasts
    something a vLLM engine would die on and :class:`CoordinatorLostError` when the
    coordinator stayed unreachable for ``coordinator_timeout`` (unwrapped from trio's
    exception groups).
    """
    await run_sim_engine(SimEngine(config))


async def run_sim_engine(engine: SimEngine) -> None:
    """:func:`run_engine` for an engine object the caller keeps (to read its counters)."""
    try:
        await engine.run()
    except BaseExceptionGroup as group:
        fatal = _first_leaf(
            group, (CollectiveTimeoutError, EngineProtocolError, CoordinatorLostError)
        )
        if fatal is None:
            raise
        raise fatal from None


def _first_leaf(
    group: BaseExceptionGroup[BaseException], kinds: tuple[type[BaseException], ...]
) -> BaseException | None:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = _first_leaf(exc, kinds)
            if found is not None:
                return found
        elif isinstance(exc, kinds):
            return exc
    return None
