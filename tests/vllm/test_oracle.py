"""vLLM 0.33.0's own coordinator as an oracle for ``trio-dpcoord serve``.

Each test runs one script twice at the same time: against vLLM's real coordinator process
(``DPCoordinatorProc.run_coordinator``, see ``tests/vllm_reference``) and against our
standalone coordinator (``python -m trio_dpcoord serve``, started by
:func:`trio_dpcoord.testing.open_serve`), each with its own scripted peers. Engines are
as vLLM's (an XSUB with the rank as identity, from
:func:`trio_dpcoord.testing.connect_engines`), except that their outputs all go through
one PUSH so that they arrive in the script's order (see ``Side.outputs``); front-ends are
as vLLM's DP clients (an XSUB sending ``0x01``). On vLLM's side everything from
``run_coordinator`` down is vLLM's code (its loop, ``make_zmq_socket``,
``MsgpackDecoder(EngineCoreOutputs)``, ``msgspec``); the stand-ins are torch, the modules
listed in ``tests/vllm_reference/README.md``, and the ``zmq_addr_pipe`` through which it
reports its addresses.

Every broadcast an engine receives and every publish a front-end receives is recorded with
its bytes and a timing class, and the two recordings must be equal, peer by peer, in
order. Where we deliberately differ from vLLM, the test says so in its name (``differs``)
and docstring, asserts our behaviour and shows vLLM's.

Timing classes, measured from the script's last action or the peer's previous message,
whichever is later: ``now`` (well under the stats interval), ``interval`` (about one
stats interval) and ``heartbeat`` (about 5 s). Real clock, generous guards; order and
content are asserted, never milliseconds.

Engine messages are encoded by our codec; ``tests/vllm/test_vectors.py`` shows its bytes
are vLLM's. Front-ends subscribe before engines, and a script goes on only once their
connection is up, so that the XPUB has them when the start-up gate opens and the first
publish goes out.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq

from tests.vllm_reference import open_vllm_coordinator
from trio_dpcoord import open_connection_monitor, protocol
from trio_dpcoord.testing import EnginePeer, connect_engines, open_serve
from trio_dpcoord.trio_zmq import AsyncSocket, open_context, open_socket

pytestmark = pytest.mark.vllm

INTERVAL = 1.2
"""Stats publish interval for both coordinators (s): wide enough to tell from ``now`` even
when a loaded machine delays a process by a few hundred milliseconds."""
HEARTBEAT = 5.0  # vLLM's fixed heartbeat, and ours
GUARD = 60.0  # generous: two coordinator processes and their peers on a loaded machine
SETTLE = 0.6
"""Quiet time at the end of a script, for anything sent in reaction to its last action."""
FRONT_REGISTRATION = 0.2
"""Pause after a front-end's connection is up, for the subscription to reach the XPUB."""


def timing_class(delay: float) -> str:
    if delay < INTERVAL / 2:
        return "now"
    if delay < HEARTBEAT - 1.0:
        return "interval"
    return "heartbeat"


def describe(peer: str, frames: list[bytes]) -> str:
    """A readable form of what a peer received (the bytes are compared too)."""
    if peer.startswith("engine"):
        message = protocol.decode_engine_broadcast(frames)
        if message == "READY":
            return "READY"
        assert isinstance(message, protocol.StartDPWave)
        return f"START_DP_WAVE({message.wave}, exclude={message.exclude_engine_index!r})"
    (frame,) = frames
    publish = protocol.decode_front_publish(frame)
    counts = None if publish.counts is None else [list(c) for c in publish.counts]
    return f"publish({counts}, {publish.current_wave}, {publish.engines_running})"


@dataclass(frozen=True)
class Received:
    what: str
    timing: str
    frames: tuple[bytes, ...]


