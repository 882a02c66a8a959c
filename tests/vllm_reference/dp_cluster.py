"""A DP cluster of vLLM's real engine processes and front-end, around a coordinator.

Pytest's side (no vLLM import here): starts the lock-step collective host (our
:class:`trio_dpcoord.sim.collective.CollectiveHost`) in this process, N engine processes
(``engine_side.py``), the front-end process (``frontend_side.py``) and a coordinator
(a callable given by the test: ours, vLLM's, or a broken one), waits for the front-end's
scenario to end, stops the engines with SIGTERM (vLLM's clean shutdown) and returns every
process's report plus the verdict of the pass criteria (:func:`failures`).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import zipfile
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import zmq

from tests.vllm_reference import prepare_import_root, runner_command, wheel_path
from trio_dpcoord.sim.collective import CollectiveHost
from trio_dpcoord.trio_zmq import open_context, open_socket

HERE = Path(__file__).resolve().parent

CLUSTER_INERT = (
    # third-party packages vLLM imports but these code paths never use
    "cbor2",
    "huggingface_hub",
    "prometheus_client",
    "pybase64",
    "transformers",
    # vLLM modules that need torch or a GPU; engine_side.py stands in for what runs
    "vllm.logging_utils.dump_input",
    "vllm.lora",
    "vllm.tracing",
    "vllm.transformers_utils",
    "vllm.v1.core.kv_cache_planning",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.single_type_kv_cache_manager",
    "vllm.v1.engine.tensor_ipc",
    "vllm.v1.executor",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.structured_output",
)
"""Dotted names the engine and front-end processes' import root makes inert, beyond the
loader's ``DEFAULT_INERT`` (``vllm.config``, ``vllm.distributed``, numpy, ...)."""

CLUSTER_REAL = ("vllm.outputs",)
"""Modules the loader makes inert by default that these processes use for real: a paused
engine rejects a request with ``vllm.outputs.RequestError``."""

CLUSTER_STANDINS = HERE / "cluster_standins"
"""The layer of hand-written stand-ins (``vllm.sampling_params``)."""


def prepare_cluster_root() -> Path:
    """The import root of the engine and front-end processes (cached by the loader)."""
    with zipfile.ZipFile(wheel_path()) as wheel:
        real = {name: wheel.read(name.replace(".", "/") + ".py").decode() for name in CLUSTER_REAL}
    return prepare_import_root(inert=CLUSTER_INERT, layers=[CLUSTER_STANDINS], modules=real)


@dataclass(frozen=True)
class Addresses:
    handshake: str
    frontend_input: str
    frontend_output: str
    collective: str
    coordinator_input: str
    """The coordinator's engine broadcast socket (XPUB; engines' XSUB connect)."""
    coordinator_output: str
    """The coordinator's engine output socket (PULL; engines' PUSH connect)."""
    stats: str
    """The coordinator's front-end socket (XPUB; the front-end's XSUB connects)."""

    @classmethod
    def under(cls, directory: Path) -> Addresses:
        return cls(
            *(
                f"ipc://{directory / name}"
                for name in ("hs", "fe-in", "fe-out", "coll", "co-in", "co-out", "stats")
            )
        )


Coordinator = Callable[[Addresses, int], AbstractAsyncContextManager[Any]]
"""Given the addresses and the engine count, runs a coordinator while entered."""


@dataclass
class Scenario:
    dp_size: int = 2
    bursts: list[dict[str, Any]] = field(default_factory=list)
    dp_sync_interval: int = 32
    requests_at_wave_end: int = 0
    collective_timeout: float = 8.0
    timeout: float = 60.0
    coordinator_delay: float = 0.0
    """Seconds to wait after starting the engines before starting the coordinator."""
    seed: int = 1


@dataclass
class ClusterResult:
    frontend: dict[str, Any]
    engines: list[dict[str, Any]]
    collective_failure: str | None
    collective_rounds: int
    open_rounds: dict[tuple[int, int], tuple[int, ...]]
    """Collective rounds some rank entered and not every rank finished: a stall."""
    logs: dict[str, str]

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {name}\n{text[-chars:]}" for name, text in self.logs.items())


