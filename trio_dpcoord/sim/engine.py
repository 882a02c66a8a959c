"""A simulated MoE DP engine (one DP rank), faithful to docs/protocol.md §6 (checklist §6.9).

Its sockets are those of a vLLM ``DPEngineCoreProc`` (:mod:`.engine_sockets`): the
coordinator's broadcast (``01`` subscription, then ``READY`` and ``START_DP_WAVE [W,
exclude]``) and output (stats-only, ``start_wave`` and, on rank 0, ``wave_complete``
``EngineCoreOutputs``), the front-end's requests (``ADD`` with the wave stamp at index
12, ``ABORT``, UTILITY commands, see :mod:`.messages`) and completions (per-step
``EngineCoreOutputs`` with outputs, ``finish_reason`` and ``finished_requests``, plus
status events), and the per-step collective with every other rank (:mod:`.collective`),
rank 0 hosting it.

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
from dataclasses import dataclass

import trio

from .. import ConnectionMonitor, protocol
from ..trio_zmq import AsyncSocket
from . import messages
from .collective import CollectiveClient, CollectiveHost, CollectiveTimeoutError
from .engine_config import (
    FINISH_ABORT,
    FINISH_LENGTH,
    AbortInput,
    CoordinatorLostError,
    EngineConfig,
    EngineCounters,
    EngineProtocolError,
    RequestState,
)
from .engine_sockets import open_engine_sockets
from .kv_events import EventBatchEncoder
from .prefix import RankCache, RankModel
from .traces import Request as TraceRequest

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["SimEngine", "run_engine", "run_sim_engine"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Announce:
    """The connection to the coordinator is back: report this rank's load again."""


_Input = (
    protocol.EngineCoreRequest
    | protocol.StartDPWave
    | protocol.UtilityCall
    | AbortInput
    | _Announce
)