@dataclass
class Side:
    """One coordinator and its scripted peers; the script drives it through these methods."""

    name: str
    addresses: dict[str, str]
    stack: AsyncExitStack
    nursery: trio.Nursery
    outputs: AsyncSocket
    """The one PUSH every engine's outputs go through, so that the coordinator gets them
    in the script's order (a PULL fair-queues between connections, which could reorder
    messages of different engines); it tells engines apart by ``engine_index``."""
    engines: dict[int, EnginePeer] = field(default_factory=dict)
    fronts: dict[str, AsyncSocket] = field(default_factory=dict)
    received: dict[str, list[Received]] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    _last_action: float = -math.inf
    _last_receipt: dict[str, float] = field(default_factory=dict)
    _changed: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)

    def _acted(self) -> None:
        self._last_action = trio.current_time()

    async def _receive(self, peer: str, socket: AsyncSocket) -> None:
        while True:
            frames = await socket.recv_multipart()
            now = trio.current_time()
            since = max(self._last_action, self._last_receipt.get(peer, -math.inf))
            self._last_receipt[peer] = now
            self.received[peer].append(
                Received(describe(peer, frames), timing_class(now - since), tuple(frames))
            )
            self._changed.unpark_all()

    async def connect_engines(self, *indices: int) -> None:
        """Engine peers with these ranks connect (not yet subscribed)."""
        for index in indices:
            (peer,) = await self.stack.enter_async_context(
                connect_engines(
                    self.addresses["back_pub"],
                    self.addresses["back_out"],
                    1,
                    first_index=index,
                    subscribe=False,
                )
            )
            self.engines[index] = EnginePeer(index, peer.sub, self.outputs)
            self.received[f"engine{index}"] = []
            self.nursery.start_soon(self._receive, f"engine{index}", peer.sub)

    async def subscribe(self, *indices: int) -> None:
        for index in indices:
            self._acted()
            await self.engines[index].subscribe()

    async def unsubscribe(self, index: int) -> None:
        self._acted()
        await self.engines[index].unsubscribe()

    async def front_subscribes(self, name: str = "front") -> None:
        """A front-end as vLLM's DP client: connect an XSUB, send ``0x01``. Returns once
        the connection is up (ZeroMQ's monitor) and a moment more, so that the
        coordinator has the subscription before it next publishes: an XPUB drops what
        it publishes to nobody."""
        context = await self.stack.enter_async_context(open_context())
        socket = await self.stack.enter_async_context(open_socket(context, zmq.XSUB))
        monitor = await self.stack.enter_async_context(
            open_connection_monitor(context, socket, name)
        )
        self.nursery.start_soon(monitor.run)
        self.fronts[name] = socket
        self.received[name] = []
        self.nursery.start_soon(self._receive, name, socket)
        self._acted()
        socket.connect(self.addresses["front"])
        await socket.send(protocol.SUBSCRIBE)
        while not monitor.connected:
            await monitor.wait_changed()
        await trio.sleep(FRONT_REGISTRATION)

    async def front_sends(self, frame: bytes, name: str = "front") -> None:
        self._acted()
        await self.fronts[name].send(frame)

    async def stats(
        self,
        index: int,
        waiting: int,
        running: int,
        usage: float = 0.0,
        *,
        step: int = 0,
        wave: int = 0,
    ) -> None:
        self._acted()
        await self.engines[index].stats(waiting, running, usage, step=step, wave=wave)

    async def start_wave(self, index: int, wave: int) -> None:
        self._acted()
        await self.engines[index].start_wave(wave)

    async def wave_complete(self, index: int, wave: int) -> None:
        self._acted()
        await self.engines[index].wave_complete(wave)

    async def engine_sends_raw(self, frames: list[bytes]) -> None:
        self._acted()
        await self.outputs.send_multipart(frames)

    async def wait_for(self, peer: str, count: int) -> None:
        """Until ``peer`` has received ``count`` messages in all."""
        while len(self.received[peer]) < count:
            await self._changed.park()

    async def quiet(self, seconds: float = SETTLE) -> None:
        """Let time pass with no action (what arrives meanwhile is recorded)."""
        await trio.sleep(seconds)

    def either(self, *, vllm: int, ours: int) -> int:
        """For scripts of a deliberate difference: what to wait for on each side."""
        return ours if self.name == "ours" else vllm

    def seen(self, peer: str) -> list[tuple[str, str]]:
        return [(r.what, r.timing) for r in self.received[peer]]

    def transcript(self) -> dict[str, list[Received]]:
        return {peer: list(messages) for peer, messages in self.received.items()}


