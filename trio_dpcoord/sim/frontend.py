"""A simulated trio front-end for the simulated engines (its load: :mod:`.load`).

The front-end does what vLLM's DP client does (docs/protocol.md §7.1-§7.2): it stamps each
request with the coordinator's current wave, chooses the engine with the shared
:class:`~trio_dpcoord.EngineChooser`, and sends ``ADD`` over a ROUTER to the engine's
DEALER (identity = rank). With the ``frontend`` or ``both`` wake path it also calls
``notify_first_request`` when the snapshot says the engines are paused, like pre-0.33
front-ends (§7.4). It works with anything shaped like a :class:`CoordinatorView`: the embedded
:class:`~trio_dpcoord.Coordinator` or a front-end of the standalone process.

It also measures, honestly, what a user of the coordinator cares about:

* **wake latency**: from sending a request while every engine's last status event said
  "idle" (the cluster is asleep) until the last engine's "running" event (sent when it
  takes the first step of a wave) has arrived here. Arrival times at the front-end are
  used, so the figure includes the status message's own delivery (a slight
  over-estimate, never an under-estimate of the engines' wake-up);
* **wave monotonicity**: the wave in the coordinator's snapshot, and the wave in every
  engine's status events, must never decrease; a decrease is counted in
  ``wave_regressions``. A coordinator that was restarted has forgotten its wave and
  starts again from the engines' reports: a lower wave first seen after the front-end
  reconnected is counted in ``wave_resets`` instead.

When an engine process vanishes and is restarted (:meth:`SimFrontend.engine_lost`), the
requests that were in flight on it are resubmitted once it is back
(:meth:`SimFrontend.resubmit_lost`), and new requests and commands wait for it: a wave
started without it would block its peers in the collective.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import trio
import zmq

from .. import (
    CoordinatorView,
    EngineChooser,
    Frontend,
    PrefixRouting,
    Routing,
    protocol,
)
from ..protocol import IDLE_LOAD, EngineLoad, decode_kv_event_frames, engine_identity
from ..trio_zmq import AsyncSocket
from . import messages
from .frontend_sockets import open_frontend_sockets
from .timeline import Timeline

__all__ = [
    "SimFrontend",
    "TokenListener",
    "WakePath",
    "open_sim_frontend",
]

logger = logging.getLogger(__name__)

WakePath = Literal["engine", "frontend", "both"]
WAKE_PATHS: tuple[WakePath, ...] = ("engine", "frontend", "both")

_DEFAULT_PROMPT = (1, 2, 3, 4)

TokenListener = Callable[[tuple[int, ...], "int | None"], None]
"""Called with each output of one request: its new token ids and its finish reason
(``None`` while running; vLLM's codes otherwise: 1 length, 2 abort, ...)."""


@dataclass(slots=True)
class _WakeMeasurement:
    started: float
    waiting_for: set[int]


@dataclass(slots=True)
class _Call:
    event: str
    replied: set[int] = field(default_factory=set)


class SimFrontend:
    """One simulated front-end (client 0 of 1); created by :func:`open_sim_frontend`."""

    def __init__(
        self,
        view: CoordinatorView,
        engine_count: int,
        *,
        wake_path: WakePath,
        router: AsyncSocket,
        request_address: str,
        completion_address: str,
        routing: Routing = "vllm",
        prefix: PrefixRouting | None = None,
        kv_event_addresses: Sequence[str] = (),
    ) -> None:
        if wake_path not in WAKE_PATHS:
            raise ValueError(f"wake_path must be one of {WAKE_PATHS}, got {wake_path!r}")
        self.view = view
        self.engine_count = engine_count
        self.wake_path: WakePath = wake_path
        self.request_address = request_address
        self.completion_address = completion_address
        self.chooser = EngineChooser(engine_count, routing=routing, prefix_routing=prefix)
        self.kv_event_addresses = tuple(kv_event_addresses)
        """Per rank, where its engine publishes KV events (empty: no KV events)."""
        self.kv_event_batches = 0
        """KV-event batches received and fed to the engine chooser."""
        self.prefix_requests = [0] * engine_count
        """Per engine, the requests it looked up in its prefix cache, as its scheduler
        stats report them (vLLM's ``prefix_cache_stats``, summed over its reports)."""
        self.prefix_queries = [0] * engine_count
        """Per engine, the prompt tokens it looked up (``queries``)."""
        self.prefix_hits = [0] * engine_count
        """Per engine, the prompt tokens it found cached (``hits``)."""
        self.engine_tokens = [0] * engine_count
        """Per engine, the output tokens it sent."""
        self._router = router
        self._observers = trio.lowlevel.ParkingLot()
        self._next_request = 0
        self._next_call = 1
        self._pending: dict[str, int] = {}
        self._uncounted: set[str] = set()
        """Pinned requests the chooser does not count in flight (vLLM's routing)."""
        self._max_tokens: dict[str, int | None] = {}
        self._prompts: dict[str, tuple[int, ...]] = {}
        self._lost: set[int] = set()
        self._orphans: list[str] = []
        self._calls: dict[int, _Call] = {}
        self._wake: _WakeMeasurement | None = None
        self._listeners: dict[str, TokenListener] = {}
        self.timeline: Timeline | None = None
        """Set it to record engine states, wake-ups and requests in flight over time."""
        self.engine_ready = [False] * engine_count
        self.engine_running = [False] * engine_count
        self.engine_wave = [0] * engine_count
        self.front_wave = 0
        self.sent = 0
        self.completed = 0
        self.tokens = 0
        self.notifications = 0
        self.pauses = 0
        self.wave_regressions = 0
        self.wave_resets = 0
        """The coordinator's wave lower after the front-end reconnected to it: a
        restarted coordinator starts from what the engines report (not an error)."""
        self._raised_in = 0
        """The view's ``disconnects`` when the front-end's wave last went up."""
        self.bad_messages = 0
        self.resubmitted = 0
        """Requests sent again because the engine they were on vanished."""
        self.waves_completed: set[int] = set()
        self.wake_latencies: list[float] = []

    # --- observing -------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Requests sent and not yet finished (those waiting to be resubmitted included)."""
        return len(self._pending) + len(self._orphans)

    @property
    def lost_engines(self) -> frozenset[int]:
        """Ranks whose process vanished and that have not said hello again yet."""
        return frozenset(self._lost)

    def per_engine_pending(self) -> tuple[int, ...]:
        counts = [0] * self.engine_count
        for engine in self._pending.values():
            counts[engine] += 1
        return tuple(counts)

    async def wait_for(self, predicate: Callable[[SimFrontend], bool]) -> None:
        """Wait until ``predicate(self)`` holds; re-checked after every received message."""
        while not predicate(self):
            await self._observers.park()

    def _changed(self) -> None:
        self._observers.unpark_all()

    def _observe_front_wave(self, wave: int) -> None:
        view = self.view  # a remote coordinator's view counts its connection drops
        connection = view.statistics().disconnects if isinstance(view, Frontend) else 0
        if wave < self.front_wave and connection != self._raised_in:
            self.wave_resets += 1
            logger.warning(
                "front-end: the coordinator is at wave %d after a reconnection (was %d): "
                "a restarted coordinator starts from the engines' reports",
                wave,
                self.front_wave,
            )
            self.front_wave = wave
            self._raised_in = connection
            return
        if wave > self.front_wave:
            self._raised_in = connection
        if wave < self.front_wave:
            self.wave_regressions += 1
            logger.error(
                "front-end saw the coordinator's wave go back: %d -> %d", self.front_wave, wave
            )
        self.front_wave = max(self.front_wave, wave)

    def check_front_wave(self) -> None:
        """Sample the coordinator's wave (the progress display calls this regularly)."""
        self._observe_front_wave(self.view.snapshot().current_wave)

    # --- requests and commands -------------------------------------------------------

    def _loads(self) -> Sequence[EngineLoad]:
        loads = self.view.engine_loads()
        if len(loads) != self.engine_count:  # no report yet from a remote coordinator
            return (IDLE_LOAD,) * self.engine_count
        return loads

    async def submit(
        self,
        max_tokens: int | None = None,
        *,
        engine: int | None = None,
        on_output: TokenListener | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> str:
        """Stamp, route and send one request; returns its id.

        ``engine`` pins the request to one engine (vLLM's explicit ``data_parallel_rank``
        bypass, §7.2); by default the shared engine chooser picks it (with the prefix
        policy, by ``prompt_token_ids``: sent as the request's prompt, a fixed 4-token
        one when not given).
        ``on_output`` receives the request's tokens as the engine's outputs arrive, up to
        and including the one that finishes it.
        """
        if engine is not None and not 0 <= engine < self.engine_count:
            raise ValueError(f"engine {engine} out of range for {self.engine_count} engines")
        await self._wait_engines_back()
        request_id = f"req-{self._next_request}"
        self._next_request += 1
        self.sent += 1
        self._max_tokens[request_id] = max_tokens
        self._prompts[request_id] = (
            _DEFAULT_PROMPT if prompt_token_ids is None else tuple(prompt_token_ids)
        )
        if on_output is not None:
            self._listeners[request_id] = on_output
        await self._send_request(request_id, engine)
        return request_id

    async def abort(self, request_id: str) -> None:
        """Ask the engine holding ``request_id`` to drop it (vLLM's ABORT); the engine then
        finishes it with reason 2 (abort). No-op for a request that is not in flight."""
        engine = self._pending.get(request_id)
        if engine is None:
            return
        with contextlib.suppress(zmq.ZMQError):  # its engine is gone: nothing to abort
            await self._router.send_multipart(
                [engine_identity(engine), *protocol.encode_abort([request_id])]
            )

    async def _send_request(self, request_id: str, engine: int | None) -> None:
        """Stamp with the coordinator's wave, choose the engine unless given, send ADD."""
        snapshot = self.view.snapshot()
        self._observe_front_wave(snapshot.current_wave)
        prompt = self._prompts[request_id]
        self._uncounted.discard(request_id)  # a resubmission is counted afresh
        if engine is None:
            engine = self.chooser.choose(self._loads(), prompt, now=trio.current_time())
        else:
            if not self.chooser.observe(engine, prompt, now=trio.current_time()):
                self._uncounted.add(request_id)
        if self._wake is None and not any(self.engine_running):
            self._wake = _WakeMeasurement(trio.current_time(), set(range(self.engine_count)))
        request = protocol.EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            arrival_time=time.time(),
            current_wave=snapshot.current_wave,
            max_tokens=self._max_tokens[request_id],
        )
        self._pending[request_id] = engine
        self._record_in_flight()
        try:
            await self._router.send_multipart(
                [engine_identity(engine), *protocol.encode_add_request(request)]
            )
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # The engine's connection is gone (its process died): the request stays on it
            # and is resubmitted when the runner reports the engine lost.
            logger.warning(
                "front-end: engine %d unreachable at wave %d; request %s waits for resubmission",
                engine,
                snapshot.current_wave,
                request_id,
            )
            if engine in self._lost:
                del self._pending[request_id]
                self._orphans.append(request_id)
            return
        if self.wake_path != "engine" and not snapshot.engines_running:
            self.notifications += 1
            if self.timeline is not None:
                self.timeline.notifications.append(trio.current_time())
            self.view.notify_first_request(engine)

    def _chooser_finished(self, request_id: str, engine: int) -> None:
        """The request left ``engine``: release its count in the chooser, if it had one."""
        if request_id in self._uncounted:
            self._uncounted.discard(request_id)
        else:
            self.chooser.finished(engine)

    def _record_in_flight(self) -> None:
        if self.timeline is not None:
            self.timeline.in_flight.append((trio.current_time(), self.pending))

    async def _wait_engines_back(self) -> None:
        if self._lost:
            await self.wait_for(lambda f: not f._lost)

    def engine_lost(self, rank: int) -> int:
        """The process of engine ``rank`` vanished and is being restarted.

        Its in-flight requests are set aside for :meth:`resubmit_lost`; new requests and
        commands wait until the rank said hello again. Returns how many were set aside.
        """
        self._lost.add(rank)
        self.engine_ready[rank] = False
        self.engine_running[rank] = False
        stranded = [r for r, engine in self._pending.items() if engine == rank]
        for request_id in stranded:
            del self._pending[request_id]
            self._chooser_finished(request_id, rank)
        self._orphans.extend(stranded)
        logger.warning(
            "front-end: engine %d lost at wave %d; %d in-flight requests will be resubmitted",
            rank,
            self.engine_wave[rank],
            len(stranded),
        )
        self._changed()
        return len(stranded)

    async def resubmit_lost(self) -> None:
        """Once every lost engine is back, send its stranded requests again (normal
        engine choice, fresh wave stamp)."""
        await self._wait_engines_back()
        orphans, self._orphans = self._orphans, []
        for request_id in orphans:
            self.resubmitted += 1
            await self._send_request(request_id, None)
        if orphans:
            logger.warning(
                "front-end: resubmitted %d requests at wave %d",
                len(orphans),
                self.view.snapshot().current_wave,
            )

    async def _command(self, method: str, event: str, engines: Sequence[int] | None) -> None:
        targets = list(range(self.engine_count) if engines is None else engines)
        await self._wait_engines_back()
        call_id = self._next_call
        self._next_call += 1
        call = self._calls[call_id] = _Call(event)
        try:
            for engine in targets:
                await self._router.send_multipart(
                    [engine_identity(engine), *protocol.encode_utility(0, call_id, method, ())]
                )
            await self.wait_for(lambda _: call.replied >= set(targets))
        finally:
            del self._calls[call_id]

    async def pause_engines(self) -> None:
        """Two-phase pause of every engine (§6.8); returns once all agreed and stopped.

        Pause every engine: a rank with a pending pause keeps stepping until all ranks
        agree at a sync point.
        """
        self.pauses += 1
        await self._command(messages.PAUSE_SCHEDULER, messages.EVENT_PAUSED, None)

    async def resume_engines(self, engines: Sequence[int] | None = None) -> None:
        """Resume ``engines`` (default: all); returns once they acknowledged.

        A resumed engine that kept requests during the pause wakes the group at once
        (``start_wave``), and a rank that is still paused drops the coordinator's
        broadcast: resume the engines without kept requests first.
        """
        await self._command(messages.RESUME_SCHEDULER, messages.EVENT_RESUMED, engines)

    # --- receivers -------------------------------------------------------------------

    async def _hello_receiver(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            frames = await self._router.recv_multipart()
            rank = messages.decode_hello(frames[-1]) if len(frames) == 2 else None
            if rank is None or rank >= self.engine_count or frames[0] != engine_identity(rank):
                self.bad_messages += 1
                logger.warning(
                    "front-end: unexpected message on the request socket: %r", frames[:2]
                )
                continue
            self.engine_ready[rank] = True
            self._lost.discard(rank)
            self._changed()

    async def _completion_receiver(
        self, pull: AsyncSocket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            for frame in await pull.recv_batch():
                try:
                    out = protocol.decode_engine_core_outputs(frame)
                except protocol.ProtocolError as exc:
                    self.bad_messages += 1
                    logger.warning("front-end: undecodable engine output: %s", exc)
                    continue
                self._apply_output(out)
            self._changed()

    def _apply_output(self, out: protocol.EngineCoreOutputs) -> None:
        rank = out.engine_index
        if rank >= self.engine_count:
            self.bad_messages += 1
            logger.warning("front-end: output from unknown engine %d", rank)
            return
        status = messages.parse_status(out)
        if status is not None:
            self._apply_status(status)
            return
        stats = out.scheduler_stats
        if stats is not None:
            prefix = stats.prefix_cache_stats
            self.prefix_requests[rank] += prefix.requests
            self.prefix_queries[rank] += prefix.queries
            self.prefix_hits[rank] += prefix.hits
        tokens = sum(len(o.new_token_ids) for o in out.outputs)
        self.tokens += tokens
        self.engine_tokens[rank] += tokens
        if self._listeners:
            for output in out.outputs:
                listener = self._listeners.get(output.request_id)
                if listener is not None:
                    if output.finish_reason is not None:
                        del self._listeners[output.request_id]
                    listener(output.new_token_ids, output.finish_reason)
        for request_id in out.finished_requests or ():
            engine = self._pending.pop(request_id, None)
            if engine is None and request_id in self._orphans:
                # Finished by the vanished process after all (its last output arrived
                # after the loss was reported): nothing to resubmit.
                self._orphans.remove(request_id)
                self._max_tokens.pop(request_id, None)
                self._prompts.pop(request_id, None)
                self.completed += 1
                continue
            if engine is None:
                self.bad_messages += 1
                logger.warning("front-end: engine %d finished unknown request %r", rank, request_id)
                continue
            self._chooser_finished(request_id, engine)
            self._max_tokens.pop(request_id, None)
            self._prompts.pop(request_id, None)
            self.completed += 1
        if out.finished_requests:
            self._record_in_flight()

    async def _kv_event_receiver(
        self,
        rank: int,
        sub: AsyncSocket,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Feed engine ``rank``'s KV-event batches to the chooser (the exact feed)."""
        task_status.started()
        while True:
            frames = await sub.recv_multipart()
            try:
                seq, payload = decode_kv_event_frames(frames)
            except ValueError as exc:
                self.bad_messages += 1
                logger.warning("front-end: bad KV-event message from engine %d: %s", rank, exc)
                continue
            self.kv_event_batches += 1
            self.chooser.receive_kv_events(rank, seq, payload, now=trio.current_time())

    def _apply_status(self, status: messages.EngineStatus) -> None:
        rank = status.engine_index
        if self.timeline is not None:
            self.timeline.engine_events.append(
                (trio.current_time(), rank, status.event, status.wave)
            )
        if status.wave < self.engine_wave[rank]:
            self.wave_regressions += 1
            logger.error(
                "engine %d reported wave %d after wave %d (%s)",
                rank,
                status.wave,
                self.engine_wave[rank],
                status.event,
            )
        self.engine_wave[rank] = max(self.engine_wave[rank], status.wave)
        if status.event == messages.EVENT_RUNNING:
            self.engine_running[rank] = True
            wake = self._wake
            if wake is not None:
                wake.waiting_for.discard(rank)
                if not wake.waiting_for:
                    self.wake_latencies.append(trio.current_time() - wake.started)
                    if self.timeline is not None:
                        self.timeline.wakes.append((wake.started, trio.current_time()))
                    self._wake = None
        elif status.event == messages.EVENT_IDLE:
            self.engine_running[rank] = False
            self.waves_completed.add(status.wave)
        call = self._calls.get(status.call_id)
        if call is not None and call.event == status.event:
            call.replied.add(rank)


@asynccontextmanager
async def open_sim_frontend(
    view: CoordinatorView,
    engine_count: int,
    *,
    wake_path: WakePath = "both",
    request_address: str | None = None,
    completion_address: str | None = None,
    routing: Routing = "vllm",
    prefix: PrefixRouting | None = None,
    kv_events: bool = False,
) -> AsyncIterator[SimFrontend]:
    """Bind the request ROUTER and completion PULL, start the receivers, yield the front-end.

    ``routing`` and ``prefix`` are the engine chooser's policy and prefix settings
    (:class:`~trio_dpcoord.EngineChooser`). ``kv_events``: subscribe to every engine's
    KV events, at :attr:`SimFrontend.kv_event_addresses` (private ``ipc://`` paths the
    engines bind, as vLLM's publisher binds ipc endpoints), and feed them to the chooser.

    Addresses default to ``ipc://`` paths in a private temporary directory, removed on
    exit (the sockets: :mod:`.frontend_sockets`). Engines connect to
    :attr:`SimFrontend.request_address` and :attr:`SimFrontend.completion_address`.
    """
    async with open_frontend_sockets(
        engine_count, request_address, completion_address, kv_events=kv_events
    ) as sockets:
        frontend = SimFrontend(
            view,
            engine_count,
            wake_path=wake_path,
            router=sockets.router,
            request_address=sockets.request_address,
            completion_address=sockets.completion_address,
            routing=routing,
            prefix=prefix,
            kv_event_addresses=sockets.kv_event_addresses,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(frontend._hello_receiver)
            await nursery.start(frontend._completion_receiver, sockets.completions)
            for rank, sub in enumerate(sockets.kv_events):
                await nursery.start(frontend._kv_event_receiver, rank, sub)
            try:
                yield frontend
            finally:
                nursery.cancel_scope.cancel()
