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
import sys

import trio

from .. import ConnectionMonitor, protocol
from ..trio_zmq import AsyncSocket
from . import messages
from .collective import CollectiveClient, CollectiveHost, CollectiveTimeoutError
from .engine_config import EngineConfig
from .engine_errors import CoordinatorLostError, EngineProtocolError
from .engine_loop import Announce, EngineLoop
from .engine_sockets import open_engine_sockets
from .engine_state import AbortInput

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["SimEngine", "run_engine", "run_sim_engine"]

logger = logging.getLogger(__name__)


class SimEngine(EngineLoop):
    """One DP rank: the state machine and busy loop of :class:`~.engine_loop.EngineLoop`;
    :meth:`run` opens its sockets (:mod:`.engine_sockets`) and runs it."""

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
            logger.warning(
                "rank %d: dropping a bad front-end message at wave %d: %s",
                self.rank,
                self.current_wave,
                exc,
            )

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
                self._input_send.send_nowait(Announce())

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