Script = Callable[[Side], Awaitable[None]]


@asynccontextmanager
async def vllm_side(
    vllm_root: Path, engines: int, wave_coordination: bool
) -> AsyncIterator[tuple[dict[str, str], list[str]]]:
    log: list[str] = []
    async with open_vllm_coordinator(
        engines,
        enable_wave_coordination=wave_coordination,
        min_stats_update_interval_ms=round(INTERVAL * 1000),
        root=vllm_root,
        log_lines=log,
    ) as addresses:
        yield (
            {
                "front": addresses.front_publish_address,
                "back_pub": addresses.back_publish_address,
                "back_out": addresses.back_output_address,
            },
            log,
        )


@asynccontextmanager
async def our_side(
    engines: int, wave_coordination: bool, extra: tuple[str, ...]
) -> AsyncIterator[tuple[dict[str, str], list[str]]]:
    args = ["--engines", str(engines), "--stats-interval-ms", str(round(INTERVAL * 1000))]
    if not wave_coordination:
        args.append("--no-wave-coordination")
    log: list[str] = []
    async with open_serve(*args, *extra, stderr_line=log.append) as serve:
        yield serve.endpoints, log


async def run_side(
    name: str,
    coordinator: AbstractAsyncContextManager[tuple[dict[str, str], list[str]]],
    engines: int,
    script: Script,
    results: dict[str, Side],
) -> None:
    async with coordinator as (addresses, log), AsyncExitStack() as stack:
        context = await stack.enter_async_context(open_context())
        outputs = await stack.enter_async_context(
            open_socket(context, zmq.PUSH, connect=addresses["back_out"])
        )
        async with trio.open_nursery() as nursery:
            side = Side(name, addresses, stack, nursery, outputs, log=log)
            await side.connect_engines(*range(engines))
            await script(side)
            await side.quiet()
            nursery.cancel_scope.cancel()
        results[name] = side


async def side_by_side(
    vllm_root: Path,
    script: Script,
    *,
    engines: int = 2,
    wave_coordination: bool = True,
    serve_args: tuple[str, ...] = (),
) -> tuple[Side, Side]:
    """Run ``script`` against vLLM's coordinator and ours at once; (vllm, ours)."""
    results: dict[str, Side] = {}
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                run_side,
                "vllm",
                vllm_side(vllm_root, engines, wave_coordination),
                engines,
                script,
                results,
            )
            nursery.start_soon(
                run_side,
                "ours",
                our_side(engines, wave_coordination, serve_args),
                engines,
                script,
                results,
            )
    return results["vllm"], results["ours"]


async def open_gate(side: Side, engines: int = 2) -> None:
    """A front-end subscribes, then every engine; all get READY, the front its first publish."""
    await side.front_subscribes()
    await side.subscribe(*range(engines))
    for index in range(engines):
        await side.wait_for(f"engine{index}", 1)
    await side.wait_for("front", 1)


def zeros(engines: int) -> list[list[float]]:
    return [[0, 0, 0.0] for _ in range(engines)]


def publish(counts: list[list[float]] | None, wave: int, running: bool) -> str:
    return f"publish({counts}, {wave}, {running})"


def recording(side: Side) -> dict[str, list[tuple[str, str]]]:
    return {peer: side.seen(peer) for peer in sorted(side.received)}


