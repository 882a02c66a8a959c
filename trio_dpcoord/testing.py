"""Test helpers: bare engine peers, and the standalone coordinator as a child process.

For tests of a front-end or of the coordinator itself: each :class:`EnginePeer` is what
a vLLM engine's coordinator-facing sockets are (an XSUB with its rank as identity, a
PUSH of ``EngineCoreOutputs``), with no scheduler behind them. For engines that run
waves in lock-step, see :mod:`trio_dpcoord.sim`. :func:`open_coordinator_with_engines`
is the usual opening of a test of the in-process coordinator (a coordinator, its engines,
READY received); :func:`expect_broadcast` checks what every engine receives next;
:func:`inject_coordinator_failure` makes the service fail from inside (its restart).

:func:`open_serve` runs ``python -m trio_dpcoord serve`` for the duration of a block and
yields its endpoints; blocking callers build the same command with :func:`serve_command`
and read its first line with :func:`parse_endpoints`. :func:`open_child` does the same
for any program (the examples).

Only public helpers for testing an application live here; the package's own white-box
tests import the private modules they test directly.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio
import zmq

from . import protocol
from ._shell.coordinator import Coordinator, open_coordinator
from ._shell.supervision import inject_failure
from .trio_zmq import AsyncSocket, curve_client_options, open_context, open_socket

__all__ = [
    "EnginePeer",
    "ServeProcess",
    "connect_engines",
    "expect_broadcast",
    "inject_coordinator_failure",
    "open_child",
    "open_coordinator_with_engines",
    "open_serve",
    "parse_endpoints",
    "read_lines",
    "serve_command",
]

_ENDPOINT_KEYS = ("front", "back_pub", "back_out")


class EnginePeer:
    """One engine's coordinator-facing sockets, driven by hand."""

    def __init__(self, index: int, sub: AsyncSocket, push: AsyncSocket) -> None:
        self.index = index
        self.sub = sub
        self.push = push

    async def subscribe(self) -> None:
        await self.sub.send(protocol.SUBSCRIBE)

    async def unsubscribe(self) -> None:
        await self.sub.send(protocol.UNSUBSCRIBE)

    async def next_broadcast_frames(self) -> list[bytes]:
        """The raw frames of the next broadcast (READY or START_DP_WAVE)."""
        return await self.sub.recv_multipart()

    async def next_broadcast(self) -> str | protocol.StartDPWave:
        return protocol.decode_engine_broadcast(await self.sub.recv_multipart())

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.push.send_multipart(frames)

    async def send_output(self, out: protocol.EngineCoreOutputs) -> None:
        await self.push.send(protocol.encode_engine_core_outputs(out))

    async def start_wave(self, wave: int) -> None:
        await self.send_output(protocol.EngineCoreOutputs(engine_index=self.index, start_wave=wave))

    async def wave_complete(self, wave: int) -> None:
        await self.send_output(
            protocol.EngineCoreOutputs(engine_index=self.index, wave_complete=wave)
        )

    async def stats(
        self, waiting: int, running: int, usage: float = 0.0, *, wave: int = 0, step: int = 0
    ) -> None:
        stats = protocol.SchedulerStats(
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            step_counter=step,
            current_wave=wave,
            kv_cache_usage=usage,
        )
        await self.send_output(
            protocol.EngineCoreOutputs(engine_index=self.index, scheduler_stats=stats)
        )


@asynccontextmanager
async def connect_engines(
    input_address: str,
    output_address: str,
    count: int,
    *,
    first_index: int = 0,
    subscribe: bool = True,
    curve_server_key: bytes | None = None,
) -> AsyncIterator[list[EnginePeer]]:
    """``count`` engine peers connected to a coordinator's broadcast and output sockets.

    With ``curve_server_key`` (a coordinator's ``curve_public_key``) each peer is a
    CURVE client with a fresh key pair.
    """
    async with AsyncExitStack() as stack:
        context = await stack.enter_async_context(open_context())
        context.set(zmq.MAX_SOCKETS, 2 * count + 64)  # libzmq's default allows 1,023
        security = curve_client_options(curve_server_key)
        peers = []
        for index in range(first_index, first_index + count):
            sub = await stack.enter_async_context(
                open_socket(
                    context,
                    zmq.XSUB,
                    connect=input_address,
                    options={
                        zmq.IDENTITY: protocol.engine_identity(index),
                        zmq.LINGER: 0,
                        **security,
                    },
                )
            )
            push = await stack.enter_async_context(
                open_socket(
                    context,
                    zmq.PUSH,
                    connect=output_address,
                    options={zmq.LINGER: 0, **security},
                )
            )
            peer = EnginePeer(index, sub, push)
            if subscribe:
                await peer.subscribe()
            peers.append(peer)
        yield peers


