"""``TRIO_DPCOORD_VLLM=1`` through vLLM 0.33.0's own launch code, torch-free.

Each test runs ``tests/vllm_reference/runners/switch.py`` in a vLLM import root (vLLM's
real source, stand-ins only for torch-bound modules) with this project installed, so
vLLM's real ``load_general_plugins()`` finds our ``vllm.general_plugins`` entry point. The
runner says what runs for real and what stands in; this side plays the DP engines
(vLLM's startup handshake, then the coordinator sockets) and a front-end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import zmq

from tests.vllm_reference import (
    RUNNERS_DIR,
    VLLM_VERSION,
    VllmUnavailable,
    prepare_import_root,
    runner_command,
    vllm_env,
)
from trio_dpcoord import Frontend, open_frontend, protocol
from trio_dpcoord.protocol import engine_identity
from trio_dpcoord.testing import EnginePeer, connect_engines, read_lines
from trio_dpcoord.trio_zmq import AsyncSocket, open_context, open_socket
from trio_dpcoord.vllm import ENABLE_VARIABLE, SUPERVISE_VARIABLE, verified_vllm_version

pytestmark = pytest.mark.vllm

RUNNER = RUNNERS_DIR / "switch.py"
OURS = "trio_dpcoord.vllm.run_coordinator"
VLLMS = "vllm.v1.engine.coordinator.DPCoordinatorProc.run_coordinator"
TIMEOUT = 120  # a loaded 2-core machine; vLLM's imports alone take a second or two


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Runner:
    """The runner process: its JSON events in order, its stderr (vLLM's logs and ours)."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.events: list[dict[str, Any]] = []
        self.stderr = ""
        self._read = 0
        self._open_streams = 2
        self._changed = trio.lowlevel.ParkingLot()

    async def _pump(self, stream: trio.abc.ReceiveStream, is_stdout: bool) -> None:
        async for line in read_lines(stream):
            if is_stdout:
                self.events.append(json.loads(line))
            else:
                self.stderr += line + "\n"
            self._changed.unpark_all()
        self._open_streams -= 1
        self._changed.unpark_all()

    async def _wait(self, predicate: Callable[[], bool], what: str) -> None:
        while not predicate():
            if self._open_streams == 0:
                raise AssertionError(
                    f"the runner exited (status {self.process.returncode}) before {what}; "
                    f"events {self.events}; stderr:\n{self.stderr}"
                )
            await self._changed.park()

    async def next_event(self, expected: str) -> dict[str, Any]:
        """The next event, which must be ``expected`` (events are asserted in order)."""
        await self._wait(lambda: len(self.events) > self._read, f"event {expected!r}")
        event = self.events[self._read]
        self._read += 1
        assert event["event"] == expected, (event, self.stderr)
        return event

    async def logged(self, text: str, times: int = 1) -> None:
        """Wait until ``text`` is in the stderr read so far, ``times`` times at least."""
        await self._wait(lambda: self.stderr.count(text) >= times, f"logging {text!r} x{times}")

    async def command(self, text: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(text.encode() + b"\n")

    async def finished(self) -> int:
        await self.process.wait()
        await self._wait(lambda: self._open_streams == 0, "closing its output")
        assert self.process.returncode is not None
        return self.process.returncode


@asynccontextmanager
async def run_switch(
    root: Path, mode: str, config: dict[str, Any], env: Mapping[str, str]
) -> AsyncIterator[Runner]:
    """The runner in ``mode`` for the duration of the block; killed and reaped on exit.

    ``env``: variables set over vLLM's test environment, which never opts in by itself.
    """
    full_env = vllm_env(root)
    full_env.pop(ENABLE_VARIABLE, None)
    full_env.update(env)
    process = await trio.lowlevel.open_process(
        runner_command(RUNNER, mode, json.dumps(config)),
        env=full_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    runner = Runner(process)
    try:
        assert process.stdout is not None and process.stderr is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner._pump, process.stdout, True)
            nursery.start_soon(runner._pump, process.stderr, False)
            try:
                yield runner
            finally:
                if process.returncode is None:
                    process.kill()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            await process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    await stream.aclose()


class HeadlessEngine:
    """One remote, headless DP engine's side of vLLM's startup handshake (a DEALER with
    its rank as identity, msgpack maps), as ``EngineCoreProc`` speaks it."""

    def __init__(self, rank: int, socket: AsyncSocket) -> None:
        self.rank = rank
        self.socket = socket

    async def hello(self) -> dict[str, Any]:
        """Send HELLO; return the handshake metadata vLLM answers with."""
        await self.socket.send(msgpack.packb({"status": "HELLO", "local": False, "headless": True}))
        metadata: dict[str, Any] = msgpack.unpackb(await self.socket.recv())
        return metadata

    async def ready(self, parallel_config_hash: str) -> None:
        await self.socket.send(
            msgpack.packb(
                {
                    "status": "READY",
                    "local": False,
                    "headless": True,
                    "parallel_config_hash": parallel_config_hash,
                }
            )
        )


@asynccontextmanager
async def headless_engines(port: int, count: int) -> AsyncIterator[list[HeadlessEngine]]:
    async with AsyncExitStack() as stack:
        context = await stack.enter_async_context(open_context())
        engines = []
        for rank in range(count):
            dealer = await stack.enter_async_context(
                open_socket(
                    context,
                    zmq.DEALER,
                    connect=f"tcp://127.0.0.1:{port}",
                    options={zmq.IDENTITY: engine_identity(rank)},
                )
            )
            engines.append(HeadlessEngine(rank, dealer))
        yield engines


async def start_engines(
    runner: Runner, rpc_port: int, count: int, stack: AsyncExitStack
) -> tuple[dict[str, Any], list[EnginePeer]]:
    """Through vLLM's real startup: HELLO, connect to the coordinator it names, READY.

    Returns the ``launched`` event and the engines' coordinator sockets; the runner has
    reported ``started`` (``wait_for_engine_startup`` returned).
    """
    launched = await runner.next_event("launched")
    handshakes = await stack.enter_async_context(headless_engines(rpc_port, count))
    for engine in handshakes:
        addresses = (await engine.hello())["addresses"]
        # what DPCoordinator reported through its pipe reaches EngineZmqAddresses, and
        # from there every engine
        assert addresses["coordinator_input"] == launched["coordinator_input"]
        assert addresses["coordinator_output"] == launched["coordinator_output"]
        assert addresses["frontend_stats_publish_address"] == launched["front"]
    peers = await stack.enter_async_context(
        connect_engines(launched["coordinator_input"], launched["coordinator_output"], count)
    )
    for peer in peers:
        assert await peer.next_broadcast() == "READY"
    for engine in handshakes:
        await engine.ready(launched["parallel_config_hash"])
    await runner.next_event("started")
    return launched, peers


def has_load(engine: int, waiting: int, running: int) -> Callable[[Frontend], bool]:
    """Whether the front-end's last published counts give ``engine`` this load."""

    def check(frontend: Frontend) -> bool:
        loads = frontend.engine_loads()
        return len(loads) > engine and tuple(loads[engine])[:2] == (waiting, running)

    return check


def launch_config(is_moe: bool = True) -> dict[str, Any]:
    return {"engines": 2, "rpc_port": free_tcp_port(), "is_moe": is_moe}


@pytest.mark.parametrize(
    ("is_moe", "start_method", "supervised"),
    [(True, "fork", True), (False, "spawn", False)],
    ids=["moe-fork-supervised", "dense-spawn-unsupervised"],
)
async def test_switched_on_vllm_launches_our_coordinator_and_shuts_it_down(
    launch_root: Path, is_moe: bool, start_method: str, supervised: bool
) -> None:
    """Supervised is the default (the process vLLM starts runs the coordinator as a
    worker, docs/protocol.md §16); ``TRIO_DPCOORD_VLLM_SUPERVISED=0`` runs it in that
    process. vLLM sees the same coordinator either way."""
    config = launch_config(is_moe)
    env = {ENABLE_VARIABLE: "1", "VLLM_WORKER_MULTIPROC_METHOD": start_method}
    if not supervised:
        env[SUPERVISE_VARIABLE] = "0"
    with trio.fail_after(TIMEOUT):
        async with run_switch(launch_root, "launch", config, env) as runner:
            assert (await runner.next_event("plugins"))["target"] == OURS
            async with AsyncExitStack() as stack:
                launched, peers = await start_engines(runner, config["rpc_port"], 2, stack)
                # vLLM's choice of transport, bound as asked: engines are remote (tcp on
                # the master ip, port resolved), front-ends local (ipc)
                assert launched["coordinator_input"].startswith("tcp://127.0.0.1:")
                assert not launched["coordinator_input"].endswith(":0")
                assert launched["front"].startswith("ipc://")
                frontend = await stack.enter_async_context(open_frontend(launched["front"]))
                # engine 0 got a request while paused: it starts wave 0 and the others join
                await peers[0].start_wave(0)
                if is_moe:
                    assert await peers[1].next_broadcast() == protocol.StartDPWave(0, 0)
                    await frontend.wait_for(lambda f: f.snapshot().engines_running)
                    await peers[0].wave_complete(0)
                    await frontend.wait_for(lambda f: not f.snapshot().engines_running)
                    assert frontend.snapshot().current_wave == 1
                await peers[1].stats(waiting=3, running=1, wave=frontend.snapshot().current_wave)
                await frontend.wait_for(has_load(1, waiting=3, running=1))
                if not is_moe:
                    # vLLM asked for no wave coordination: the start was ignored
                    assert frontend.snapshot().current_wave == 0
                    assert not frontend.snapshot().engines_running
            await runner.logged(
                "trio_dpcoord DP coordinator serving 2 engines"
                + (", supervised" if supervised else "")
                + (" (wave coordination on)" if is_moe else " (wave coordination off)")
            )
            await runner.command("shutdown")
            assert (await runner.next_event("shutdown"))["exitcode"] == 0
            assert await runner.finished() == 0
    assert "TRIO_DPCOORD_VLLM=1: vLLM 0.33.0 will run trio_dpcoord's DP coordinator" in (
        runner.stderr
    )
    assert "SIGTERM received: stopping" in runner.stderr
    assert "Traceback" not in runner.stderr
    # in vLLM's format, naming our file from the package down (vLLM has a vllm.py too)
    serving = [line for line in runner.stderr.splitlines() if "DP coordinator serving" in line]
    assert len(serving) == 1 and "[trio_dpcoord/vllm/" in serving[0], serving
    # libzmq leaves a closed ipc socket's file behind; ours removes its own
    assert not Path(launched["front"].removeprefix("ipc://")).exists()


async def test_switched_off_vllm_runs_its_own_coordinator(launch_root: Path) -> None:
    config = launch_config()
    with trio.fail_after(TIMEOUT):
        async with run_switch(launch_root, "launch", config, {}) as runner:
            assert (await runner.next_event("plugins"))["target"] == VLLMS
            async with AsyncExitStack() as stack:
                _, peers = await start_engines(runner, config["rpc_port"], 2, stack)
                await peers[0].start_wave(0)
                assert await peers[1].next_broadcast() == protocol.StartDPWave(0, 0)
            await runner.command("shutdown")
            # vLLM's own coordinator dies of the SIGTERM (ours exits 0: see the README)
            assert (await runner.next_event("shutdown"))["exitcode"] == -signal.SIGTERM
            assert await runner.finished() == 0
    assert "trio_dpcoord" not in runner.stderr


@pytest.mark.parametrize(
    ("env", "warning"),
    [
        ({ENABLE_VARIABLE: "0"}, None),
        ({ENABLE_VARIABLE: ""}, None),
        ({ENABLE_VARIABLE: "yes"}, "TRIO_DPCOORD_VLLM='yes' is ignored: set it to 1"),
        ({ENABLE_VARIABLE: "1", "VLLM_PLUGINS": "some_other_plugin"}, None),
    ],
    ids=["zero", "empty", "not-one", "not-allow-listed"],
)
async def test_without_the_opt_in_nothing_changes(
    launch_root: Path, env: dict[str, str], warning: str | None
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_switch(launch_root, "plugins", {}, env) as runner:
            assert (await runner.next_event("plugins"))["target"] == VLLMS
            assert await runner.finished() == 0
    if warning is None:
        assert "trio_dpcoord" not in runner.stderr and "TRIO_DPCOORD" not in runner.stderr
    else:
        assert warning in runner.stderr


# A vLLM that calls itself 0.34.0; a 0.33 whose coordinator target takes other parameters.
OTHER_VERSION = "__version__ = '0.34.0'\n__version_tuple__ = (0, 34, 0)\n"
OTHER_TARGET = (
    "class DPCoordinatorProc:\n"
    "    @staticmethod\n"
    "    def run_coordinator(engine_count, addresses, zmq_addr_pipe=None):\n"
    "        raise AssertionError('never started here')\n"
)


@pytest.mark.parametrize(
    ("standin", "warning"),
    [
        ({"vllm.version": OTHER_VERSION}, "TRIO_DPCOORD_VLLM=1 has no effect on vLLM 0.34.0"),
        (
            {"vllm.v1.engine.coordinator": OTHER_TARGET},
            "TRIO_DPCOORD_VLLM=1 has no effect: vLLM 0.33.0's DPCoordinatorProc.run_coordinator "
            "takes engine_count, addresses, zmq_addr_pipe",
        ),
    ],
    ids=["version", "parameters"],
)
async def test_an_unverified_vllm_keeps_its_own_coordinator(
    standin: dict[str, str], warning: str
) -> None:
    try:
        root = prepare_import_root(modules=standin)
    except VllmUnavailable as error:
        pytest.skip(f"vLLM {VLLM_VERSION}'s wheel cannot be had: {error}")
    with trio.fail_after(TIMEOUT):
        async with run_switch(root, "plugins", {}, {ENABLE_VARIABLE: "1"}) as runner:
            assert (await runner.next_event("plugins"))["target"] == VLLMS
            assert await runner.finished() == 0
    assert any("WARNING" in line and warning in line for line in runner.stderr.splitlines())


def test_verified_versions() -> None:
    for version in ("0.33.0", "0.33.4", "0.33.0+cu128", "0.33.1+rocm6.4", "0.32.0", "0.32.0+cpu"):
        assert verified_vllm_version(version), version
    for version in ("0.31.2", "0.34.0", "1.33.0", "0.33", "0.32.0rc1", "0.33.1.dev3+g1", "dev"):
        assert not verified_vllm_version(version), version


async def test_a_coordinator_killed_during_startup_fails_it(launch_root: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_switch(
            launch_root, "launch", launch_config(), {ENABLE_VARIABLE: "1"}
        ) as runner:
            await runner.next_event("plugins")
            launched = await runner.next_event("launched")
            # no engine ever connects: vLLM's startup is waiting for them
            os.kill(launched["pid"], signal.SIGKILL)
            failed = await runner.next_event("startup_failed")
            assert await runner.finished() == 0
    # vLLM's startup watch saw the coordinator's sentinel. (Its message names the process
    # only if the exit status is already reapable when it looks, which is a race.)
    assert failed["error"].startswith("RuntimeError: Engine core initialization failed.")
    assert failed["exitcode"] == -signal.SIGKILL


async def test_a_coordinator_that_cannot_bind_fails_startup(
    launch_root: Path, tmp_path: Path
) -> None:
    # vLLM puts the front-end socket at an ipc path under VLLM_RPC_BASE_PATH
    missing = tmp_path / "missing"
    env = {ENABLE_VARIABLE: "1", "VLLM_RPC_BASE_PATH": str(missing)}
    with trio.fail_after(TIMEOUT):
        async with run_switch(launch_root, "launch", launch_config(), env) as runner:
            await runner.next_event("plugins")
            failed = await runner.next_event("startup_failed")
            assert await runner.finished() == 0
    assert failed["error"] == "RuntimeError: DP Coordinator process failed during startup."
    assert failed["exitcode"] is None  # DPCoordinator's constructor itself failed
    assert f"cannot bind the front socket to 'ipc://{missing}/" in runner.stderr


async def test_a_coordinator_killed_later_is_reported_by_vllms_monitor(
    launch_root: Path,
) -> None:
    config = launch_config()
    with trio.fail_after(TIMEOUT):
        async with run_switch(launch_root, "launch", config, {ENABLE_VARIABLE: "1"}) as runner:
            await runner.next_event("plugins")
            async with AsyncExitStack() as stack:
                launched, _ = await start_engines(runner, config["rpc_port"], 2, stack)
                await runner.command("monitor")
                await runner.logged("Waiting for API servers to complete")
                os.kill(launched["pid"], signal.SIGKILL)
                failed = await runner.next_event("monitor_failed")
            assert await runner.finished() == 0
    # vLLM's message has the exit status only if it is reapable when it looks (a race)
    assert failed["error"].startswith(
        f"RuntimeError: Process VLLM_DP_Coordinator (PID: {launched['pid']}) died with exit code "
    )
    assert failed["exitcode"] == -signal.SIGKILL


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
async def test_run_coordinator_binds_where_asked_and_reports_in_vllms_order(
    launch_root: Path, tmp_path: Path, start_method: str
) -> None:
    front = f"ipc://{tmp_path}/front"
    config = {
        "engines": 2,
        "front": front,
        "back_output": "tcp://127.0.0.1:0",
        "back_publish": "tcp://127.0.0.1:0",
        "wave_coordination": True,
    }
    env = {"VLLM_WORKER_MULTIPROC_METHOD": start_method}
    with trio.fail_after(TIMEOUT):
        async with run_switch(launch_root, "direct", config, env) as runner:
            reported = (await runner.next_event("addresses"))["addresses"]
            # (front_publish, back_output, back_publish), ports resolved, ipc as given
            assert reported[0] == front
            assert reported[1].startswith("tcp://127.0.0.1:") and reported[1] != "tcp://127.0.0.1:0"
            assert reported[2].startswith("tcp://127.0.0.1:") and reported[2] != reported[1]
            async with connect_engines(reported[2], reported[1], 2) as peers:
                for peer in peers:
                    assert await peer.next_broadcast() == "READY"
                async with open_frontend(reported[0]) as frontend:
                    await peers[0].stats(waiting=2, running=5)
                    await frontend.wait_for(has_load(0, waiting=2, running=5))
            await runner.command("terminate")
            assert (await runner.next_event("exited"))["exitcode"] == 0
            assert await runner.finished() == 0


async def test_run_coordinator_that_cannot_bind_exits_1_without_reporting(
    launch_root: Path, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        config = {
            "engines": 1,
            "front": f"ipc://{tmp_path}/front",
            "back_output": "tcp://127.0.0.1:0",
            "back_publish": address,
            "wave_coordination": True,
        }
        with trio.fail_after(TIMEOUT):
            async with run_switch(launch_root, "direct", config, {}) as runner:
                assert (await runner.next_event("pipe_closed"))["exitcode"] == 1
                assert await runner.finished() == 0
    assert f"cannot bind the engine broadcast socket to {address!r}" in runner.stderr