def same_recordings(vllm: Side, ours: Side) -> None:
    """Every peer received the same messages, in the same order and timing classes."""
    assert recording(ours) == recording(vllm)
    assert ours.transcript() == vllm.transcript()  # and byte for byte


# ------------------------------------------------------------------------- the same


async def test_ready_once_the_nth_engine_subscribes(vllm_root: Path) -> None:
    async def script(side: Side) -> None:
        await side.front_subscribes()
        await side.subscribe(0, 1)
        await trio.sleep(0.3)
        assert side.seen("engine0") == side.seen("front") == []  # the gate is still shut
        await side.subscribe(2)
        for index in range(3):
            await side.wait_for(f"engine{index}", 1)
        await side.wait_for("front", 1)

    vllm, ours = await side_by_side(vllm_root, script, engines=3)
    same_recordings(vllm, ours)
    assert ours.seen("engine2") == [("READY", "now")]
    assert ours.seen("front") == [(publish(zeros(3), 0, False), "now")]


async def test_a_late_subscriber_gets_ready_and_so_does_everyone(vllm_root: Path) -> None:
    async def script(side: Side) -> None:
        await open_gate(side)
        await side.connect_engines(2)
        await side.subscribe(2)
        for index in range(3):
            await side.wait_for(f"engine{index}", 2 if index < 2 else 1)

    vllm, ours = await side_by_side(vllm_root, script)
    same_recordings(vllm, ours)
    assert ours.seen("engine0") == [("READY", "now"), ("READY", "now")]
    assert ours.seen("engine2") == [("READY", "now")]


async def test_start_wave_wakes_the_others_and_publishes_running(vllm_root: Path) -> None:
    async def script(side: Side) -> None:
        await open_gate(side, 3)
        await side.start_wave(1, 0)
        for index in range(3):
            await side.wait_for(f"engine{index}", 2)
        await side.wait_for("front", 2)

    vllm, ours = await side_by_side(vllm_root, script, engines=3)
    same_recordings(vllm, ours)
    for index in range(3):  # everyone receives it; engine 1 drops it by the exclusion
        assert ours.seen(f"engine{index}")[1] == ("START_DP_WAVE(0, exclude=1)", "now")
    assert ours.seen("front")[1] == (publish(None, 0, True), "now")


async def test_wave_complete_pauses_and_stale_or_repeated_reports_are_ignored(
    vllm_root: Path,
) -> None:
    async def script(side: Side) -> None:
        await open_gate(side)
        await side.start_wave(0, 0)
        await side.wait_for("front", 2)
        await side.start_wave(1, 0)  # wave 0 is already running
        await side.wave_complete(0, 0)  # rank 0: wave 0 is over, paused in wave 1
        await side.wait_for("front", 3)
        await side.start_wave(1, 0)  # stale: wave 1 is current
        await side.wave_complete(0, 0)  # stale too
        await side.start_wave(1, 1)  # current wave, paused: wakes the others
        await side.wait_for("front", 4)

    vllm, ours = await side_by_side(vllm_root, script)
    same_recordings(vllm, ours)
    assert [what for what, _ in ours.seen("engine0")] == [
        "READY",
        "START_DP_WAVE(0, exclude=0)",
        "START_DP_WAVE(1, exclude=1)",
    ]
    assert ours.seen("front")[1:] == [
        (publish(None, 0, True), "now"),
        (publish(None, 1, False), "now"),
        (publish(None, 1, True), "now"),
    ]


async def test_reports_from_the_future_move_the_wave_forward(vllm_root: Path) -> None:
    async def script(side: Side) -> None:
        await open_gate(side)
        await side.start_wave(1, 3)  # paused in wave 0: the fleet jumps to wave 3
        await side.wait_for("front", 2)
        await side.wave_complete(0, 6)  # wave 6 is over: paused in wave 7
        await side.wait_for("front", 3)

    vllm, ours = await side_by_side(vllm_root, script)
    same_recordings(vllm, ours)
    assert ours.seen("engine0")[1] == ("START_DP_WAVE(3, exclude=1)", "now")
    assert [what for what, _ in ours.seen("front")[1:]] == [
        publish(None, 3, True),
        publish(None, 7, False),
    ]