class SimEngine:
    """One DP rank's state machine and busy loop; :meth:`run` opens its sockets
    (:mod:`.engine_sockets`) and runs it."""

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
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.counters = EngineCounters()
        self._newest_broadcast_wave = -1
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
    def prefix_cache(self) -> RankCache | None:
        """The simulated prefix cache (its blocks and capacity), or None for the toy engine
        without one. Read-only by contract: the engine alone changes it."""
        return None if self._prefix is None else self._prefix.cache

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
            self._queue_request(await dealer.recv_multipart())

    def _queue_request(self, frames: list[bytes]) -> None:
        """A front-end message queued for the busy loop, or counted, logged and dropped."""
        try:
            kind = protocol.decode_request_type(frames[0])
            if kind is protocol.RequestType.ADD:
                self._input_send.send_nowait(protocol.decode_engine_request(frames))
            elif kind is protocol.RequestType.UTILITY:
                self._input_send.send_nowait(protocol.decode_utility(frames))
            elif kind is protocol.RequestType.ABORT:
                self._input_send.send_nowait(AbortInput(protocol.decode_abort(frames)))
            else:
                raise protocol.ProtocolError(f"unexpected {kind.name} on the request socket")
        except protocol.ProtocolError as exc:
            self.counters.bad_requests += 1
            wave = self.current_wave
            logger.warning(
                "rank %d: dropping a bad front-end message at wave %d: %s", self.rank, wave, exc
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
        elif isinstance(item, protocol.UtilityCall):
            await self._on_utility(item)
        elif isinstance(item, _Announce):
            self._last_counts = None  # force a report of the current counts
            await self._maybe_publish_stats()
        else:
            await self._on_abort(item)

    async def _on_add(self, request: protocol.EngineCoreRequest) -> None:
        tokens = request.max_tokens or self.config.tokens_per_request
        self.waiting.append(
            RequestState(request.request_id, max(1, tokens), prompt=request.prompt_token_ids)
        )
        await self._on_stamped_wave(request.current_wave)

    async def _on_stamped_wave(self, stamped: int) -> None:
        """A request stamped with wave ``stamped`` arrived: adopt a newer wave, and wake."""
        if stamped > self.current_wave:
            was, self.current_wave = self.current_wave, stamped
            logger.debug(
                "rank %d: adopting wave %d from a request (was %d)", self.rank, stamped, was
            )
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
        if start.wave < self._newest_broadcast_wave:
            self.counters.broadcast_regressions += 1
            logger.warning(
                "rank %d: START_DP_WAVE(%d) after START_DP_WAVE(%d): the coordinator's wave "
                "went back",
                self.rank,
                start.wave,
                self._newest_broadcast_wave,
            )
        self._newest_broadcast_wave = max(self._newest_broadcast_wave, start.wave)
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

    async def _on_utility(self, call: protocol.UtilityCall) -> None:
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

    async def _other_utility(self, call: protocol.UtilityCall) -> None:
        """A utility call the simulation has no rule for (a hook: the engine-core
        engine answers vLLM's other calls here)."""
        self.counters.bad_requests += 1
        logger.warning(
            "rank %d: unknown command %r at wave %d", self.rank, call.method, self.current_wave
        )

    async def _on_abort(self, abort: AbortInput) -> None:
        ids = set(abort.request_ids)
        dropped = [r for r in (*self.waiting, *self.running) if r.request_id in ids]
        if not dropped:
            return
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        self.running = [r for r in self.running if r.request_id not in ids]
        await self._report_aborted(dropped)

    async def _report_aborted(self, dropped: list[RequestState]) -> None:
        """Tell the front-end which requests an ABORT removed (a hook: vLLM's engines
        send nothing for a request their client aborted)."""
        await self._send_outputs([(r, FINISH_ABORT) for r in dropped])

    async def _send_outputs(
        self,
        items: list[tuple[RequestState, int | None]],
        stats: protocol.SchedulerStats | None = None,
    ) -> None:
        outputs = tuple(
            protocol.EngineCoreOutput(
                r.request_id, (r.generated,) if reason != FINISH_ABORT else (), reason
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

    def _sample(self, requests: list[RequestState]) -> list[tuple[RequestState, int | None]]:
        """One new token for each of ``requests``: the outputs to send, a request
        finishing (length) when it has all its tokens."""
        items: list[tuple[RequestState, int | None]] = []
        for request in requests:
            request.generated += 1
            request.remaining -= 1
            if request.remaining <= 0:
                items.append((request, FINISH_LENGTH))
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
    def _prefill_chunk(request: RequestState, budget: int, stepped: list[RequestState]) -> int:
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

    def _look_up(self, ledger: RankModel, request: RequestState) -> None:
        """Match the prompt's cached blocks, cache its blocks, set what is left to compute
        (the model's own rule, :meth:`RankModel.admit`: whole blocks, the last prompt
        token always computed, as vLLM). Only the ledger's cache and tallies serve here:
        the job it queues is dropped, this engine schedules its own requests."""
        if self._kv_events is not None:
            self._kv_events.remember(request.prompt)
        hits = ledger.hits
        ledger.admit(
            TraceRequest(0.0, request.prompt, request.remaining, 0), self.config.block_size
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
        await publisher.send_multipart(protocol.encode_kv_event_frames(self._kv_seq, payload))
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
        """Open every socket, wait for READY, say hello, then step forever."""
        cfg = self.config
        # The nursery is entered last and exited first: tasks stop before their sockets close.
        async with open_engine_sockets(cfg) as sockets, trio.open_nursery() as nursery:
            self._coordinator = sockets.coordinator
            self._frontend = sockets.completions
            self._kv_publisher = sockets.kv_events
            self._collective = CollectiveClient(
                sockets.collective, cfg.rank, timeout=cfg.collective_timeout
            )
            if sockets.collective_host is not None:
                host = CollectiveHost(
                    sockets.collective_host, cfg.engine_count, timeout=cfg.collective_timeout
                )
                await nursery.start(host.run)
            await nursery.start(self._broadcast_receiver, sockets.broadcast)
            await self._announce()
            await nursery.start(sockets.monitor.run)
            nursery.start_soon(self._watch_coordinator, sockets.monitor)
            await self._ready.wait()
            await nursery.start(self._request_receiver, sockets.requests)
            await self._greet_frontend(sockets.requests)
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
