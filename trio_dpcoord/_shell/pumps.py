"""The coordinator service's pumps: the trio tasks that wire the sans-IO core to its
sockets (the picture and the rules they keep: ``coordinator.py``).

:class:`Pumps` holds the core, the lock it is called under, the channel to the
broadcaster and what the handle waits on; each of its task methods reads one socket (or
the clock), calls the core under the lock and dispatches the effects in the same
critical section. :class:`~.coordinator.Coordinator` is the handle over it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias

import trio

from .._errors import CoordinatorClosedError
from .._reject_log import RejectLog
from ..core._coordinator import (
    Broadcast,
    CoordinatorCore,
    Effect,
    Publish,
    Reject,
)
from ..trio_zmq import AsyncSocket
from .monitor import PeerMonitor
from .supervision import RestartLog, WaveFile

__all__ = ["Outgoing", "Pumps"]

logger = logging.getLogger(__name__)

_LISTENER_BATCH: Final = 64
"""Engine outputs taken per receive. A wave start that arrives while a batch is applied
waits for all of it: with 1,000 per batch, wake-ups under stats load (N = 8, 52,000
reports/s, next to vLLM's coordinator under the same load) took 23 ms at the median,
21x vLLM's; with 64, 4 ms (1.4x) and a p99 below vLLM's. Ingest throughput stayed
within the noise of interleaved rounds."""

Outgoing: TypeAlias = Broadcast | Publish
"""What the broadcaster carries out: the core's effects that go out on a socket."""


class Pumps:
    """The core, its lock, and the tasks that feed it and carry out what it returns."""

    def __init__(self, core: CoordinatorCore, max_restarts: int = 0) -> None:
        self.core = core
        """Replaced, under the lock, when the service restarts in place (supervision.py)."""
        self.restart_log = RestartLog(max_restarts)
        self.leftovers: dict[str, list[Any]] = {}
        """What a pump that failed had read and not handed to the core, by pump: the next
        one applies it first (but the message being handled, maybe the failure's cause)."""
        self.fault: str | None = None
        """The pump in which to raise a failure (``supervision.inject_failure``)."""
        self.wave_file: WaveFile | None = None
        self.lock = threading.Lock()
        self.closed = False
        self.monitors: list[PeerMonitor] = []
        """The bound sockets' peer monitors (their log level follows expect_shutdown)."""
        self.ready = trio.Event()
        self._observers = trio.lowlevel.ParkingLot()
        self._observing = 0
        """Tasks parked in :meth:`observe`: with none (the wave path's case) :meth:`changed`
        is one integer check, not a ParkingLot's ``__bool__`` (a Python call) per input."""
        # The listener waits here after a wave start under load (see engine_output_listener)
        self._drained = trio.lowlevel.ParkingLot()
        self._draining = False
        """Whether the listener waits in ``_drained`` (the broadcaster then wakes it)."""
        self.reject_log = RejectLog(logger)
        self.outgoing, self._outgoing_queue = trio.open_memory_channel[list[Outgoing]](math.inf)
        self._queued_behind = 0
        """Items :meth:`dispatch` put on the channel that the broadcaster has not taken: it
        takes more without waiting only while this says some are there, instead of a
        ``receive_nowait`` that raises ``trio.WouldBlock`` (2 us) at every wake."""
        self.timer_scope: trio.CancelScope | None = None
        """The timer task's wait, until the core's next deadline."""
        self._ready_seen = False
        """READY went out (``ready`` is set): no more ``Event.is_set`` call per broadcast."""

    def changed(self) -> None:
        """Something observable changed: wake the tasks in :meth:`observe`."""
        if self._observing:
            self._observers.unpark_all()

    async def observe(self) -> None:
        """Wait for the next :meth:`changed` (the handle's ``wait_for``)."""
        self._observing += 1
        try:
            await self._observers.park()
        finally:
            self._observing -= 1

    def dispatch(self, effects: Sequence[Effect]) -> bool:
        """Hand each effect to its owner. Called under the lock, right after the core.
        What the broadcaster sends goes as one channel item per core call. True when one
        of the effects was a broadcast."""
        outgoing: list[Outgoing] = []
        broadcast = False
        for effect in effects:
            if isinstance(effect, Reject):
                self.reject_log(effect.reason, effect.detail)
            else:
                outgoing.append(effect)
                broadcast = broadcast or type(effect) is Broadcast
        if outgoing:
            if self.wave_file is not None:  # never behind what goes out
                self.wave_file.keep(self.core.snapshot().current_wave)
            self.outgoing.send_nowait(outgoing)
            self._queued_behind += 1
        return broadcast

    def reschedule(self) -> None:
        """Under the lock, after an input: if it moved the core's next deadline earlier,
        wake the timer task sooner (a later one it finds by itself when it wakes)."""
        timer = self.timer_scope
        if timer is not None:
            due = self.core.next_deadline()
            if due < timer.deadline:
                timer.deadline = due

    # --- the pumps ------------------------------------------------------------------------

    async def broadcaster(
        self,
        xpub: AsyncSocket,
        front: AsyncSocket | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The only code that sends: on the engine broadcast socket and, in standalone
        mode, on the front socket, whatever the core decided, in the order it decided it.

        One task for both sockets: a wave's START_DP_WAVE and its publish take one task
        step, not two, and the engines' message always goes first (two tasks woken in one
        scheduler pass run in either order). Each send is first tried synchronously:
        the channel's receive is the loop's checkpoint.
        """
        task_status.started()
        receive = self._outgoing_queue.receive  # not ``async for``: one coroutine less a wake
        clock = trio.lowlevel.current_clock()  # trio.current_time() is three calls deep
        while True:
            try:
                items = await receive()
            except trio.EndOfChannel:  # pragma: no cover  (the channel is never closed)
                return
            self._taken()
            await self._send_queued(items, xpub, front, clock)

    def _taken(self) -> None:
        """The broadcaster took an item (an item not put by :meth:`dispatch`, as a test
        may inject, leaves the count at 0: taken at the next wake instead)."""
        if self._queued_behind > 0:
            self._queued_behind -= 1

    async def _send_queued(
        self,
        items: list[Outgoing],
        xpub: AsyncSocket,
        front: AsyncSocket | None,
        clock: trio.abc.Clock,
    ) -> None:
        """Send ``items`` and whatever is already queued behind them, in this task step (a
        second receive would cost a scheduler pass of its own), then tell the core what
        went out, under the lock once."""
        sent_broadcasts: list[Broadcast] = []
        publishes = 0
        while True:
            for item in items:
                if isinstance(item, Broadcast):
                    if not xpub.send_nowait(item.frames):
                        await xpub.send_multipart(item.frames)
                    sent_broadcasts.append(item)
                else:
                    assert front is not None, "publishes need a front socket"
                    if not front.send_nowait((item.payload,)):
                        await front.send(item.payload)
                    publishes += 1
            if not self._queued_behind:
                break
            try:
                items = self._outgoing_queue.receive_nowait()
            except trio.WouldBlock:  # the count is a hint: the channel has the last word
                self._queued_behind = 0
                break
            self._taken()
        if self._draining:
            self._drained.unpark_all()
        with self.lock:
            if publishes:
                self.core.publish_sent(publishes)
            if not sent_broadcasts:  # a publish alone: no clock reading, nobody to wake
                return
            now = clock.current_time()
            for broadcast in sent_broadcasts:
                self.core.broadcast_sent(broadcast, now)
            ready = not self._ready_seen and self.core.ready_sent()
        if ready:
            self._ready_seen = True
            logger.info("READY sent to %d engines", self.core.subscriptions().current)
            self.ready.set()
        if self._observing:
            self._observers.unpark_all()

    async def timer(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The one timer: sleeps until the core's next deadline (timed publishes, wake
        confirmations, burst summaries), then tells the core the time. An input that moves
        the deadline earlier moves this wait's deadline too (:meth:`reschedule`)."""
        task_status.started()
        try:
            while True:
                with self.lock:
                    due = self.core.next_deadline()
                with trio.move_on_at(due) as self.timer_scope:
                    await trio.sleep_forever()
                with self.lock:
                    self._injected_failure("timer")
                    self.dispatch(self.core.tick(trio.current_time()))
                self.changed()
        finally:
            self.timer_scope = None
            with self.lock:
                self.core.log_summaries(trio.current_time(), final=True)

    async def subscription_watcher(
        self, xpub: AsyncSocket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Engines (un)subscribing on the broadcast socket: the start-up gate (§5.2)."""
        task_status.started()
        await self._apply_each_frame(xpub, self.core.receive_engine_subscription, "subscriptions")

    async def _apply_each_frame(
        self,
        socket: AsyncSocket,
        receive: Callable[[bytes, float], Sequence[Effect]],
        pump: str,
    ) -> None:
        """For ever: a batch from ``socket``, each frame given to the core's ``receive``
        under the lock once per batch, its effects dispatched, the timer rescheduled. A
        failure leaves the frames after the failing one in ``leftovers[pump]``."""
        frames: list[bytes] = self.leftovers.pop(pump, [])
        while True:
            frames = frames or await socket.recv_batch()
            with self.lock:
                now = trio.current_time()
                for index, frame in enumerate(frames):
                    try:
                        self.dispatch(receive(frame, now))
                    except BaseException:
                        self.leftovers[pump] = frames[index + 1 :]
                        raise
                self.reschedule()
            frames = []
            self.changed()

    async def engine_output_listener(
        self, pull: AsyncSocket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Engine outputs in batches (§5.4, §5.5); applied before the gate opens too.

        A message that makes the core decide a broadcast (a wave start) ends the piece of
        the batch applied under the lock. Under load (a batch of more than one message)
        the listener then waits until the broadcaster has sent what is queued, so that
        START_DP_WAVE leaves before the stats reports behind it are applied: one yield is
        not enough, since trio runs the tasks woken in one scheduler pass in either
        order, and in half the passes the rest of the batch (up to a thousand reports)
        went first. A batch of one means the queue was empty: no wait, no extra pass.
        The wait is cancelled only when the service stops, and then nothing received
        matters any more. Within a piece, the load reports are checked and counted in
        order but only each engine's newest is written (``stats_coalesced`` counts the
        others), as the piece ends: wave reports are not kept waiting behind the stats
        queued before them, and whoever takes the lock next finds the table as if every
        report had been applied.
        """
        task_status.started()
        core = self.core
        clock = trio.lowlevel.current_clock()  # trio.current_time() is three calls deep
        batch: list[list[bytes]] = self.leftovers.pop("engine outputs", [])
        while True:
            batch = batch or await pull.recv_multipart_batch(_LISTENER_BATCH)
            count = len(batch)
            index = 0
            try:
                while index < count:
                    with self.lock:
                        now = clock.current_time()
                        if index == 0:  # empty before this batch (it waited) or after it
                            drained = pull.receive_waited or count < _LISTENER_BATCH
                            core.engine_output_batch_read(drained=drained, now=now)
                            if self.fault is not None:
                                self._injected_failure("engine_output")
                        # One core call per piece: load reports are held and only each
                        # engine's newest is written as it ends (the same table as one by
                        # one); a wave start ends the piece (see the core).
                        index, effects = core.receive_engine_outputs(batch, index, now)
                        urgent = self.dispatch(effects)
                        if self.timer_scope is not None:
                            self.reschedule()
                    if self._observing:
                        self._observers.unpark_all()
                    if urgent and count > 1:
                        self._draining = True
                        try:
                            await self._drained.park()
                        finally:
                            self._draining = False
            except BaseException as exc:  # what is left goes to the next listener, but a
                if isinstance(exc, trio.Cancelled):  # failing message
                    self.leftovers["engine outputs"] = batch[index:]
                else:
                    failed = core.failed_message if core.failed_message is not None else index
                    self.leftovers["engine outputs"] = batch[failed + 1 :]
                raise
            batch = []

    async def command_receiver(
        self, front: AsyncSocket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The front socket: front-ends' subscriptions and their commands, FIRST_REQ and
        SCALE_ELASTIC_EP, applied by the core as they are read (§5.3, §5.8, §4.9)."""
        task_status.started()
        await self._apply_each_frame(front, self.core.receive_front_frame, "commands")

    async def peer_watcher(
        self, peers: PeerMonitor, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Peers connecting to and lost by one bound socket (the monitor logs each loss)."""
        task_status.started()
        async for opened in peers.changes():
            with self.lock:
                now = trio.current_time()
                if opened:
                    self.core.connection_opened(peers.key, now)
                else:
                    self.core.connection_lost(peers.key, now)
            self.changed()

    def notify_first_request(self, engine_index: int) -> int:
        """The handle's claim, applied in the caller's task (see the handle); returns the
        wave to stamp on the request, read in the same critical section."""
        with self.lock:
            if self.closed:
                raise CoordinatorClosedError("the coordinator has stopped")
            wave = self.core.snapshot().current_wave
            claim = self.core.claim_first_request(engine_index)
            if claim is not None:
                self.dispatch(self.core.receive_command(claim, trio.current_time()))
                self.reschedule()
        if claim is not None:
            self.changed()
        return wave

    def _injected_failure(self, where: str) -> None:
        if self.fault == where:  # supervision.inject_failure
            self.fault = None
            raise AssertionError(f"a failure injected in the coordinator's {where} pump")

    def drop_undelivered(self) -> int:
        """Drop what the broadcaster has not taken yet (a failed core's decisions)."""
        dropped = 0
        with contextlib.suppress(trio.WouldBlock):
            while True:
                dropped += len(self._outgoing_queue.receive_nowait())
        self._queued_behind = 0
        return dropped

    def close(self) -> None:
        # The channel stays open: a task that already holds received frames when the
        # nursery is cancelled still enqueues what they cause (the cancel stops it at its
        # next checkpoint); a closed channel would fail it with ClosedResourceError.
        with self.lock:
            self.closed = True
