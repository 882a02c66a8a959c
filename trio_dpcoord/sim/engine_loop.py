"""A simulated DP rank's rules and busy loop, without its sockets (docs/protocol.md §6).

:class:`EngineLoop` is the state of §6.2, the input handling of §6.3, §6.4 and §6.8 and
the busy loop of §6.5, stepping the toy scheduler or the prefix-cache engine; it sends on
the sockets :class:`~trio_dpcoord.sim.engine.SimEngine` opens for it, and reads its
inputs from the memory channel that engine's receivers fill. See :mod:`.engine` for the
rank as a whole and its deliberate deviations from vLLM's engines.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import trio

from .. import protocol
from ..trio_zmq import AsyncSocket
from . import messages
from .collective import CollectiveClient
from .engine_config import EngineConfig
from .engine_state import FINISH_ABORT, FINISH_LENGTH, AbortInput, EngineStatistics, RequestState
from .kv_events import EventBatchEncoder
from .prefix import RankCache, RankModel
from .traces import Request as TraceRequest

__all__ = ["EngineLoop"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Announce:
    """The connection to the coordinator is back: report this rank's load again."""


EngineInput = (
    protocol.EngineCoreRequest | protocol.StartDPWave | protocol.UtilityCall | AbortInput | Announce
)


class EngineLoop:
    """One DP rank's state machine and busy loop (see the module docstring); its
    sockets are set by the subclass that opens them (:class:`~.engine.SimEngine`)."""

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
        self.counters = EngineStatistics()
        self._newest_broadcast_wave = -1
        self._last_counts: tuple[int, int] | None = None
        self._pause_calls: list[int] = []
        self.coordinator_lost = trio.Event()
        """Set when the connection to the coordinator dropped (and not cleared)."""
        self._ready = trio.Event()
        self._input_send, self._input_receive = trio.open_memory_channel[EngineInput](math.inf)
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

    async def _handle(self, item: EngineInput) -> None:
        if isinstance(item, protocol.EngineCoreRequest):
            await self._on_add(item)
        elif isinstance(item, protocol.StartDPWave):
            self._on_start_dp_wave(item)
        elif isinstance(item, protocol.UtilityCall):
            await self._on_utility(item)
        elif isinstance(item, Announce):
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
        self.counters.prefix_queries = ledger.queries
        self.counters.prefix_hits = ledger.hits
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
        changes = cache.changes
        encoder = self._kv_events
        publisher = self._kv_publisher
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
                    calls = self._pause_calls
                    self._pause_calls = []
                    for call_id in calls:
                        await self._status(messages.EVENT_PAUSED, self.current_wave, call_id)
            elif not was_running and self.rank == 0 and not self.pending_pause:
                # §6.5 step 7 / R8: mirror the paused -> running edge to the coordinator.
                await self._send_start_wave(self.current_wave)
