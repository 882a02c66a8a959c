"""A trio engine-core client for vLLM's DP engines, with the wave coordinator inside.

:func:`open_engine_client` is the front-end side of vLLM's engine protocol (the part of
``MPClient``/``DPLBAsyncMPClient`` that talks to engine cores, docs/protocol.md §14): it
binds the handshake address that engines started with ``vllm serve MODEL --headless
--data-parallel-address HOST --data-parallel-rpc-port PORT`` connect to, answers each
HELLO with the addresses to use (the request input, an output socket of the rank's own,
the embedded coordinator's two engine sockets), waits for every READY, then sends
requests stamped with the coordinator's current wave to the engine the chooser picks,
and streams each request's outputs to its own :class:`RequestStream`.

The rules live in :mod:`trio_dpcoord.core` (handshake state, request table) and
:mod:`trio_dpcoord.protocol` (the wire); the tasks here only move bytes: one sender owns
the request-input socket, one listener per rank reads that rank's output socket, one
watcher per rank reads its connection events, so that an engine that dies or goes silent
(ZMTP heartbeats drop the connection) fails exactly its own requests with
:class:`EngineDeadError` naming the rank."""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any, final

import trio

from .._errors import (
    EngineClientClosedError,
    EngineClientError,
    EngineDeadError,
    RequestAbortedError,
)
from .._reject_log import CountedRejectLog
from ..core._engine_client import RequestState, RequestTable, SilenceWatch
from ..protocol import (
    FINISH_REASONS,
    EngineDead,
    EngineLoad,
    ProtocolError,
    SamplingParams,
    decode_client_frames,
    encode_abort,
    encode_add,
    encode_utility,
    engine_identity,
)
from ..routing._chooser import EngineChooser
from .coordinator import Coordinator
from .engine_io import Outbox
from .request_stream import (
    Completion,
    EngineClientStatistics,
    RequestStream,
)
from .utility_calls import UtilityCalls

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["EngineClient"]

logger = logging.getLogger(__name__)

_UNAVAILABLE = EngineLoad(waiting=2**62, running=0, kv_cache_usage=1.0)
"""The load a dead rank is given so that the chooser never picks it."""