async def test_stats_are_published_one_interval_after_the_last_publish(
    vllm_root: Path,
) -> None:
    async def script(side: Side) -> None:
        await open_gate(side, 3)
        await side.stats(1, waiting=3, running=12, usage=0.4375)
        await side.wait_for("front", 2)

    vllm, ours = await side_by_side(vllm_root, script, engines=3)
    same_recordings(vllm, ours)
    counts = [[0, 0, 0.0], [3, 12, 0.4375], [0, 0, 0.0]]
    assert ours.seen("front") == [
        (publish(zeros(3), 0, False), "now"),
        (publish(counts, 0, False), "interval"),
    ]


async def test_stats_long_after_the_last_publish_go_out_at_once(vllm_root: Path) -> None:
    async def script(side: Side) -> None:
        await open_gate(side)
        await trio.sleep(INTERVAL * 1.5)
        await side.stats(0, waiting=1, running=2, usage=0.5)
        await side.wait_for("front", 2)

    vllm, ours = await side_by_side(vllm_root, script)
    same_recordings(vllm, ours)
    assert ours.seen("front")[1] == (publish([[1, 2, 0.5], [0, 0, 0.0]], 0, False), "now")


async def test_without_news_a_heartbeat_repeats_the_counts(vllm_root: Path) -> None:
    async def script(side: Side) -> None:
        await open_gate(side)
        await side.wait_for("front", 2)

    vllm, ours = await side_by_side(vllm_root, script)
    same_recordings(vllm, ours)
    assert ours.seen("front") == [
        (publish(zeros(2), 0, False), "now"),
        (publish(zeros(2), 0, False), "heartbeat"),
    ]


async def test_lock_step_snapshot_publishes_the_completed_step_first(vllm_root: Path) -> None:
    async def script(side: Side) -> None:
        await open_gate(side)
        await side.stats(0, waiting=1, running=1, step=1)
        await side.stats(1, waiting=2, running=2, step=1)
        await side.stats(0, waiting=5, running=5, step=2)  # step 1 is complete
        await side.wait_for("front", 3)

    vllm, ours = await side_by_side(vllm_root, script)
    same_recordings(vllm, ours)
    assert ours.seen("front")[1:] == [
        (publish([[1, 1, 0.0], [2, 2, 0.0]], 0, False), "interval"),  # the step-1 snapshot
        (publish([[5, 5, 0.0], [2, 2, 0.0]], 0, False), "interval"),  # then the latest
    ]


async def test_without_wave_coordination_only_loads_are_published(vllm_root: Path) -> None:
    async def script(side: Side) -> None:
        await open_gate(side)
        await side.start_wave(1, 0)
        await side.wave_complete(0, 3)
        await side.stats(1, waiting=4, running=0, usage=0.1, step=9, wave=9)
        await side.wait_for("front", 2)

    vllm, ours = await side_by_side(vllm_root, script, wave_coordination=False)
    same_recordings(vllm, ours)
    assert ours.seen("engine1") == [("READY", "now")]
    assert ours.seen("front") == [
        (publish(zeros(2), 0, False), "now"),
        (publish([[0, 0, 0.0], [4, 0, 0.1]], 0, False), "interval"),
    ]


