"""A passive subscriber on the DP coordinator's front socket: every publish, in order."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgpack
import trio
import zmq

from trio_dpcoord.trio_zmq import AsyncSocket, open_context, open_socket


@dataclass(frozen=True)
class FrontPublish:
    """One publish of the coordinator to its front-ends: ``(counts, wave, running)``.

    ``counts`` is one ``[waiting, running(, kv usage)]`` list per engine in a stats
    publish and None in a wave-state publish (vLLM's encoding; docs/protocol.md)."""

    counts: list[list[float]] | None
    wave: int
    running: bool
    at: float


@dataclass
class FrontTap:
    """What the tap saw. It only subscribes (as every front-end does) and never sends."""

    publishes: list[FrontPublish] = field(default_factory=list)
    undecodable: list[bytes] = field(default_factory=list)
    _changed: trio.Event = field(default_factory=trio.Event)

    def _add(self, frame: bytes) -> None:
        try:
            counts, wave, running = msgpack.unpackb(frame)
            publish = FrontPublish(counts, int(wave), bool(running), trio.current_time())
        except (ValueError, TypeError, msgpack.UnpackException):
            self.undecodable.append(frame)
        else:
            self.publishes.append(publish)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[FrontTap], bool]) -> None:
        """Wait until ``predicate(self)`` holds (checked after every publish)."""
        while not predicate(self):
            await self._changed.wait()

    async def wait_paused(self) -> FrontPublish:
        """Wait for a publish that says the engines are paused; return it."""
        await self.wait_for(lambda tap: bool(tap.publishes) and not tap.publishes[-1].running)
        return self.publishes[-1]

    def since(self, index: int) -> WaveCount:
        """The waves seen in the publishes from ``index`` on (see :class:`WaveCount`)."""
        return WaveCount.of(self.publishes[index:])


@dataclass(frozen=True)
class WaveCount:
    """Waves in a run of publishes: ``started`` counts paused -> running edges, ``ended``
    how far the wave number went (it counts running -> paused transitions), ``silent``
    the waves that ended with no running publish since the wave before (the coordinator
    never said they ran), and ``backwards`` every publish whose wave is lower than the one
    before."""

    started: int
    ended: int
    silent: int
    backwards: list[tuple[int, int]]
    first_wave: int
    last_wave: int

    @classmethod
    def of(cls, publishes: list[FrontPublish]) -> WaveCount:
        if not publishes:
            return cls(0, 0, 0, [], 0, 0)
        started = silent = 0
        backwards = []
        seen_running = publishes[0].running
        for before, after in itertools.pairwise(publishes):
            if after.running and not before.running:
                started += 1
            if after.wave < before.wave:
                backwards.append((before.wave, after.wave))
            elif after.wave > before.wave:
                silent += after.wave - before.wave - (1 if seen_running else 0)
                seen_running = False
            seen_running = seen_running or after.running
        first, last = publishes[0].wave, publishes[-1].wave
        return cls(started, last - first, silent, backwards, first, last)


async def _receive(socket: AsyncSocket, tap: FrontTap) -> None:
    while True:
        for frame in await socket.recv_batch():
            tap._add(frame)


@asynccontextmanager
async def open_front_tap(address: str) -> AsyncIterator[FrontTap]:
    """Subscribe to the coordinator's front XPUB at ``address`` and record every publish.

    Entered once the first publish arrived (proof that the subscription is in place:
    vLLM's coordinator publishes at least every 5 s, ours also when one subscribes);
    bound the wait with ``trio.fail_after`` around it."""
    async with open_context() as context:
        async with open_socket(
            context, zmq.SUB, connect=address, options={zmq.SUBSCRIBE: b""}
        ) as socket:
            tap = FrontTap()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_receive, socket, tap)
                await tap.wait_for(lambda tap: bool(tap.publishes))
                yield tap
                nursery.cancel_scope.cancel()
