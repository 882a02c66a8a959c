"""Fuzzing the running coordinator over its real sockets.

Hypothesis throws random and mutated frames (built from vLLM's vectors) at every socket:
engine outputs (PULL), front-end payloads (front XPUB) and upstream payloads on the
engine broadcast XPUB. The expected outcome of every frame is worked out independently
with the codec and a sans-IO :class:`WaveState`: which rejection reason it is counted
under, or which state change (and which START_DP_WAVE bytes) it causes. After each batch
the coordinator must match that prediction exactly and still run a valid wave sequence
with the exact bytes.

In-process, each example gets a fresh coordinator (pytest-trio runs every Hypothesis
example in its own trio run) and valid frames are part of the mix. Standalone, one
``python -m trio_dpcoord serve`` process takes every example in turn; only frames that
must be rejected are sent (so frames racing across sockets cannot change the outcome),
and the totals on its final stdout line must equal the sum of the predictions.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import trio
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from trio_dpcoord import Coordinator, WaveSnapshot, protocol
from trio_dpcoord.core import WaveState
from trio_dpcoord.testing import (
    EnginePeer,
    connect_engines,
    expect_broadcast,
    open_coordinator_with_engines,
    parse_endpoints,
    serve_command,
)
from trio_dpcoord.trio_zmq import AsyncSocket, open_context, open_socket

GUARD = 30.0
ENGINES = 2
MAX_WAVE = (1 << 64) - 1
MAX_ENGINES = 1 << 16
BIG_WAVE = 1 << 40
"""Valid wave reports above this are left out of the random mix: one would park the wave
near 2**64 for the rest of the run (that edge has its own test below)."""

BACK_OUT, FRONT, BACK_PUB = "back-out", "front", "back-pub upstream"

# --------------------------------------------------------------------------- strategies

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), MAX_WAVE)
    | st.sampled_from([0, 1, 2, 3, 7, MAX_WAVE, MAX_WAVE - 1, -1])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
msgpack_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=10)
        | st.dictionaries(st.text(max_size=6) | st.integers(0, 9), children, max_size=5)
    ),
    max_leaves=24,
)
_small_waves = st.integers(0, 6)


@st.composite
def packed_values(draw: st.DrawFn) -> bytes:
    return bytes(msgpack.packb(draw(msgpack_values), use_bin_type=True))


@st.composite
def near_valid_outputs(draw: st.DrawFn) -> bytes:
    """EngineCoreOutputs-shaped arrays with random slots: often valid, often not."""
    slot = st.one_of(
        st.none(), st.integers(0, 3), _small_waves, st.just([]), msgpack_values, st.just(0.5)
    )
    items = draw(st.lists(slot, min_size=0, max_size=11))
    if draw(st.booleans()) and items:
        items[0] = draw(st.integers(0, 3))
    return bytes(msgpack.packb(items, use_bin_type=True))


@st.composite
def valid_outputs(draw: st.DrawFn) -> bytes:
    index = draw(st.integers(0, 3))
    kind = draw(st.sampled_from(["start", "complete", "stats", "both"]))
    stats = protocol.SchedulerStats(
        num_running_reqs=draw(st.integers(0, 50)),
        num_waiting_reqs=draw(st.integers(0, 50)),
        step_counter=draw(st.integers(0, 40)),
        current_wave=draw(_small_waves),
        kv_cache_usage=draw(st.floats(0, 1)),
    )
    out = protocol.EngineCoreOutputs(
        engine_index=index,
        start_wave=draw(_small_waves) if kind in ("start", "both") else None,
        wave_complete=draw(_small_waves) if kind in ("complete", "both") else None,
        scheduler_stats=stats if kind == "stats" else None,
    )
    return protocol.encode_engine_core_outputs(out)


@st.composite
def valid_front_payloads(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        count = draw(st.integers(0, 4) | st.sampled_from([MAX_ENGINES, MAX_ENGINES + 1, MAX_WAVE]))
        return protocol.encode_scale_elastic_ep(count)
    engine = draw(st.none() | st.integers(0, 3) | st.binary(min_size=2, max_size=2))
    return protocol.encode_legacy_first_request(engine, draw(_small_waves))


@st.composite
def mutated(draw: st.DrawFn, frames: list[bytes]) -> bytes:
    """One vector frame, flipped, truncated, extended, cut or spliced."""
    frame = draw(st.sampled_from(frames))
    how = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "splice", "as is"]))
    if how == "as is" or (not frame and how in ("flip", "delete")):
        return frame
    at = draw(st.integers(0, max(len(frame) - 1, 0)))
    if how == "flip":
        return frame[:at] + bytes([frame[at] ^ draw(st.integers(1, 255))]) + frame[at + 1 :]
    if how == "truncate":
        return frame[:at]
    if how == "insert":
        return frame[:at] + draw(st.binary(min_size=1, max_size=9)) + frame[at:]
    if how == "delete":
        return frame[:at] + frame[at + draw(st.integers(1, 8)) :]
    other = draw(st.sampled_from(frames))
    return frame[:at] + other[draw(st.integers(0, len(other))) :]


def any_frame(vector_frames: list[bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        mutated(vector_frames),
        packed_values(),
        st.binary(max_size=40),
        near_valid_outputs(),
        valid_outputs(),
        valid_front_payloads(),
    )


def messages(vector_frames: list[bytes]) -> st.SearchStrategy[tuple[str, list[bytes]]]:
    """``(socket, frames)``: multipart only on the PULL; single frames on the XPUBs, where
    a leading 00/01 byte is the subscription mechanism itself rather than a payload."""
    frame = any_frame(vector_frames)
    payload = frame.map(lambda f: b"\x93" + f if f[:1] in (b"\x00", b"\x01") else f)
    return st.one_of(
        st.tuples(st.just(BACK_OUT), st.lists(frame, min_size=1, max_size=1)),
        st.tuples(st.just(BACK_OUT), st.lists(frame, min_size=2, max_size=3)),
        st.tuples(st.just(FRONT), st.lists(payload, min_size=1, max_size=1)),
        st.tuples(st.just(BACK_PUB), st.lists(payload, min_size=1, max_size=1)),
    )


def all_vector_frames(vectors: dict[str, dict[str, Any]]) -> list[bytes]:
    return [bytes.fromhex(h) for v in vectors.values() for h in v["frames_hex"]]


# --------------------------------------------------------------------------- the oracle


@dataclass
class Oracle:
    """What the coordinator must do with each frame, decided with the codec alone."""

    state: WaveState
    engine_count: int = ENGINES
    rejected: Counter[str] = field(default_factory=Counter)
    broadcasts: list[list[bytes]] = field(default_factory=list)
    commands: int = 0
    stats_applied: int = 0

    def expect(self, socket: str, frames: list[bytes]) -> str | None:
        """Apply one message; return its rejection reason, or None if it is valid."""
        reason = self._classify(socket, frames)
        if reason is not None:
            self.rejected[reason] += 1
        return reason

    def _classify(self, socket: str, frames: list[bytes]) -> str | None:
        if socket == BACK_PUB:
            return "unexpected_broadcast_socket_frame"
        if socket == FRONT:
            return self._front(frames[0])
        if len(frames) != 1:
            return "multipart_engine_output"
        try:
            out = protocol.decode_engine_core_outputs(frames[0])
        except protocol.ProtocolError:
            return "undecodable_engine_output"
        kind = protocol.classify_output(out)
        kinds = protocol.OutputKind
        if kind not in (kinds.STATS, kinds.WAVE_COMPLETE, kinds.START_WAVE):
            return f"non_control_output_{kind.name.lower()}"
        if out.engine_index >= self.engine_count:
            return "unknown_engine_index"
        if kind is kinds.STATS:
            self.stats_applied += 1
        elif out.wave_complete is not None:
            if out.wave_complete >= MAX_WAVE:
                return "wave_out_of_range"
            self.state.wave_complete(out.wave_complete)
        else:
            assert out.start_wave is not None
            self._broadcast(self.state.engine_start_wave(out.start_wave, out.engine_index))
        return None

    def _front(self, frame: bytes) -> str | None:
        try:
            message = protocol.decode_front_message(frame)
        except protocol.ProtocolError:
            return "undecodable_front_message"
        if isinstance(message, protocol.ScaleElasticEP):
            if not 1 <= message.new_engine_count <= MAX_ENGINES:
                return "bad_scale_request"
            self.engine_count = message.new_engine_count
        else:
            self._broadcast(self.state.start_wave_for_first_request(message.wave, message.engine))
        self.commands += 1
        return None

    def _broadcast(self, start: Any) -> None:
        if start is not None:
            exclude = start.exclude
            self.broadcasts.append([b"\x02", msgpack.packb([start.wave, exclude])])


def parks_the_wave_high(frames: list[bytes]) -> bool:
    """A valid wave report beyond BIG_WAVE (kept out of the random mix)."""
    if len(frames) != 1:
        return False
    try:
        out = protocol.decode_engine_core_outputs(frames[0])
    except protocol.ProtocolError:
        return False
    kind = protocol.classify_output(out)
    if kind is protocol.OutputKind.START_WAVE:
        return out.start_wave is not None and out.start_wave > BIG_WAVE
    if kind is protocol.OutputKind.WAVE_COMPLETE:
        return out.wave_complete is not None and BIG_WAVE < out.wave_complete < MAX_WAVE
    return False


# --------------------------------------------------------------------------- helpers


def start_dp_wave(wave: int, exclude: int | None) -> list[bytes]:
    """START_DP_WAVE bytes built by hand (msgpack), independent of our encoder."""
    return [b"\x02", msgpack.packb([wave, exclude])]


async def send(
    socket: str, frames: list[bytes], engines: list[EnginePeer], front: AsyncSocket
) -> None:
    if socket == BACK_OUT:
        await engines[0].send_raw(frames)
    elif socket == FRONT:
        await front.send(frames[0])
    else:
        await engines[1].sub.send(frames[0])


def _front_outcomes(c: Coordinator) -> int:
    rejected = c.statistics().rejected
    return (
        rejected.get("undecodable_front_message", 0)
        + rejected.get("bad_scale_request", 0)
        + c.statistics().commands
    )


async def wait_processed(
    coordinator: Coordinator, socket: str, count: int, before: dict[str, int]
) -> None:
    """Wait until the coordinator has taken the ``count`` messages just sent on ``socket``."""
    if socket == BACK_OUT:
        target = before[BACK_OUT] + count
        await coordinator.wait_for(lambda c: c.statistics().engine_messages == target)
    elif socket == FRONT:
        target = before[FRONT] + count
        await coordinator.wait_for(lambda c: _front_outcomes(c) == target)
    else:
        target = before[BACK_PUB] + count
        await coordinator.wait_for(
            lambda c: c.statistics().rejected.get("unexpected_broadcast_socket_frame", 0) == target
        )


def progress(coordinator: Coordinator) -> dict[str, int]:
    return {
        BACK_OUT: coordinator.statistics().engine_messages,
        FRONT: _front_outcomes(coordinator),
        BACK_PUB: coordinator.statistics().rejected.get("unexpected_broadcast_socket_frame", 0),
    }


async def valid_wave_sequence(
    engines: list[EnginePeer],
    front: AsyncSocket,
    wave: int,
    wait_state: Callable[[WaveSnapshot], Any],
) -> int:
    """From wave ``wave`` (running or not): three waves end to end, exact bytes each time.

    Returns the wave the coordinator is left at (paused)."""
    await engines[0].wave_complete(wave)
    await wait_state(WaveSnapshot(wave + 1, False))
    await engines[1].start_wave(wave + 1)  # an idle engine got a request
    await expect_broadcast(engines, start_dp_wave(wave + 1, 1), skip_ready=True)
    await wait_state(WaveSnapshot(wave + 1, True))
    await engines[0].start_wave(wave + 1)  # rank-0 mirror: ignored
    await engines[0].wave_complete(wave + 1)
    await wait_state(WaveSnapshot(wave + 2, False))
    await front.send(protocol.encode_legacy_first_request(1, wave + 1))  # stale: wake all
    await expect_broadcast(engines, start_dp_wave(wave + 2, None), skip_ready=True)
    await wait_state(WaveSnapshot(wave + 2, True))
    await engines[1].wave_complete(wave + 2)
    await wait_state(WaveSnapshot(wave + 3, False))
    await engines[0].start_wave(wave + 3)  # marker: nothing else was broadcast meanwhile
    await expect_broadcast(engines, start_dp_wave(wave + 3, 0), skip_ready=True)
    await engines[0].wave_complete(wave + 3)
    await wait_state(WaveSnapshot(wave + 4, False))
    return wave + 4


# --------------------------------------------------------------------------- in-process


@asynccontextmanager
async def coordinator_engines_and_front() -> AsyncIterator[
    tuple[Coordinator, list[EnginePeer], AsyncSocket]
]:
    """An in-process coordinator with its ENGINES engines past READY, and a raw front socket."""
    async with open_coordinator_with_engines(ENGINES, front_address="tcp://127.0.0.1:0") as (
        coordinator,
        engines,
    ):
        assert coordinator.front_address is not None
        async with (
            open_context() as context,
            open_socket(
                context, zmq.XSUB, connect=coordinator.front_address, options={zmq.LINGER: 0}
            ) as front,
        ):
            yield coordinator, engines, front


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(data=st.data())
async def test_in_process_coordinator_survives_and_counts_every_bad_frame(
    vectors: dict[str, dict[str, Any]], data: st.DataObject
) -> None:
    batch = data.draw(
        st.lists(messages(all_vector_frames(vectors)), min_size=5, max_size=40), label="batch"
    )
    batch = [m for m in batch if not parks_the_wave_high(m[1])]
    with trio.fail_after(GUARD):
        async with coordinator_engines_and_front() as (coordinator, engines, front):
            oracle = Oracle(WaveState(coordinator.snapshot()))
            # one run of messages per socket at a time, so the order across sockets is
            # the order sent (each socket's own order is kept by ZeroMQ)
            run: list[tuple[str, list[bytes]]] = []
            for i, message in enumerate(batch):
                run.append(message)
                if i + 1 == len(batch) or batch[i + 1][0] != message[0]:
                    before = progress(coordinator)
                    for socket, frames in run:
                        oracle.expect(socket, frames)
                        await send(socket, frames, engines, front)
                    await wait_processed(coordinator, message[0], len(run), before)
                    run = []

            event(f"{len(oracle.broadcasts)} START_DP_WAVE from the junk")
            event(f"{oracle.commands} front commands accepted")
            for frames in oracle.broadcasts:
                await expect_broadcast(engines, frames, skip_ready=True)
            assert coordinator.statistics().rejected == dict(oracle.rejected)
            assert coordinator.statistics().errors == sum(oracle.rejected.values())
            assert coordinator.statistics().commands == oracle.commands
            assert coordinator.statistics().stats_applied == oracle.stats_applied
            assert coordinator.engine_count == oracle.engine_count
            assert coordinator.snapshot() == oracle.state.snapshot

            # back to two engines, then a valid wave sequence, byte-exact
            commands = coordinator.statistics().commands
            await front.send(protocol.encode_scale_elastic_ep(ENGINES))
            await coordinator.wait_for(lambda c: c.statistics().commands == commands + 1)

            async def wait_state(snapshot: WaveSnapshot) -> None:
                await coordinator.wait_for(lambda c: c.snapshot() == snapshot)

            await valid_wave_sequence(
                engines, front, coordinator.snapshot().current_wave, wait_state
            )
            assert coordinator.statistics().errors == sum(oracle.rejected.values())


async def test_waves_at_the_top_of_uint64_are_rejected_not_fatal() -> None:
    """Found by the fuzzer: wave_complete(2**64-1) used to crash the coordinator (the
    next wave cannot be encoded); likewise SCALE_ELASTIC_EP to 10**12 engines."""
    with trio.fail_after(GUARD):
        async with coordinator_engines_and_front() as (coordinator, engines, front):
            await engines[0].wave_complete(MAX_WAVE)
            await front.send(protocol.encode_scale_elastic_ep(10**12))
            await coordinator.wait_for(
                lambda c: (
                    c.statistics().rejected == {"wave_out_of_range": 1, "bad_scale_request": 1}
                )
            )
            assert coordinator.snapshot() == WaveSnapshot(0, False)
            assert coordinator.engine_count == ENGINES
            await engines[1].start_wave(MAX_WAVE)  # the last wave still starts
            await expect_broadcast(engines, start_dp_wave(MAX_WAVE, 1))
            await engines[0].wave_complete(MAX_WAVE)  # and can never end
            await coordinator.wait_for(lambda c: c.statistics().errors == 3)
            assert coordinator.snapshot() == WaveSnapshot(MAX_WAVE, True)


# --------------------------------------------------------------------------- standalone


class StandaloneCoordinator:
    """``python -m trio_dpcoord serve`` in a child process, always reaped."""

    def __init__(self, tmp_path: Path) -> None:
        self.stderr_path = tmp_path / "coordinator.log"
        self._stderr = self.stderr_path.open("wb")
        self.proc = subprocess.Popen(
            serve_command(
                "--engines",
                str(ENGINES),
                "--front",
                "tcp://127.0.0.1:0",
                "--back-pub",
                "tcp://127.0.0.1:0",
                "--back-out",
                "tcp://127.0.0.1:0",
                "--log-level",
                "WARNING",
            ),
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
        )
        self._buffer = b""
        self.endpoints = parse_endpoints(self.read_line(GUARD))

    def read_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise AssertionError(f"no line from the coordinator: {self.log()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"coordinator exited: {self.log()}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def log(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def stop(self) -> dict[str, Any]:
        """SIGTERM, then the final counters line."""
        assert self.proc.poll() is None, f"the coordinator stopped early: {self.log()}"
        self.proc.send_signal(signal.SIGTERM)
        counters: dict[str, Any] = json.loads(self.read_line(GUARD))["counters"]
        assert self.proc.wait(GUARD) == 0
        return counters

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


def test_standalone_coordinator_survives_and_counts_every_bad_frame(
    vectors: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """One process for all examples; each example is its own trio run with new peers."""
    vector_frames = all_vector_frames(vectors)
    coordinator = StandaloneCoordinator(tmp_path)
    expected: Counter[str] = Counter()
    wave = [0]  # where the valid sequences have left the coordinator (junk changes nothing)
    try:
        endpoints = coordinator.endpoints

        async def example(batch: list[tuple[str, list[bytes]]]) -> None:
            with trio.fail_after(GUARD):
                async with (
                    connect_engines(
                        endpoints["back_pub"], endpoints["back_out"], ENGINES, subscribe=False
                    ) as engines,
                    open_context() as context,
                    open_socket(
                        context, zmq.XSUB, connect=endpoints["front"], options={zmq.LINGER: 0}
                    ) as front,
                ):
                    await front.send(protocol.SUBSCRIBE)
                    # upstream junk on an engine's XSUB goes before its subscription: the
                    # READY that answers the subscription proves the junk was read (one pipe,
                    # one reader, in order), whatever the socket's linger on close
                    for socket, frames in batch:
                        if socket == BACK_PUB:
                            await send(socket, frames, engines, front)
                    for engine in engines:
                        await engine.subscribe()
                    # a READY (gate or late-subscription rebroadcast) also proves the engine's
                    # subscription is in place, so no broadcast can miss it
                    for engine in engines:
                        assert await engine.next_broadcast_frames() == [protocol.READY]
                    # the publish every new subscriber gets says where the wave is
                    published = protocol.decode_front_publish(await front.recv())
                    assert (published.current_wave, published.engines_running) == (wave[0], False)
                    # engine outputs and front payloads: the valid sequence below goes over the
                    # same two pipes, so once it has worked every frame here has been read
                    for socket, frames in batch:
                        if socket != BACK_PUB:
                            await send(socket, frames, engines, front)

                    async def wait_state(snapshot: WaveSnapshot) -> None:
                        while True:
                            p = protocol.decode_front_publish(await front.recv())
                            if (p.current_wave, p.engines_running) == (
                                snapshot.current_wave,
                                snapshot.engines_running,
                            ):
                                return

                    wave[0] = await valid_wave_sequence(engines, front, wave[0], wait_state)

        @settings(
            max_examples=200,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        @given(st.lists(messages(vector_frames), min_size=5, max_size=40))
        def run(batch: list[tuple[str, list[bytes]]]) -> None:
            # only frames that must be rejected: each is judged against the state the
            # coordinator really has (nothing here changes it)
            verdicts = [
                (m, Oracle(WaveState(WaveSnapshot(wave[0], False))).expect(*m)) for m in batch
            ]
            trio.run(example, [m for m, reason in verdicts if reason is not None])
            expected.update(reason for _, reason in verdicts if reason is not None)

        run()
        counters = coordinator.stop()
        assert counters["rejected"] == dict(expected), coordinator.log()
        assert counters["errors"] == sum(expected.values())
        assert sum(expected.values()) > 400  # the run really threw junk at it
        assert len(expected) >= 6  # of many kinds
    finally:
        coordinator.close()
