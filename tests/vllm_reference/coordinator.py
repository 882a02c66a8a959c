"""vLLM 0.33.0's real coordinator process (``DPCoordinatorProc.run_coordinator``)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypedDict

import trio

from trio_dpcoord.testing import open_child

from ._process import runner_command, vllm_env
from ._root import prepare_import_root

if TYPE_CHECKING:
    from typing_extensions import Unpack

ADDRESSES_MARKER = "VLLM_REFERENCE_ADDRESSES "  # same as runners/coordinator.py


@dataclass(frozen=True)
class VllmCoordinatorAddresses:
    """The three addresses vLLM's coordinator bound, as it reports them (LAST_ENDPOINT)."""

    front_publish_address: str  # XPUB to front-ends (stats/wave publishes, SCALE_ELASTIC_EP in)
    back_output_address: str  # PULL from engines (EngineCoreOutputs)
    back_publish_address: str  # XPUB to engines (READY, START_DP_WAVE)


class CoordinatorOptions(TypedDict, total=False):
    """Keyword arguments of vLLM's ``DPCoordinatorProc.run_coordinator``, with its names.

    Absent (or None) addresses are picked by vLLM (fresh IPC paths);
    ``tcp://127.0.0.1:0`` binds an ephemeral port (vLLM's parser rejects ``:*``). The
    others default to vLLM's defaults (wave coordination on, 100 ms).
    """

    front_publish_address: str | None
    back_output_address: str | None
    back_publish_address: str | None
    enable_wave_coordination: bool
    min_stats_update_interval_ms: int


def coordinator_command(engine_count: int, **options: Unpack[CoordinatorOptions]) -> list[str]:
    """The command line of the coordinator runner (``runners/coordinator.py``)."""
    return runner_command("coordinator", json.dumps({"engine_count": engine_count, **options}))


def parse_addresses_line(line: str) -> VllmCoordinatorAddresses | None:
    if not line.startswith(ADDRESSES_MARKER):
        return None
    front, back_output, back_publish = json.loads(line[len(ADDRESSES_MARKER) :])
    return VllmCoordinatorAddresses(front, back_output, back_publish)


@dataclass
class VllmCoordinator:
    """A running vLLM coordinator process (``subprocess.Popen``) and its addresses."""

    process: subprocess.Popen[str]
    addresses: VllmCoordinatorAddresses
    log: IO[bytes] | None = None
    """vLLM's stderr (its logs), when ``start_vllm_coordinator`` was not given one."""
    socket_dir: Path | None = None
    """Where vLLM made its IPC socket files; removed by :meth:`stop`."""

    def stop(self, timeout: float = 10.0) -> int:
        """SIGINT (vLLM's own clean exit: KeyboardInterrupt), then SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self.log is not None:
            self.log.close()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        return self.process.returncode

    def logs(self) -> str:
        """What vLLM's coordinator logged so far (empty when its stderr went elsewhere)."""
        if self.log is None or self.log.closed:
            return ""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def __enter__(self) -> VllmCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_addresses(stdout: IO[str]) -> VllmCoordinatorAddresses | None:
    for line in stdout:
        addresses = parse_addresses_line(line)
        if addresses is not None:
            return addresses
    return None


def start_vllm_coordinator(
    engine_count: int,
    *,
    root: Path | None = None,
    stderr: int | IO[Any] | None = None,
    **options: Unpack[CoordinatorOptions],
) -> VllmCoordinator:
    """Start vLLM's coordinator in a subprocess; block until it reports its addresses.

    For synchronous callers (benchmarks). vLLM's logs go to ``stderr`` if given, else to
    a temporary file (``VllmCoordinator.logs()``). Raises ``RuntimeError`` with them if it
    exits before binding. ``root`` is an import root from ``prepare_import_root``.
    """
    command = coordinator_command(engine_count, **options)
    log = tempfile.TemporaryFile() if stderr is None else None  # noqa: SIM115 (closed by stop)
    socket_dir = Path(tempfile.mkdtemp(prefix="vllm-coordinator-"))
    process = subprocess.Popen(
        command,
        env=vllm_env(root, _socket_dir_env(socket_dir)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log if stderr is None else stderr,
        text=True,
    )
    assert process.stdout is not None
    addresses = _read_addresses(process.stdout)
    if addresses is None:
        process.wait()
        process.stdout.close()
        logs = ""
        if log is not None:
            log.seek(0)
            logs = log.read().decode(errors="replace")
            log.close()
        shutil.rmtree(socket_dir, ignore_errors=True)
        raise RuntimeError(f"vLLM's coordinator exited before binding:\n{logs}")
    return VllmCoordinator(process, addresses, log, socket_dir)


def _socket_dir_env(socket_dir: Path) -> dict[str, str]:
    """vLLM names its IPC paths ``$VLLM_RPC_BASE_PATH/<uuid>`` and, killed by a signal,
    leaves the socket files behind: a private directory, removed afterwards, keeps
    ``/tmp`` clean."""
    return {"VLLM_RPC_BASE_PATH": str(socket_dir)}


@asynccontextmanager
async def open_vllm_coordinator(
    engine_count: int,
    *,
    root: Path | None = None,
    log_lines: list[str] | None = None,
    **options: Unpack[CoordinatorOptions],
) -> AsyncIterator[VllmCoordinatorAddresses]:
    """Trio: vLLM's coordinator for the duration of the block (run by
    :func:`trio_dpcoord.testing.open_child`: stopped with SIGTERM, as vLLM's own
    ``shutdown`` does, and always reaped).

    vLLM's logs (stderr) are appended line by line to ``log_lines`` if given; a
    ``RuntimeError`` with them says so if it exits before binding.
    """
    command = coordinator_command(engine_count, **options)
    if root is None:
        root = await trio.to_thread.run_sync(prepare_import_root)
    socket_dir = Path(tempfile.mkdtemp(prefix="vllm-coordinator-"))
    try:
        env = vllm_env(root, _socket_dir_env(socket_dir))
        log = None if log_lines is None else log_lines.append
        async with open_child(command, env=env, stderr_line=log, stop_grace=10.0) as child:
            addresses = parse_addresses_line(await child.line(0))
            if addresses is None:
                raise RuntimeError(f"not an addresses line: {child.stdout_lines[0]!r}")
            yield addresses
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