async def test_two_front_ends_both_get_every_wave_publish(vllm_root: Path) -> None:
    async def script(side: Side) -> None:
        await side.front_subscribes("front")
        await side.front_subscribes("front2")
        await side.subscribe(0, 1)
        await side.wait_for("front", 1)
        await side.wait_for("front2", 1)
        await side.start_wave(0, 0)
        await side.wait_for("front", 2)
        await side.wait_for("front2", 2)

    vllm, ours = await side_by_side(vllm_root, script)
    # Both subscribed before the gate, so ours adds no publish of its own for them
    # (after it: test_differs_a_new_front_end_gets_the_counts_at_once).
    for side in (vllm, ours):
        assert side.seen("front") == side.seen("front2")
        assert side.seen("front")[-1] == (publish(None, 0, True), "now")
    assert ours.seen("front") == vllm.seen("front")
    assert ours.seen("engine1") == vllm.seen("engine1")


# --------------------------------------------------------------- deliberate differences


async def test_differs_a_new_front_end_gets_the_counts_at_once(vllm_root: Path) -> None:
    """Ours publishes the current counts when a front-end subscribes (to every front-end:
    an XPUB cannot address one); vLLM's newcomer waits for the next timed publish, here
    the 5 s heartbeat."""

    async def script(side: Side) -> None:
        await open_gate(side)
        await side.stats(0, waiting=2, running=1)
        await side.wait_for("front", 2)
        await side.front_subscribes("late")
        if side.name == "ours":
            await side.wait_for("late", 1)

    vllm, ours = await side_by_side(vllm_root, script)
    counts = [[2, 1, 0.0], [0, 0, 0.0]]
    assert ours.seen("late") == [(publish(counts, 0, False), "now")]
    assert ours.seen("front")[-1] == (publish(counts, 0, False), "now")
    assert vllm.seen("late") == []
    assert vllm.seen("front") == ours.seen("front")[:-1]


async def test_differs_a_resize_is_published_within_an_interval(vllm_root: Path) -> None:
    """After SCALE_ELASTIC_EP ours publishes the new table within one interval; vLLM
    publishes it with the next stats change or heartbeat. Scale-down then scale-up: a
    removed rank's stats are ignored by both, a re-added rank starts from zero."""

    async def resize(side: Side, engines: int, publishes_before: int) -> None:
        await side.front_sends(protocol.encode_scale_elastic_ep(engines))
        # The resize and the next engine report travel on different sockets, so nothing
        # orders them; vLLM shows nothing when it has handled a resize: give it a moment.
        await side.wait_for("front", side.either(vllm=publishes_before, ours=publishes_before + 1))
        await trio.sleep(0.5)

    async def script(side: Side) -> None:
        await open_gate(side, 3)
        await side.stats(2, waiting=7, running=7)
        await side.wait_for("front", 2)
        await resize(side, 2, publishes_before=2)
        await side.stats(2, waiting=9, running=9)  # a removed rank: ignored
        await side.stats(0, waiting=1, running=0)
        await side.wait_for("front", side.either(vllm=3, ours=4))
        await resize(side, 3, publishes_before=side.either(vllm=3, ours=4))
        await side.stats(2, waiting=0, running=3, usage=0.25)
        await side.wait_for("front", side.either(vllm=4, ours=6))

    vllm, ours = await side_by_side(vllm_root, script, engines=3)
    before = [[0, 0, 0.0], [0, 0, 0.0], [7, 7, 0.0]]
    down = [[1, 0, 0.0], [0, 0, 0.0]]
    up = [[1, 0, 0.0], [0, 0, 0.0], [0, 3, 0.25]]
    assert [what for what, _ in vllm.seen("front")[1:]] == [
        publish(before, 0, False),
        publish(down, 0, False),
        publish(up, 0, False),
    ]
    assert [what for what, _ in ours.seen("front")[1:]] == [
        publish(before, 0, False),
        publish([[0, 0, 0.0], [0, 0, 0.0]], 0, False),  # the resize itself
        publish(down, 0, False),
        publish([[1, 0, 0.0], [0, 0, 0.0], [0, 0, 0.0]], 0, False),  # the resize itself
        publish(up, 0, False),
    ]