def failures(result: ClusterResult) -> list[str]:
    """The pass criteria: an empty list when the run was healthy."""
    found: list[str] = []
    fe = result.frontend
    if fe.get("exception"):
        found.append(f"front-end exception: {fe['exception'].strip().splitlines()[-1]}")
    if fe.get("handshake") != "all engines READY":
        found.append(f"handshake: {str(fe.get('handshake')).strip()[-300:]}")
    if result.collective_failure:
        found.append(f"collective: {result.collective_failure}")
    elif result.open_rounds:
        found.append(f"collective rounds left open (channel, round) -> ranks: {result.open_rounds}")
    for engine in result.engines:
        if engine.get("exception"):
            last = engine["exception"].strip().splitlines()[-1]
            found.append(f"engine {engine.get('rank')} exception: {last}")
    sent = fe.get("sent", {})
    finished = fe.get("finished", {})
    rejected = set(fe.get("rejected", []))
    for request_id, max_tokens in sent.items():
        reason = finished.get(request_id)
        if reason is None:
            found.append(f"{request_id} never finished")
        elif reason == "LENGTH" and fe["tokens"][request_id] != max_tokens:
            found.append(f"{request_id}: {fe['tokens'][request_id]} of {max_tokens} tokens")
        elif reason not in ("LENGTH", "ABORT") and request_id not in rejected:
            found.append(f"{request_id} finished with {reason}")
    if not sent:
        found.append("the front-end sent no request")
    history = fe.get("wave_history", [])
    if any(later < earlier for earlier, later in itertools.pairwise(history)):
        found.append(f"the front-end saw the wave go backwards: {history}")
    waves = {e.get("current_wave") for e in result.engines}
    if len(waves) != 1 or None in waves:
        found.append(f"engines ended on different waves: {sorted(map(str, waves))}")
    if any(e.get("engines_running") for e in result.engines):
        found.append("an engine ended still running")
    return found


async def _pump(stream: trio.abc.ReceiveStream | None, sink: list[bytes]) -> None:
    if stream is None:
        return
    async for chunk in stream:
        sink.append(bytes(chunk))


@asynccontextmanager
async def _process(
    nursery: trio.Nursery,
    command: list[str],
    env: dict[str, str],
    logs: dict[str, list[bytes]],
    name: str,
) -> AsyncIterator[trio.Process]:
    process = await trio.lowlevel.open_process(
        command, env=env, stdin=None, stdout=None, stderr=subprocess.PIPE
    )
    logs[name] = []
    nursery.start_soon(_pump, process.stderr, logs[name])
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


async def _stop(process: trio.Process, grace: float) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    with trio.move_on_after(grace):
        await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()


async def run_cluster(
    root: Path,
    env: dict[str, str],
    tmp_path: Path,
    coordinator: Coordinator,
    scenario: Scenario,
) -> ClusterResult:
    """Run ``scenario`` on ``scenario.dp_size`` vLLM engines around ``coordinator``."""
    addresses = Addresses.under(tmp_path)
    env = {**env, "PYTHONPATH": os.pathsep.join([str(root), str(HERE)])}
    logs: dict[str, list[bytes]] = {}
    reports = tmp_path / "reports"
    reports.mkdir()
    common = {
        "dp_size": scenario.dp_size,
        "dp_sync_interval": scenario.dp_sync_interval,
        "handshake_address": addresses.handshake,
        "collective_address": addresses.collective,
        "timeout": scenario.collective_timeout,
    }
    frontend_spec = {
        **common,
        "input_address": addresses.frontend_input,
        "output_address": addresses.frontend_output,
        "stats_address": addresses.stats,
        "coordinator_input": addresses.coordinator_input,
        "coordinator_output": addresses.coordinator_output,
        "bursts": scenario.bursts,
        "requests_at_wave_end": scenario.requests_at_wave_end,
        "timeout": scenario.timeout,
        "total_timeout": scenario.timeout * 3,
        "seed": scenario.seed,
        "report_path": str(reports / "frontend.json"),
    }
    host_box: list[CollectiveHost] = []
    async with trio.open_nursery() as nursery:
        async with open_context() as context:
            async with open_socket(context, zmq.ROUTER, bind=addresses.collective) as socket:
                host = CollectiveHost(socket, scenario.dp_size, timeout=scenario.collective_timeout)
                host_box.append(host)
                await nursery.start(host.run)
                async with _run_processes(
                    nursery,
                    env,
                    logs,
                    addresses,
                    scenario,
                    common,
                    frontend_spec,
                    reports,
                    coordinator,
                ):
                    pass
                nursery.cancel_scope.cancel()
    host = host_box[0]
    frontend = _read(reports / "frontend.json", {"exception": "the front-end wrote no report"})
    engines = [
        _read(reports / f"engine-{rank}.json", {"rank": rank, "exception": "no report"})
        for rank in range(scenario.dp_size)
    ]
    return ClusterResult(
        frontend=frontend,
        engines=engines,
        collective_failure=str(host.failure) if host.failure else None,
        collective_rounds=host.completed_rounds,
        open_rounds=host.open_rounds(),
        logs={name: b"".join(chunks).decode(errors="replace") for name, chunks in logs.items()},
    )