async def expect_broadcast(
    peers: Sequence[EnginePeer], frames: Sequence[bytes], *, skip_ready: bool = False
) -> None:
    """Every engine receives exactly ``frames`` as its next broadcast (AssertionError
    naming the engine if not). With ``skip_ready``, READY broadcasts in front of it are
    passed over (a late subscription makes the coordinator send READY again)."""
    expected = list(frames)
    for peer in peers:
        received = await peer.next_broadcast_frames()
        while skip_ready and received == [protocol.READY] and expected != [protocol.READY]:
            received = await peer.next_broadcast_frames()
        if received != expected:
            raise AssertionError(
                f"engine {peer.index} received {received!r}, expected {expected!r}"
            )


@asynccontextmanager
async def open_coordinator_with_engines(
    engine_count: int, **options: Any
) -> AsyncIterator[tuple[Coordinator, list[EnginePeer]]]:
    """An in-process coordinator (``open_coordinator(engine_count, **options)``) and
    ``engine_count`` engine peers connected to it, yielded once the gate has opened and
    every engine has received READY: so the next broadcast an engine sees is the first
    one its test caused."""
    async with open_coordinator(engine_count, **options) as coordinator:
        async with connect_engines(
            coordinator.back_publish_address, coordinator.back_output_address, engine_count
        ) as engines:
            await coordinator.wait_ready()
            await expect_broadcast(engines, [protocol.READY])
            yield coordinator, engines


def inject_coordinator_failure(coordinator: Coordinator, where: str = "timer") -> None:
    """Make ``coordinator``'s service fail as a broken invariant of our own would: an
    ``AssertionError`` raised in one of its pumps, under its lock. ``where``: ``"timer"``
    (at once) or ``"engine_output"`` (as the listener applies the next batch of engine
    messages; the batch's first message is lost with the failure, the rest applied).

    With ``open_coordinator(..., restart=True)`` (the default) the service restarts in
    place and ``coordinator.restarts()`` counts it (docs/protocol.md §16); with
    ``restart=False`` the block ends with :class:`~trio_dpcoord.CoordinatorError`.
    """
    inject_failure(coordinator._pumps, where)


# --------------------------------------------------------------------------- serve


def serve_command(*options: str) -> list[str]:
    """The command line of ``python -m trio_dpcoord serve`` with ``options``, run by this
    very interpreter (so the child imports the same ``trio_dpcoord``)."""
    return [sys.executable, "-m", "trio_dpcoord", "serve", *options]


def parse_endpoints(line: str | bytes) -> dict[str, str]:
    """The endpoints from serve's first stdout line (``{"front": ..., "back_pub": ...,
    "back_out": ...}``, plus ``curve_public_key`` with CURVE); ValueError if it is not
    such a line."""
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not (
        isinstance(record, dict)
        and all(isinstance(value, str) for value in record.values())
        and all(key in record for key in _ENDPOINT_KEYS)
    ):
        raise ValueError(f"not an endpoints line of trio-dpcoord serve: {line!r}")
    return record


async def read_lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[str]:
    """The lines of ``stream`` as they come (decoded, newline stripped), the last one even
    without its newline."""
    pending = b""
    async for chunk in stream:
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.decode(errors="replace")
    if pending:
        yield pending.decode(errors="replace")