async def test_differs_only_in_logging_a_slower_engines_stats_as_out_of_order(
    vllm_root: Path,
) -> None:
    """Lock-step engines report each step, so engine 1's step-1 report may arrive after
    engine 0's step-2 report. vLLM's single cursor warns that it is out of order (vllm
    #52936); ours keeps a cursor per engine and takes it as normal. The publishes are the
    same: the step-1 snapshot is taken when engine 0's step 2 arrives, in both."""

    async def script(side: Side) -> None:
        await open_gate(side)
        await side.stats(0, waiting=1, running=1, step=1)
        await side.stats(0, waiting=3, running=3, step=2)
        await side.stats(1, waiting=2, running=2, step=1)
        await side.stats(1, waiting=4, running=4, step=2)
        await side.wait_for("front", 3)

    vllm, ours = await side_by_side(vllm_root, script)
    same_recordings(vllm, ours)
    assert ours.seen("front")[1:] == [
        (publish([[1, 1, 0.0], [0, 0, 0.0]], 0, False), "interval"),
        (publish([[3, 3, 0.0], [4, 4, 0.0]], 0, False), "interval"),
    ]
    assert [line for line in vllm.log if "out-of-order" in line] != []
    assert [line for line in ours.log if "out-of-order" in line] == []


async def test_differs_wave_reports_need_a_known_engine(vllm_root: Path) -> None:
    """A start_wave from an engine index beyond the table (2 engines, index 5): vLLM starts
    the wave and excludes the nonexistent engine, so every real engine wakes; ours rejects
    the report, and the wave starts when a real engine reports."""

    async def script(side: Side) -> None:
        await open_gate(side)
        await side.connect_engines(5)  # never subscribes: the gate counts 2
        await side.start_wave(5, 0)
        await side.start_wave(1, 0)
        await side.wait_for("engine0", 2)
        await side.wait_for("front", 2)

    vllm, ours = await side_by_side(vllm_root, script)
    assert vllm.seen("engine0")[1:] == [("START_DP_WAVE(0, exclude=5)", "now")]
    assert ours.seen("engine0")[1:] == [("START_DP_WAVE(0, exclude=1)", "now")]
    assert ours.seen("front")[1:] == vllm.seen("front")[1:] == [(publish(None, 0, True), "now")]


async def test_a_report_before_the_gate_is_published_before_the_first_counts(
    vllm_root: Path,
) -> None:
    """Engine 1 starts a wave while engine 0 has not subscribed yet. Engines see READY,
    then START_DP_WAVE (vLLM reads engine outputs only once its gate is open; ours
    applies the report at once and queues the broadcast behind READY). Front-ends see the
    wave start, then the first counts, already running: a front-end that subscribed
    before the gate gets no counts of its own, so none older than the gate."""

    async def script(side: Side) -> None:
        await side.front_subscribes()
        await side.subscribe(1)
        await side.start_wave(1, 0)
        await trio.sleep(0.3)
        await side.subscribe(0)
        await side.wait_for("engine0", 2)
        await side.wait_for("front", 2)

    vllm, ours = await side_by_side(vllm_root, script)
    for side in (vllm, ours):
        assert side.seen("engine0") == side.seen("engine1")
        assert side.seen("engine0") == [("READY", "now"), ("START_DP_WAVE(0, exclude=1)", "now")]
        assert side.seen("front") == [
            (publish(None, 0, True), "now"),
            (publish(zeros(2), 0, True), "now"),
        ]