@asynccontextmanager
async def _run_processes(
    nursery: trio.Nursery,
    env: dict[str, str],
    logs: dict[str, list[bytes]],
    addresses: Addresses,
    scenario: Scenario,
    common: dict[str, Any],
    frontend_spec: dict[str, Any],
    reports: Path,
    coordinator: Coordinator,
) -> AsyncIterator[None]:
    """The front-end, then the engines, then (after ``coordinator_delay``) the
    coordinator; until the front-end's scenario ends, then the engines' clean stop."""
    async with AsyncExitStack() as stack:
        frontend = await stack.enter_async_context(
            _process(
                nursery,
                runner_command(HERE / "frontend_side.py", json.dumps(frontend_spec)),
                env,
                logs,
                "frontend",
            )
        )
        engines = []
        for rank in range(scenario.dp_size):
            spec = {**common, "rank": rank, "report_path": str(reports / f"engine-{rank}.json")}
            command = runner_command(HERE / "engine_side.py", json.dumps(spec))
            engines.append(
                await stack.enter_async_context(
                    _process(nursery, command, env, logs, f"engine-{rank}")
                )
            )
        await trio.sleep(scenario.coordinator_delay)
        async with coordinator(addresses, scenario.dp_size):
            with trio.move_on_after(scenario.timeout * 3 + 30):
                await frontend.wait()
            for engine in engines:
                await _stop(engine, 20.0)
        yield


def _read(path: Path, default: dict[str, Any]) -> dict[str, Any]:
    try:
        report: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return default
    return report


# --- engines alone, for a front-end of the test's own ---------------------------------


@dataclass
class EngineFleet:
    """The DP engine processes :func:`open_engine_fleet` started (rank order), and what
    they leave: each one's exit report (after it exited) and its stderr."""

    processes: list[trio.Process]
    collective: CollectiveHost
    work_dir: Path
    logs: dict[str, list[bytes]]

    def report(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s exit report (``engine_side.py``); empty before it exited."""
        return _read(self.work_dir / "reports" / f"engine-{rank}.json", {})

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- {name}\n{b''.join(chunks).decode(errors='replace')[-chars:]}"
            for name, chunks in self.logs.items()
        )

    async def stop(self, grace: float = 20.0) -> None:
        """SIGTERM (vLLM's clean shutdown) to every engine still running; killed after
        ``grace`` seconds."""
        for process in self.processes:
            await _stop(process, grace)


@asynccontextmanager
async def open_engine_fleet(
    root: Path,
    env: dict[str, str],
    work_dir: Path,
    handshake_address: str,
    *,
    dp_size: int = 2,
    dp_sync_interval: int = 32,
    collective_timeout: float = 8.0,
    max_num_seqs: int = 64,
) -> AsyncIterator[EngineFleet]:
    """``dp_size`` real ``DPEngineCoreProc`` processes (``engine_side.py``) that connect to
    ``handshake_address`` as vLLM's launcher makes them (``local_client=True``), around
    the lock-step collective host (an ``ipc://`` socket in ``work_dir/collective/``).

    Whoever binds the handshake address (the test's front-end) answers them. On exit,
    the engines still running get SIGTERM (then SIGKILL after a grace period) and are
    waited for, and the collective host stops: no process is left behind.
    """
    collective_dir = work_dir / "collective"
    collective_dir.mkdir(parents=True)
    reports = work_dir / "reports"
    reports.mkdir()
    collective_address = f"ipc://{collective_dir / 'coll'}"
    env = {**env, "PYTHONPATH": os.pathsep.join([str(root), str(HERE)])}
    logs: dict[str, list[bytes]] = {}
    async with trio.open_nursery() as nursery:
        async with open_context() as context:
            async with open_socket(context, zmq.ROUTER, bind=collective_address) as socket:
                host = CollectiveHost(socket, dp_size, timeout=collective_timeout)
                await nursery.start(host.run)
                try:
                    async with AsyncExitStack() as stack:
                        processes = []
                        for rank in range(dp_size):
                            spec = {
                                "dp_size": dp_size,
                                "dp_sync_interval": dp_sync_interval,
                                "handshake_address": handshake_address,
                                "collective_address": collective_address,
                                "timeout": collective_timeout,
                                "max_num_seqs": max_num_seqs,
                                "rank": rank,
                                "report_path": str(reports / f"engine-{rank}.json"),
                            }
                            command = runner_command(HERE / "engine_side.py", json.dumps(spec))
                            processes.append(
                                await stack.enter_async_context(
                                    _process(nursery, command, env, logs, f"engine-{rank}")
                                )
                            )
                        fleet = EngineFleet(processes, host, work_dir, logs)
                        try:
                            yield fleet
                        finally:
                            with trio.CancelScope(shield=True):
                                await fleet.stop()
                finally:
                    nursery.cancel_scope.cancel()  # the host, before its socket closes
