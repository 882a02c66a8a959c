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
<<<<<<< HEAD
    "PURE_TWIN_PACKAGE",
    "CoordinatorPumps",
    "CoreInternals",
=======
>>>>>>> main
    "EnginePeer",
    "HotPath",
    "ServeProcess",
<<<<<<< HEAD
    "VllmPeerRoutes",
    "compiled_twins",
=======
>>>>>>> main
    "connect_engines",
    "expect_broadcast",
<<<<<<< HEAD
    "force_wave_state",
    "hot_path",
=======
>>>>>>> main
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
<<<<<<< HEAD


# --------------------------------------------------------------------------- test hooks
# What only a test needs to see or change inside the package's rooms. They reach past
# the rooms' public reads on purpose, here and nowhere else, so that tests need no private
# module or attribute; real code has no use for them.


class CoreInternals(NamedTuple):
    """What a :class:`~trio_dpcoord.core.CoordinatorCore` decides with beyond its public
    reads (see :func:`core_internals`): what a model checker memoises states by, and what
    two cores fed the same inputs two ways must agree on."""

    first_request_pending: bool
    """A wake-up was claimed and its :class:`~trio_dpcoord.core.FirstRequest` not applied."""
    unconfirmed_wave: int | None
    """The wave a first request started that no engine has reported on yet."""
    deferred: tuple[Effect, ...]
    """Effects decided before the start-up gate opened: they come out behind READY."""
    deferred_commands: tuple[Command, ...]
    """Commands received before the gate opened: applied behind READY."""
    pending_snapshot: tuple[protocol.EngineLoad, ...] | None
    """The load table's lock-step snapshot, waiting for the next timed publish."""
    stats_changed: bool
    """Whether the load table has news for the next timed publish."""
    recovering: bool
    """The core took over from a dead coordinator and the engines have not settled it."""
    recovery_wake_owed: bool | None
    """While recovering: whether the recovery wake is still to go out (None otherwise)."""


def core_internals(core: CoordinatorCore) -> CoreInternals:
    """A copy of ``core``'s private decision state (:class:`CoreInternals`); read-only."""
    wave, loads = core._wave, core._loads
    return CoreInternals(
        wave.first_request_pending,
        wave.unconfirmed_wave,
        tuple(core._deferred),
        tuple(core._deferred_commands),
        loads.pending_snapshot,
        loads.stats_changed,
        core._recovery is not None,
        None if core._recovery is None else core._recovery.wake_owed,
    )


def replace_wave_rule(core: CoordinatorCore, rule: WaveState) -> None:
    """Make ``rule`` ``core``'s wave rule, in place of the :class:`~trio_dpcoord.core.
    WaveState` it made itself: for a model checker's mutants (a subclass with a known bug
    the checker must catch). Call it before the core's first input."""
    core._wave = rule


def replace_recovery_rules(core: CoordinatorCore, rules: type[RecoveryRules]) -> None:
    """Make a recovering ``core`` follow ``rules`` (a subclass of
    :class:`~trio_dpcoord.core.RecoveryRules` with the same slots, a model checker's mutant
    with a known bug) from now on; nothing when the core is not recovering."""
    if core._recovery is not None:
        core._recovery.__class__ = rules


def force_wave_state(
    rule: WaveState,
    *,
    snapshot: WaveSnapshot | None = None,
    first_request_pending: bool | None = None,
) -> None:
    """Overwrite ``rule``'s snapshot and/or pending claim (what is not None), as a broken
    rule would: the bug of a model checker's mutant. Nothing checks the rule's invariants
    (the wave may go back)."""
    if snapshot is not None:
        rule._snapshot = snapshot
    if first_request_pending is not None:
        rule._first_request_pending = first_request_pending


def coordinator_pumps(coordinator: Coordinator) -> CoordinatorPumps:
    """The :class:`CoordinatorPumps` behind a running coordinator's handle: the core, its
    lock, and the channel to the broadcaster (``outgoing``), for a test that breaks an
    invariant of the shell on purpose. A test that wants the pumps without sockets makes
    its own, ``CoordinatorPumps(core)``, and starts the tasks it needs."""
    return coordinator._pumps


# --- the prefix policy's inside, for the tests that compare it with its references --------


def prefix_walks(
    router: PrefixRouter, keys: Sequence[int]
) -> tuple[list[tuple[int, int]] | None, list[tuple[int, int]]]:
    """The two ways ``router`` finds which ranks hold how much of ``keys``: its bisecting
    walk (None unless the indexes are prefix-closed, the approximate feed's case, when
    it is the one used) and the block-by-block walk. They must agree; read-only."""
    bisected = router._bisect(keys) if router._closed else None
    return bisected, router._walk_blocks(keys)