async def test_differs_bad_engine_output_kills_vllms_coordinator_not_ours(
    vllm_root: Path, vectors: dict[str, dict[str, Any]]
) -> None:
    """An engine output with request outputs in it (a misrouted batch): vLLM's coordinator
    asserts ``not outputs.outputs`` and its process dies; ours rejects it, logs and counts
    it, and handles the next report exactly."""
    batch = [bytes.fromhex(h) for h in vectors["eco_normal_output_batch"]["frames_hex"]]

    async def script(side: Side) -> None:
        await open_gate(side)
        await side.engine_sends_raw(batch)
        await side.start_wave(1, 0)
        if side.name == "ours":
            await side.wait_for("front", 2)

    vllm, ours = await side_by_side(vllm_root, script)
    assert ours.seen("engine0")[1] == ("START_DP_WAVE(0, exclude=1)", "now")
    assert ours.seen("front")[1] == (publish(None, 0, True), "now")
    assert len(vllm.seen("engine0")) == len(vllm.seen("front")) == 1  # READY, first publish
    assert any("AssertionError" in line for line in vllm.log)


async def test_differs_an_unsubscription_during_the_gate(vllm_root: Path) -> None:
    """An engine that unsubscribes before the gate opens (it died and comes back): ours
    counts live subscriptions and opens the gate when both are there; vLLM's gate takes
    any frame but 0x01 as fatal, and its coordinator loop returns."""

    async def script(side: Side) -> None:
        await side.front_subscribes()
        await side.subscribe(0)
        await trio.sleep(0.2)
        await side.unsubscribe(0)
        await trio.sleep(0.2)
        await side.subscribe(0, 1)
        if side.name == "ours":
            await side.wait_for("engine1", 1)

    vllm, ours = await side_by_side(vllm_root, script)
    assert ours.seen("engine0") == ours.seen("engine1") == [("READY", "now")]
    assert vllm.seen("engine0") == vllm.seen("engine1") == []
    assert any("unexpected message while waiting" in line for line in vllm.log)


async def test_differs_a_stale_legacy_first_request_wakes_everyone(vllm_root: Path) -> None:
    """A legacy FIRST_REQ (older front-ends) for a wave already over: ours wakes every
    engine at the current wave with no exclusion (vLLM PR #46833's rule); vLLM 0.33.0 no
    longer accepts FIRST_REQ and logs it as unexpected."""

    async def script(side: Side) -> None:
        await open_gate(side)
        await side.start_wave(0, 0)
        await side.wave_complete(0, 0)
        await side.wait_for("front", 3)
        await side.front_sends(protocol.encode_legacy_first_request(1, 0))
        if side.name == "ours":
            await side.wait_for("front", 4)

    vllm, ours = await side_by_side(vllm_root, script)
    assert ours.seen("engine1")[2] == ("START_DP_WAVE(1, exclude=None)", "now")
    assert ours.seen("front")[3] == (publish(None, 1, True), "now")
    assert vllm.seen("front") == ours.seen("front")[:3]
    assert len(vllm.seen("engine1")) == 2  # READY, START_DP_WAVE(0): nothing for FIRST_REQ
    assert any("unexpected message from front-end" in line for line in vllm.log)


async def test_differs_an_unconfirmed_wake_goes_back_to_paused(vllm_root: Path) -> None:
    """A wake that no engine confirms with start_wave (paused engines drop START_DP_WAVE)
    goes back to paused after ``--wake-confirm-timeout`` instead of latching
    engines_running (vllm #51476/#51481). vLLM 0.33.0 cannot latch this way, as it ignores
    FIRST_REQ; only its engines' start_wave sets engines_running."""

    async def script(side: Side) -> None:
        await open_gate(side)
        await side.front_sends(protocol.encode_legacy_first_request(1, 0))
        if side.name == "ours":
            await side.wait_for("front", 3)

    vllm, ours = await side_by_side(vllm_root, script, serve_args=("--wake-confirm-timeout", "1"))
    assert ours.seen("engine0")[1] == ("START_DP_WAVE(0, exclude=1)", "now")
    assert [what for what, _ in ours.seen("front")[1:]] == [
        publish(None, 0, True),
        publish(None, 0, False),  # nobody confirmed: paused again
    ]
    assert vllm.seen("front") == ours.seen("front")[:1]