class ServeProcess:
    """A running ``serve`` child (see :func:`open_serve`), or any program run with
    :func:`open_child`: its endpoints, the lines of its stdout and its stderr, read as
    they come."""

    def __init__(self, process: trio.Process, stderr_line: Callable[[str], None] | None) -> None:
        self.process = process
        #: the endpoints line, parsed (see :func:`parse_endpoints`)
        self.endpoints: dict[str, str] = {}
        self.stdout_lines: list[str] = []
        #: everything it wrote on stderr, unless ``stderr_line`` takes it line by line
        self.stderr = ""
        self._stderr_line = stderr_line
        self._open_streams = 2
        self._changed = trio.lowlevel.ParkingLot()

    @property
    def final_counters(self) -> dict[str, Any] | None:
        """The counters of the line serve writes last on a clean exit, or None (not yet
        exited, or not cleanly)."""
        if not self.stdout_lines:
            return None
        try:
            record = json.loads(self.stdout_lines[-1])
        except ValueError:
            return None
        if isinstance(record, dict) and isinstance(record.get("counters"), dict):
            counters: dict[str, Any] = record["counters"]
            return counters
        return None

    async def line(self, index: int) -> str:
        """Stdout line ``index`` (0 is the endpoints line), once it has been written."""
        await self._wait(lambda: len(self.stdout_lines) > index, f"stdout line {index}")
        return self.stdout_lines[index]

    async def logged(self, text: str, times: int = 1) -> None:
        """Return once ``text`` appeared on stderr ``times`` times (not with ``stderr_line``)."""
        await self._wait(lambda: self.stderr.count(text) >= times, f"logging {text!r} x{times}")

    async def stop(self, signum: int = signal.SIGTERM) -> int:
        """Send ``signum``; return the exit status once all its output has been read."""
        self.process.send_signal(signum)
        await self.process.wait()
        await self._wait(lambda: self._open_streams == 0, "closing its output")
        assert self.process.returncode is not None
        return self.process.returncode

    async def _pump(self, stream: trio.abc.ReceiveStream, on_line: Callable[[str], None]) -> None:
        async with stream:
            async for line in read_lines(stream):
                on_line(line)
                self._changed.unpark_all()
        self._open_streams -= 1
        self._changed.unpark_all()

    def _stdout(self, line: str) -> None:
        self.stdout_lines.append(line)

    def _stderr(self, line: str) -> None:
        if self._stderr_line is None:
            self.stderr += line + "\n"
        else:
            self._stderr_line(line.rstrip())

    async def _wait(self, predicate: Callable[[], bool], what: str) -> None:
        while not predicate():
            if self._open_streams == 0:
                status = await self.process.wait()
                raise RuntimeError(
                    f"{self.process.args!r} exited (status {status}) before {what}; "
                    f"stderr:\n{self.stderr[-4000:]}"
                )
            await self._changed.park()

    async def _terminate(self, grace: float) -> None:
        """SIGTERM, up to ``grace`` s to exit and finish its output, then SIGKILL; reaped."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace):
            await self.process.wait()
            while self._open_streams:
                await self._changed.park()
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()


@asynccontextmanager
async def open_child(
    command: Sequence[str],
    *,
    stderr_line: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
    stop_grace: float = 5.0,
) -> AsyncIterator[ServeProcess]:
    """Run ``command`` for the duration of the block, its output read as it comes.

    For ``serve`` (see :func:`open_serve`) and any program that announces itself on
    stdout (the examples). Its stderr goes line by line to ``stderr_line`` if given, else
    into :attr:`ServeProcess.stderr`. It runs in its own session (a terminal's Ctrl-C
    reaches only the caller) with its stdin a pipe held by the caller. On exit, if still
    running, it gets SIGTERM and ``stop_grace`` s to finish its output and exit, then
    SIGKILL; it is always reaped, cancellation included.
    """
    process = await trio.lowlevel.open_process(
        list(command),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    child = ServeProcess(process, stderr_line)
    try:
        assert process.stdout is not None and process.stderr is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child._pump, process.stdout, child._stdout)
            nursery.start_soon(child._pump, process.stderr, child._stderr)
            try:
                yield child
            finally:
                with trio.CancelScope(shield=True):
                    await child._terminate(stop_grace)
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:  # the pumps failed: never orphan it
                process.kill()
            await process.wait()
            if process.stdin is not None:
                await process.stdin.aclose()


@asynccontextmanager
async def open_serve(
    *options: str,
    ready_timeout: float | None = None,
    stderr_line: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
    stop_grace: float = 5.0,
    prefix: Sequence[str] = (),
) -> AsyncIterator[ServeProcess]:
    """``python -m trio_dpcoord serve`` with ``options``, for the duration of the block.

    Yields once the endpoints line is read (``trio.TooSlowError`` after
    ``ready_timeout`` s; RuntimeError if it exits first). With ``--exit-on-stdin-eof``
    it also stops if the caller dies. On exit, if still running, it gets SIGTERM and
    ``stop_grace`` s to write its counters line (:attr:`ServeProcess.final_counters`)
    and exit, then SIGKILL (see :func:`open_child`). ``prefix`` runs it through a command
    such as ``ip netns exec NAME`` (which must exec it, so that signals reach it).
    """
    async with open_child(
        [*prefix, *serve_command(*options)], stderr_line=stderr_line, env=env, stop_grace=stop_grace
    ) as serve:
        with trio.fail_after(math.inf if ready_timeout is None else ready_timeout):
            serve.endpoints = parse_endpoints(await serve.line(0))
        yield serve