def prefix_walk_of_prompt(
    router: PrefixRouter, token_ids: Sequence[int]
) -> tuple[list[tuple[int, int]], int]:
    """The walk :meth:`PrefixRouter.route` makes for ``token_ids`` (with prefix-closed
    indexes, over the keys its chunk cache knows and the rest on demand), and how many
    of the prompt's blocks it keyed; read-only (a copy of the router's chunk cache)."""
    cache = copy.copy(router._keys)
    cache._chunks = dict(router._keys._chunks)
    keys = cache.lookup(token_ids) if router._closed else cache(token_ids)
    groups = router._walk(keys if router._closed else list(keys))
    return groups, keys.known


def use_chain_mode(index: RankPrefixIndex) -> None:
    """Switch ``index`` to the layout the approximate feed keeps it in (its LRU order in
    pieces of a chain): for tests that drive an index alone. Before its first store."""
    index._chain_mode()


def store_as_the_router(index: RankPrefixIndex, keys: Sequence[int], held: int, now: float) -> bool:
    """Store a prompt's ``keys`` as the router does after its walk found ``held`` of them
    cached (chain mode only; False, storing nothing, in the plain layout)."""
    if index._held is None:
        return False
    index._store_chain(keys, held, now)
    return True


def coordinator_ingest_paths() -> dict[str, Callable[[bytes], tuple[Any, ...] | None]]:
    """The two paths of the coordinator's ingest decoder (``msgpack``, ``msgspec``): a
    stats report's ``(engine_index, waiting, running, kv_cache_usage, wave, step)``, or
    None for a frame left to :func:`~trio_dpcoord.protocol.decode_coordinator_output`."""
    from .protocol import _output_decoder

    return {
        "msgpack": _output_decoder.ingest_with_msgpack,
        "msgspec": _output_decoder.ingest_with_msgspec,
    }


# --- the compiled twins and their pure-Python spec, side by side ---------------------------

PURE_TWIN_PACKAGE = "trio_dpcoord._pure_twin"
"""Where :func:`hot_path` loads the pure twin's modules (fresh copies of the sources)."""

_TWIN_MODULES = (
    "routing._keys",
    "routing._prefix_index",
    "routing._prefix_router",
    "routing._chooser",
)
"""The accelerated modules and those that use them, each after those it imports."""


class HotPath(NamedTuple):
    """The prefix policy's hashing and what is built on it, from one build."""

    block_keys: Callable[..., list[int]]
    chunk_hashes: Callable[..., Any]
    ChunkKeys: Any
    PrefixRouter: Any
    EngineChooser: Any


def compiled_twins() -> dict[str, tuple[bool, bool]]:
    """Each compiled twin's module -> (built here, in use in this process)."""
    import importlib.util

    from ._compiled import kernels_in_use

    return {
        name: (importlib.util.find_spec(name) is not None, in_use)
        for name, in_use in kernels_in_use().items()
    }


def hot_path(pure: bool) -> HotPath:
    """The package's own names (``pure=False``: the compiled twins' where in use), or the
    pure-Python twin's (``pure=True``): the modules loaded again from their ``.py`` source
    under :data:`PURE_TWIN_PACKAGE`, never accelerated, so that a differential test runs
    both builds in one process. The twin's modules import each other; anything else
    they import is the package's own (both builds share the value classes)."""
    import importlib
    import importlib.util
    from pathlib import Path

    from ._compiled import PURE_TWIN_FLAG

    modules = {name: importlib.import_module(f"trio_dpcoord.{name}") for name in _TWIN_MODULES}
    if pure:
        for real in list(sys.modules):  # the package's other modules, under the twin's names
            inside = real.removeprefix("trio_dpcoord")
            ours = real.split(".")[0] == "trio_dpcoord" and not real.startswith(PURE_TWIN_PACKAGE)
            if ours and inside.lstrip(".") not in _TWIN_MODULES:
                sys.modules.setdefault(PURE_TWIN_PACKAGE + inside, sys.modules[real])
        root = Path(__file__).parent
        for name in _TWIN_MODULES:
            full = f"{PURE_TWIN_PACKAGE}.{name}"
            twin = sys.modules.get(full)
            if twin is None or not getattr(twin, PURE_TWIN_FLAG, False):
                path = root / (name.replace(".", "/") + ".py")
                spec = importlib.util.spec_from_file_location(full, path)
                assert spec is not None and spec.loader is not None
                twin = importlib.util.module_from_spec(spec)
                setattr(twin, PURE_TWIN_FLAG, True)
                sys.modules[full] = twin
                spec.loader.exec_module(twin)
            modules[name] = twin
    keys = modules["routing._keys"]
    return HotPath(
        keys.block_keys,
        keys.chunk_hashes,
        keys.ChunkKeys,
        modules["routing._prefix_router"].PrefixRouter,
        modules["routing._chooser"].EngineChooser,
    )
=======
>>>>>>> main
