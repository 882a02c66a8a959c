"""The coordinator service: the sans-IO core wired to ZeroMQ by a handful of trio pumps.

One nursery runs::

    handle.choose / notify_first_request (claim and apply, in the caller's task) ───┐
    front XPUB ─► command receiver (front-ends' subscriptions, FIRST_REQ, SCALE) ────┤
    engine PUSH ─► PULL ─► engine-output listener (batch receive) ──────────────────┤
    back XPUB subscriptions ─► subscription watcher ────────────────────────────────┤
    core.next_deadline() ─► timer (timed publishes, wake deadlines) ─► core.tick() ─┤
    socket monitors (peers connected, lost) ─► peer watchers ───────────────────────┤
                 every pump: core.<input>(..., now) under the lock, effects dispatched
                                         in the same critical section
          [memory channel] ─► broadcaster ─┬► back XPUB ─► engines  (READY, START_DP_WAVE)
                                           └► front XPUB ─► front-ends (publishes)

Every rule lives in :class:`~trio_dpcoord.core.CoordinatorCore`; the pumps only move
bytes. Data flows one way and every socket has exactly one sending task (the
broadcaster sends on both XPUBs: what one wave decides, START_DP_WAVE then the publish
of the new state, leaves in one scheduler pass, engines first). The core is
called under a plain :class:`threading.Lock`, never held across an ``await``, and its
effects are enqueued in the same critical section, so broadcasts and publishes leave in
the order they were decided, and other threads may read the snapshot. The one timer
waits for the core's next deadline; an input that moves it earlier moves the wait.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import final

import trio

from .._errors import CoordinatorClosedError, CoordinatorError, ReadyTimeoutError
from ..core._coordinator import (
    CoordinatorCore,
    CoordinatorStatistics,
    SubscriptionView,
)
from ..core._recovery import Recovery
from ..core._wave import WaveSnapshot
from ..protocol import EngineLoad
from ..routing._chooser import EngineChooser, Routing
from ..routing._settings import PrefixRouting
from .coordinator_sockets import Bound, curve_server, open_bound_sockets, requested_sockets
from .endpoints import DEFAULT_LIVENESS, Liveness
from .pumps import Pumps
from .supervision import RestartStatistics, WaveFile, restart_pumps, supervise
from .tasks import open_task_nursery
from .view import Route

__all__ = ["Coordinator", "open_coordinator"]

logger = logging.getLogger(__name__)


@final
class Coordinator:
    """The handle :func:`open_coordinator` yields: what an embedding front-end uses.

    Built complete by :func:`open_coordinator` once every socket is bound. Every method is
    synchronous and cheap, safe from any trio task; :meth:`snapshot`,
    :meth:`engine_loads`, :meth:`subscriptions`, :meth:`statistics` and
    :attr:`engine_count` may also be called from other threads (:meth:`choose`,
    :meth:`observe` and :meth:`finished` only from trio tasks). Properties are fixed
    settings; methods read what changes (docs/api.md's rule).
    """

    def __init__(
        self,
        pumps: Pumps,
        addresses: dict[str, str | None],
        chooser: EngineChooser,
        curve_public_key: bytes | None,
        *,
        ready_timeout: float | None,
    ) -> None:
        """``addresses``: the bound address of each socket, by its key in the counters."""
        self._pumps = pumps
        self._chooser = chooser
        self._lock = pumps.lock
        self._back_publish_address = addresses["back_publish"] or ""
        self._back_output_address = addresses["back_output"] or ""
        self._front_address = addresses["front"]
        self._curve_public_key = curve_public_key
        self._ready_timeout = ready_timeout
        self._ready_deadline = (
            math.inf if ready_timeout is None else trio.current_time() + ready_timeout
        )

    @property
    def back_publish_address(self) -> str:
        """Where engines connect their XSUB (vLLM's back-pub; READY and START_DP_WAVE)."""
        return self._back_publish_address

    @property
    def back_output_address(self) -> str:
        """Where engines connect their PUSH (vLLM's back-out; stats and wave reports)."""
        return self._back_output_address

    @property
    def front_address(self) -> str | None:
        """Where front-ends connect their XSUB (vLLM's front publish socket), if bound."""
        return self._front_address

    @property
    def curve_public_key(self) -> bytes | None:
        """The CURVE server key peers need, when ``curve_secret_key`` was given."""
        return self._curve_public_key

    @property
    def ready_timeout(self) -> float | None:
        return self._ready_timeout

    @property
    def wave_coordination(self) -> bool:
        """Whether waves are coordinated (fixed at start, as in vLLM)."""
        return self._pumps.core.wave_coordination

    @property
    def wake_confirm_timeout(self) -> float:
        return self._pumps.core.wake_confirm_timeout

    @property
    def engine_count(self) -> int:
        """How many engines the load table holds (changes only with SCALE_ELASTIC_EP)."""
        with self._lock:
            return self._pumps.core.engine_count()

    @property
    def chooser(self) -> EngineChooser:
        """The engine chooser :meth:`choose` asks (its policy, :meth:`~EngineChooser.statistics`
        and, with ``routing="prefix"``, ``receive_kv_events`` for the exact feed)."""
        return self._chooser

    def snapshot(self) -> WaveSnapshot:
        """The wave to stamp on a new request, and whether the engines run."""
        with self._lock:
            return self._pumps.core.snapshot()

    def engine_loads(self) -> tuple[EngineLoad, ...]:
        """Every engine's latest :class:`EngineLoad`, in rank order."""
        with self._lock:
            return self._pumps.core.engine_loads()

    def notify_first_request(self, engine_index: int) -> None:
        """A request is being routed to ``engine_index``: wake the engines if they sleep.

        Synchronous and non-blocking; call it from a trio task. If the snapshot says
        paused, it flips to running at once and the first-request notice is applied in
        the same critical section (vLLM PR #46833's rule), its START_DP_WAVE handed to the
        broadcaster's channel. If the engines already run
        (or a wake-up is already claimed) nothing happens, so concurrent callers coalesce
        behind one broadcast. ``TypeError`` for a non-int, ``ValueError`` for an index
        outside the table, :class:`CoordinatorClosedError` once stopped.
        """
        self._pumps.notify_first_request(engine_index)

    def choose(self, prompt_token_ids: Sequence[int] | None = None) -> Route:
        """Route one new request: the rank :attr:`chooser` picks from the live loads
        (``prompt_token_ids`` serve ``routing="prefix"``), the wave to stamp on it, and
        the wake of paused engines (:meth:`notify_first_request`), in one call, in that
        order and with no checkpoint between. The request counts in flight on that rank
        until :meth:`finished`. :class:`CoordinatorClosedError` once stopped."""
        if self._pumps.closed:
            raise CoordinatorClosedError("the coordinator has stopped")
        loads = self.engine_loads()
        rank = self._chooser.choose(loads, prompt_token_ids, now=trio.current_time())
        return Route(rank, self._pumps.notify_first_request(rank))

    def observe(self, engine_index: int, prompt_token_ids: Sequence[int]) -> bool:
        """A request went to ``engine_index`` without :meth:`choose` (pinned; its wave and
        wake: :meth:`snapshot`, :meth:`notify_first_request`): the prefix policy learns it
        (no-op with vLLM's). True if it now counts in flight (then :meth:`finished`)."""
        return self._chooser.observe(engine_index, prompt_token_ids, now=trio.current_time())

    def finished(self, engine_index: int) -> None:
        """A request :meth:`choose` sent to ``engine_index`` (or :meth:`observe` counted
        there) finished (vLLM's ``finished_requests``): its in-flight count is released."""
        self._chooser.finished(engine_index)

    def subscriptions(self) -> SubscriptionView:
        """The engines' subscriptions as seen on the broadcast socket."""
        with self._lock:
            return self._pumps.core.subscriptions()

    def silent_engines(self) -> list[int]:
        """Ranks that never sent anything on the engine output socket (subscriptions carry
        no identity, so this is how a stuck start-up gate names who is missing)."""
        with self._lock:
            return self._pumps.core.silent_engines()

    def expect_shutdown(self) -> None:
        """The engines are being stopped on purpose (call it just before stopping them):
        from now on an engine leaving, its lost connections and its unsubscription, is
        logged at INFO instead of WARNING (still counted, still summed up in a burst), so
        that a normal shutdown does not read like an outage."""
        with self._lock:
            self._pumps.core.expect_shutdown()
            for monitor in self._pumps.monitors:
                monitor.shutdown_expected = True

    def statistics(self) -> CoordinatorStatistics:
        """What was received, decided, sent and rejected since the start: a frozen copy."""
        with self._lock:
            return self._pumps.core.counters()

    async def wait_ready(self) -> None:
        """Return once READY has been broadcast (every expected engine subscribed).

        Raises :class:`ReadyTimeoutError` if that did not happen within
        ``ready_timeout`` seconds of the coordinator's start.
        """
        with trio.move_on_at(self._ready_deadline):
            await self._pumps.ready.wait()
            return
        view = self.subscriptions()
        expected = self._pumps.core.expected_engines
        raise ReadyTimeoutError(
            f"start-up gate still closed after {self._ready_timeout} s: "
            f"{view.current} of {expected} engines subscribed to "
            f"{self._back_publish_address} ({expected - view.current} missing); "
            f"ranks never heard from on {self._back_output_address}: {self.silent_engines()}"
        )

    async def wait_for(self, predicate: Callable[[Coordinator], bool]) -> None:
        """Wait until ``predicate(self)`` holds; re-checked after every observable change
        (wave transitions, subscriptions, applied stats, rejected inputs, sends). Combine
        with ``trio.fail_after`` to bound the wait."""
        while not predicate(self):
            await self._pumps.observe()

    def restarts(self) -> RestartStatistics:
        """Restarts in place after failures of our own, and what they cost (§16)."""
        with self._lock:
            return self._pumps.restart_log.counters()


def _take_over(pumps: Pumps, wave_file: WaveFile) -> None:
    """Keep the wave in ``wave_file`` and, if a process that ran on it died, start as its
    successor: the engines connect and subscribe again, the wave starts at its wave."""
    pumps.wave_file = wave_file
    pumps.restart_log.process_restarts = wave_file.starts - 1
    if wave_file.previous_wave is not None:
        pumps.core.restarted(Recovery(wave=wave_file.previous_wave), trio.current_time())
        logger.info(
            "taking over from a coordinator process that died at wave %d (%s; process %d): "
            "recovering as the engines come back",
            wave_file.previous_wave,
            wave_file.path,
            wave_file.starts,
        )


@asynccontextmanager
async def _running_pumps(
    pumps: Pumps, bound: Bound, new_core: Callable[[], CoordinatorCore] | None
) -> AsyncIterator[None]:
    """Every pump running on the bound sockets for the block; their failure comes out as
    one :class:`CoordinatorError` (with ``new_core``: past the restart budget only)."""
    async with open_task_nursery(
        on_exit=pumps.close,
        failure=lambda group: CoordinatorError(f"coordinator task failed: {group!r}"),
    ) as nursery:
        if new_core is None:
            await _start_pumps(nursery, pumps, bound)
        else:
            await nursery.start(
                supervise,
                lambda pumps_nursery: _start_pumps(pumps_nursery, pumps, bound),
                lambda: restart_pumps(pumps, new_core()),
                pumps.restart_log,
                lambda: pumps.closed,
                pumps.changed,
            )
        logger.info(
            "coordinator for %d engines: broadcast %s, outputs %s, front %s",
            pumps.core.expected_engines,
            *bound.addresses.values(),
        )
        yield


async def _start_pumps(nursery: trio.Nursery, pumps: Pumps, bound: Bound) -> None:
    await nursery.start(pumps.broadcaster, bound.back_publish, bound.front)
    await nursery.start(pumps.timer)
    await nursery.start(pumps.subscription_watcher, bound.back_publish)
    await nursery.start(pumps.engine_output_listener, bound.back_output)
    for monitor in pumps.monitors:
        await nursery.start(pumps.peer_watcher, monitor)
    if bound.front is not None:
        await nursery.start(pumps.command_receiver, bound.front)


@asynccontextmanager
async def open_coordinator(
    engine_count: int,
    *,
    back_publish_address: str | None = None,
    back_output_address: str | None = None,
    front_address: str | None = None,
    ready_timeout: float | None = 60.0,
    wave_coordination: bool = True,
    stats_interval: float = 0.1,
    allow_remote: bool = False,
    wake_confirm_timeout: float = 30.0,
    curve_secret_key: bytes | None = None,
    liveness: Liveness = DEFAULT_LIVENESS,
    routing: Routing = "vllm",
    prefix_routing: PrefixRouting | None = None,
    restart: bool = True,
    max_restarts: int = 5,
    wave_file: str | None = None,
) -> AsyncIterator[Coordinator]:
    """Run a DP wave coordinator for ``engine_count`` engines for the duration of the block.

    Binds the engine broadcast socket (XPUB, vLLM's back-pub: ``back_publish_address``),
    the engine output socket (PULL, back-out: ``back_output_address``) and, with
    ``front_address``, vLLM's front publish socket (XPUB) as the standalone process does.
    None (or ``""``; for the front socket only ``""``) means an ``ipc://`` path in a
    private directory removed on exit; ``tcp://127.0.0.1:0`` is resolved to its port.
    Yields the :class:`Coordinator` once every socket is bound and every task runs;
    engines get READY when ``engine_count`` of them have subscribed. Leaving the block
    stops every task and closes every socket; a failure inside the service raises
    :class:`CoordinatorError` (the original exceptions as its cause), an exception from
    the block itself propagates unchanged.

    ``wake_confirm_timeout``: a first-request start no engine confirms within it (rank 0
    reports every start it joins) was dropped by paused engines, so ``engines_running``
    goes back to False instead of staying latched. ``curve_secret_key`` (Z85; off by
    default, vLLM's engines cannot use it): every socket a CURVE server, encrypted, only
    peers that know :attr:`Coordinator.curve_public_key` connect. ``liveness``: ZMTP
    heartbeats and TCP keepalive, so a silent peer (a partition, a dead node) is dropped
    within about ``liveness.notice_within`` seconds, counted in ``connections_lost``,
    logged, and given READY again when it comes back and subscribes. ``routing`` and
    ``prefix_routing``: the policy of :meth:`Coordinator.choose` (see :class:`EngineChooser`).

    ``restart``: a failure inside (a broken invariant of ours) restarts the service in
    place, a new core on the same sockets (§16; :meth:`Coordinator.restarts`); more than
    ``max_restarts`` within a minute raise :class:`CoordinatorError` (at once: ``False``).
    ``wave_file``: keep the wave in this file; if it holds one, a process that ran on it
    died: start as its successor, with that wave (``serve --supervised`` does this; a
    file left by another fleet would hand its wave to engines that started at 0).
    """

    def new_core() -> CoordinatorCore:
        return CoordinatorCore(
            engine_count,
            wave_coordination=wave_coordination,
            stats_interval=stats_interval,
            wake_confirm_timeout=wake_confirm_timeout,
            publish_to_front_ends=front_address is not None,
        )

    chooser = EngineChooser(engine_count, routing=routing, prefix_routing=prefix_routing)
    curve_public_key, curve_options = curve_server(curve_secret_key)
    pumps = Pumps(new_core(), max_restarts)
    requested = requested_sockets(back_publish_address, back_output_address, front_address)
    async with AsyncExitStack() as stack:
        if wave_file is not None:
            kept = WaveFile(wave_file)
            stack.callback(kept.close)
            _take_over(pumps, kept)
        bound = await stack.enter_async_context(
            open_bound_sockets(pumps.monitors, requested, curve_options, liveness, allow_remote)
        )
        handle = Coordinator(
            pumps, bound.addresses, chooser, curve_public_key, ready_timeout=ready_timeout
        )
        async with _running_pumps(pumps, bound, new_core if restart else None):
            yield handle