@final
class EngineClient:
    """The handle :func:`open_engine_client` yields once every engine is ready.

    Properties are fixed settings; methods read what changes (docs/api.md's rule)."""

    def __init__(
        self,
        coordinator: Coordinator,
        engine_count: int,
        ready_responses: Mapping[int, Mapping[str, Any]],
        outbox: Outbox,
        client_index: int,
        silence_timeout: float | None = None,
        chooser: EngineChooser | None = None,
    ) -> None:
        self._coordinator = coordinator
        self._engine_count = engine_count
        self._ready_responses = ready_responses
        self._client_index = client_index
        self._outbox = outbox
        self._identities = [engine_identity(rank) for rank in range(engine_count)]
        self._table = RequestTable()
        self._streams: dict[str, RequestStream] = {}
        self._uncounted: set[str] = set()
        """Pinned requests the chooser does not count in flight (vLLM's routing): their
        end must not release a chosen request's count."""
        self._calls = UtilityCalls(self._table)
        self._chooser = chooser if chooser is not None else EngineChooser(engine_count)
        self._closed = False
        self._request_id_prefix = f"trio-{uuid.uuid4().hex[:12]}-"
        self._requests_made = 0
        self._reject = CountedRejectLog(logger)
        self._silence = SilenceWatch(silence_timeout) if silence_timeout is not None else None
        self._work_sent = trio.Event()
        self._requests_sent = 0
        self._requests_aborted = 0
        self._shutdown_expected = False
        self._paused_by_us = False
        """Between a pause call of ours and its resume: no first-request notice then."""

    # --- public API -----------------------------------------------------------------
    @property
    def coordinator(self) -> Coordinator:
        """The embedded wave coordinator (its snapshot, loads and statistics)."""
        return self._coordinator

    @property
    def engine_count(self) -> int:
        return self._engine_count

    @property
    def client_index(self) -> int:
        return self._client_index

    @property
    def ready_responses(self) -> Mapping[int, Mapping[str, Any]]:
        """Each rank's ``EngineCoreReadyResponse`` (``max_model_len``, ``vllm_version``...)."""
        return self._ready_responses

    def expect_shutdown(self) -> None:
        """The engines are being stopped on purpose (call it just before stopping them):
        a rank leaving is then logged at INFO, not WARNING (its work still fails), and
        the embedded coordinator is told the same, so a normal shutdown does not read
        like an outage."""
        self._shutdown_expected = True
        self._coordinator.expect_shutdown()

    def in_flight(self, engine_index: int | None = None) -> list[str]:
        """Request ids in flight (on ``engine_index`` only, if given)."""
        return self._table.in_flight(engine_index)

    def statistics(self) -> EngineClientStatistics:
        """The client's bookkeeping now, a frozen copy (as trio's ``statistics()``
        methods: a cheap, synchronous read): requests and calls in flight, the ranks
        taken as dead, running totals."""
        return EngineClientStatistics(
            requests_in_flight=len(self._table.in_flight()),
            streams_open=len(self._streams),
            calls_pending=len(self._calls),
            dead_engines=frozenset(self._table.dead),
            requests_sent=self._requests_sent,
            requests_aborted=self._requests_aborted,
            rejected=dict(self._reject.counts),
        )

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        engine_index: int | None = None,
        priority: int = 0,
        buffer: int = 1024,
    ) -> RequestStream:
        """A request for ``prompt_token_ids``; enter the returned stream to send it.

        ``engine_index`` pins the request to that engine (vLLM's ``data_parallel_rank``);
        otherwise the chooser picks the engine from the coordinator's live loads.
        ``buffer``: how many outputs may wait unread before the request is aborted.
        """
        if engine_index is not None and not 0 <= engine_index < self._engine_count:
            raise ValueError(
                f"engine_index must be in [0, {self._engine_count}), got {engine_index}"
            )
        if buffer < 1:
            raise ValueError("buffer must be at least 1")
        if request_id is None:
            request_id = f"{self._request_id_prefix}{self._requests_made}"
            self._requests_made += 1
        return RequestStream(
            self,
            request_id,
            prompt_token_ids,
            params or SamplingParams(),
            engine_index,
            priority,
            buffer,
        )

    async def complete(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        engine_index: int | None = None,
    ) -> Completion:
        """Send one request and wait for all of it (its token ids are gathered as they
        come, without waking the caller before the end)."""
        async with self.generate(prompt_token_ids, params, engine_index=engine_index) as stream:
            tokens = await stream.rest()
        assert stream.finish_reason is not None and stream.engine_index is not None
        return Completion(stream.request_id, tokens, stream.finish_reason, stream.engine_index)

    async def abort(self, request_id: str) -> None:
        """Abort a request in flight: its stream ends at once with a last output of
        finish reason ``abort`` (the engine sends nothing for an aborted request, as
        vLLM's own front-end knows: it ends the request itself); nothing happens for an
        unknown id."""
        rank = self._table.engine_index_of(request_id)
        if rank is None:
            return
        stream = self._streams.get(request_id)
        self._finish(request_id, rank)
        self._requests_aborted += 1
        self._queue(rank, encode_abort([request_id]))
        if stream is not None and not stream._push((), "abort"):
            stream._fail(RequestAbortedError(f"request {request_id} aborted"))

    async def call_utility(self, method: str, *args: Any, engine_index: int = 0) -> Any:
        """Call ``EngineCore.<method>(*args)`` on ``engine_index`` and return its result.

        :class:`UtilityCallError` with vLLM's message if the call failed there;
        :class:`EngineDeadError` if the engine goes first. Results are decoded msgpack
        (vLLM sends typed results only with ``VLLM_ALLOW_INSECURE_SERIALIZATION``)."""
        self._check_usable()
        rank = engine_index
        if not 0 <= rank < self._engine_count:
            raise ValueError(f"engine_index must be in [0, {self._engine_count}), got {rank}")
        if rank in self._table.dead:
            raise EngineDeadError(rank, "taken as dead earlier")
        self._work_for(rank)
        call_id, call = self._calls.start(rank, method)
        try:
            self._queue(rank, encode_utility(self._client_index, call_id, method, args))
            await call.done.wait()
        finally:
            self._calls.end(call_id)
        if call.error is not None:
            raise call.error
        return call.result

    async def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """The same utility call on every live rank, results in rank order."""
        live = [r for r in range(self._engine_count) if r not in self._table.dead]
        results: dict[int, Any] = {}

        async def one(rank: int) -> None:
            results[rank] = await self.call_utility(method, *args, engine_index=rank)

        try:
            async with trio.open_nursery() as nursery:
                for rank in live:
                    nursery.start_soon(one, rank)
        except BaseExceptionGroup as group:
            first = group.exceptions[0]
            if isinstance(first, EngineClientError):
                raise first from None
            raise
        return [results[r] for r in live]

    async def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's ``pause_scheduler`` on every live engine (``abort``, ``wait``, ``keep``)."""
        await self._pause("pause_scheduler", mode, clear_cache)

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM 0.33.0's ``pause_generation`` on every live engine: ``pause_scheduler``,
        and in modes ``abort`` and ``wait`` each request sent until the resume finishes
        at once with finish reason ``error`` (vLLM's retryable ``engine_paused``) instead
        of waiting in the queue. vLLM 0.32.0 has no such method (:class:`UtilityCallError`)."""
        await self._pause("pause_generation", mode, clear_cache)

    async def _pause(self, method: str, mode: str, clear_cache: bool) -> None:
        # Paused engines drop START_DP_WAVE (vLLM's two-phase pause sets
        # ignore_start_dp_wave): a first-request notice sent now would make the
        # coordinator believe a wave runs that no engine runs, and ignore the engine's own
        # start_wave after the resume as a duplicate, leaving its peers asleep. The
        # resume's barrier starts the engines that have work, and rank 0 reports it.
        self._paused_by_us = True
        try:
            await self.call_utility_all(method, mode, clear_cache)
        except BaseException:
            self._paused_by_us = False
            raise

    async def resume_scheduler(self) -> None:
        """vLLM's ``resume_scheduler`` on every live engine."""
        await self.call_utility_all("resume_scheduler")
        self._paused_by_us = False

    # --- what the streams call ------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise EngineClientClosedError("the engine client has stopped")

    def _busy_engines(self) -> set[int]:
        """Engines with requests or utility calls in flight."""
        return set(self._table.busy_engines()) | self._calls.ranks()

    def _work_for(self, rank: int) -> None:
        """Work (a request, a call) is about to be recorded and sent to ``rank``: a rank
        that had none starts its silence clock now, and wakes the watch (whose next
        deadline can only be this one's when no rank was busy)."""
        silence = self._silence
        if silence is None:
            return
        idle = not self._table.is_busy(rank) and rank not in self._calls.ranks()
        silence.sent(rank, trio.current_time(), idle)
        if idle:
            self._work_sent.set()

    def _queue(self, rank: int, frames: list[bytes]) -> None:
        try:
            self._outbox.put(self._identities[rank], frames)
        except trio.ClosedResourceError:
            raise EngineClientClosedError("the engine client has stopped") from None

    @property
    def chooser(self) -> EngineChooser:
        """The engine chooser (its routing policy, in-flight counts, prefix router)."""
        return self._chooser

    def _choose(self, prompt_token_ids: Sequence[int]) -> int:
        dead = self._table.dead
        loads: Sequence[EngineLoad] = self._coordinator.engine_loads()
        if dead or len(loads) != self._engine_count:
            if len(dead) >= self._engine_count:
                raise EngineDeadError(min(dead), "every engine is gone")
            padded = list(loads)
            padded += [EngineLoad(0, 0, 0.0)] * (self._engine_count - len(padded))
            for rank in dead:
                padded[rank] = _UNAVAILABLE
            loads = padded[: self._engine_count]
        return self._chooser.choose(loads, prompt_token_ids, now=trio.current_time())

    def _add(self, stream: RequestStream) -> None:
        self._check_usable()
        if stream._pinned is not None:
            rank = stream._pinned
            if rank in self._table.dead:
                raise EngineDeadError(rank, "taken as dead earlier")
            if not self._chooser.observe(rank, stream._prompt, now=trio.current_time()):
                self._uncounted.add(stream.request_id)
        else:
            rank = self._choose(stream._prompt)
        self._work_for(rank)
        self._table.add(stream.request_id, rank)
        stream.engine_index = rank
        self._streams[stream.request_id] = stream
        snapshot = self._coordinator.snapshot()
        self._queue(
            rank,
            encode_add(
                stream.request_id,
                stream._prompt,
                stream._params,
                arrival_time=time.time(),
                current_wave=snapshot.current_wave,
                client_index=self._client_index,
                data_parallel_rank=stream._pinned,
                priority=stream._priority,
            ),
        )
        self._requests_sent += 1
        if not snapshot.engines_running and not self._paused_by_us:
            # as DPAsyncMPClient: the request first, then the first-request notice
            self._coordinator.notify_first_request(rank)

    def _release(self, stream: RequestStream) -> None:
        """The caller left the stream: abort the request if it is still live."""
        rank = self._table.engine_index_of(stream.request_id)
        if rank is None:
            return
        self._table.finish(stream.request_id, RequestState.ABORTED)
        self._streams.pop(stream.request_id, None)
        self._chooser_finished(stream.request_id, rank)
        self._requests_aborted += 1
        if not self._closed:
            with suppress(EngineClientClosedError):
                self._queue(rank, encode_abort([stream.request_id]))
        logger.debug("request %s on rank %d aborted by its caller", stream.request_id, rank)

    # --- what the tasks call --------------------------------------------------------
    def _receive_outputs(self, rank: int, frames: list[bytes]) -> None:
        """One message of ``rank``'s output socket: each output to its request's stream
        (outputs of finished, aborted or unknown requests are dropped, as vLLM does), a
        utility answer to its call, the dead marker to :meth:`_rank_dead`."""
        if self._silence is not None:
            self._silence.heard(rank, trio.current_time())
        try:
            message = decode_client_frames(frames)
        except ProtocolError as exc:
            self._reject("engine_output", f"rank {rank}: {exc}")
            return
        if type(message) is EngineDead:
            self._rank_dead(rank, "it sent ENGINE_CORE_DEAD")
            return
        assert not isinstance(message, EngineDead)
        outputs, utility_output = message
        streams = self._streams
        aborted: list[str] | None = None
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            finish = out.finish_reason
            if finish is None:
                if stream._push(out.new_token_ids, None):
                    continue
            else:
                reason = FINISH_REASONS[finish] if finish < len(FINISH_REASONS) else str(finish)
                if stream._push(out.new_token_ids, reason):
                    self._finish(out.request_id, rank)
                    continue
            request_id = out.request_id
            stream._fail(
                RequestAbortedError(
                    f"request {request_id} aborted: its reader fell "
                    f"{stream._capacity} outputs behind"
                )
            )
            self._table.finish(request_id, RequestState.ABORTED)
            streams.pop(request_id, None)
            self._chooser_finished(request_id, rank)
            self._requests_aborted += 1
            aborted = [request_id] if aborted is None else [*aborted, request_id]
        if aborted is not None:
            self._queue(rank, encode_abort(aborted))
        if utility_output is not None:
            self._receive_utility(rank, utility_output)

    def _finish(self, request_id: str, rank: int) -> None:
        self._table.finish(request_id)
        self._streams.pop(request_id, None)
        self._chooser_finished(request_id, rank)

    def _chooser_finished(self, request_id: str, rank: int) -> None:
        """The request left ``rank``: release its count in the chooser, if it had one."""
        if request_id in self._uncounted:
            self._uncounted.discard(request_id)
        else:
            self._chooser.finished(rank)

    def _receive_utility(self, rank: int, raw: object) -> None:
        refused = self._calls.answer(rank, raw)
        if refused is not None:
            self._reject("utility_output", refused)

    def _rank_dead(self, rank: int, reason: str) -> None:
        if rank in self._table.dead:
            return
        requests, calls = self._table.mark_dead(rank)
        logger.log(
            logging.INFO if self._shutdown_expected else logging.WARNING,
            "engine rank %d is gone (%s): failing %d request(s) and %d call(s)",
            rank,
            reason,
            len(requests),
            len(calls),
        )
        for request_id in requests:
            stream = self._streams.pop(request_id, None)
            self._chooser_finished(request_id, rank)
            if stream is not None:
                stream._fail(EngineDeadError(rank, reason))
        self._calls.fail(calls, lambda call: EngineDeadError(rank, reason))

    async def _watch_silence(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Marks dead the ranks silent for ``silence_timeout`` with work in flight."""
        task_status.started()
        watch = self._silence
        if watch is None:
            return
        while True:
            now = trio.current_time()
            busy = self._busy_engines() - self._table.dead
            for rank in watch.overdue(now, busy):
                self._rank_dead(rank, f"silent for {watch.timeout:g} s with work in flight")
            busy = self._busy_engines() - self._table.dead
            self._work_sent = trio.Event()
            with trio.move_on_at(watch.next_check(now, busy) + 0.01):
                await self._work_sent.wait()

    def _close(self) -> None:
        """The client stops: fail whatever is still in flight, refuse further use."""
        self._closed = True
        for request_id in self._table.in_flight():
            self._table.finish(request_id, RequestState.ABORTED)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream._fail(RequestAbortedError(f"request {request_id}: the client closed"))
        self._calls.fail_all(
            lambda call: EngineClientClosedError(f"{call.method}: the client closed")
        )
        self._outbox.close()
