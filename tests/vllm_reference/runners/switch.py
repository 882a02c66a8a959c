"""Runner for tests/vllm/test_switch.py: vLLM 0.33.0's own launch code, run torch-free.

Run as a script with a vLLM import root first on ``PYTHONPATH`` and the project installed
(so ``vllm.general_plugins`` finds our entry point). It reports what happens as JSON lines
on stdout (vLLM's logs go to stderr: the test sets ``VLLM_LOGGING_STREAM``) and takes
commands, one per line, on stdin. The test plays the DP engines.

``launch CONFIG_JSON``: vLLM's real ``load_general_plugins()``, then its real
``launch_core_engines`` (which builds the real ``DPCoordinator``) and, on leaving the
block, its real ``wait_for_engine_startup`` handshake with the engines; then, per stdin
command, its real ``wait_for_completion_or_failure`` (``monitor``) or
``DPCoordinator.shutdown()`` (``shutdown``). Stand-ins, for what needs torch or pydantic or
starts servers: the configuration objects (plain attributes, the fields these functions
read, vLLM's defaults) and an API-server manager with no processes. Rank 0 has no local engines
(``--data-parallel-size-local 0``), so no engine-core process (torch) is started: every
engine is remote and headless, played by the test through the real handshake socket.

``plugins CONFIG_JSON``: only vLLM's real ``load_general_plugins()``; reports which
function ``DPCoordinatorProc.run_coordinator`` is afterwards.

``direct CONFIG_JSON``: our ``run_coordinator`` started exactly as ``DPCoordinator``
starts its target (a process of vLLM's ``get_mp_context()``, the same keyword arguments,
a one-way pipe), without the rest of vLLM: for bind and pipe behaviour.
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import dataclass
from typing import Any


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def next_command() -> str:
    return sys.stdin.readline().strip()


@dataclass(frozen=True)
class LoggingConfig:
    """vLLM's LoggingConfig defaults (the real one is a pydantic config: inert here).
    Defined in the runner, so a ``spawn`` child unpickles it from ``__mp_main__``."""

    log_level: str = "INFO"
    formatter: str = "text"
    configure_logging: bool = True
    pylogging_config_file: str | None = None


class ParallelConfig:
    """The fields of vLLM's ParallelConfig that the launch path reads, for one head node
    with no local engines (``vllm serve --data-parallel-size N --data-parallel-size-local 0``).
    """

    def __init__(self, dp_size: int, rpc_port: int) -> None:
        self.data_parallel_size = dp_size
        self.data_parallel_size_local = 0
        self.data_parallel_rank = 0
        self.data_parallel_rank_local = None
        self.data_parallel_master_ip = "127.0.0.1"
        self.data_parallel_master_port = rpc_port + 1
        self._data_parallel_master_port_list: list[int] = []
        self.data_parallel_rpc_port = rpc_port
        self.data_parallel_backend = "mp"
        self.data_parallel_hybrid_lb = False
        self.data_parallel_external_lb = False
        self.local_engines_only = False
        self.enable_elastic_ep = False
        self._coord_store_port = 0

    def compute_hash(self) -> str:
        return "stand-in-parallel-config-hash"


class ModelConfig:
    def __init__(self, is_moe: bool) -> None:
        self.is_moe = is_moe
        self.multimodal_config = None


class VllmConfig:
    def __init__(self, parallel: ParallelConfig, model: ModelConfig) -> None:
        self.parallel_config = parallel
        self.model_config = model
        self.cache_config = None
        self.logging_config = LoggingConfig()
        # VllmConfig.needs_dp_coordinator's rule, for this shape
        self.needs_dp_coordinator = parallel.data_parallel_size > 1


class NoApiServers:
    """Stands in for APIServerProcessManager (uvicorn servers): nothing to watch."""

    def __init__(self) -> None:
        self.processes: list[Any] = []


def plugins(config: dict[str, Any]) -> None:
    from vllm.logger import configure_logging
    from vllm.plugins import load_general_plugins
    from vllm.v1.engine.coordinator import DPCoordinatorProc

    # The order of `vllm serve`: plugins load while it builds its argument parser
    # (AsyncEngineArgs.add_cli_args), logging is configured after parsing.
    load_general_plugins()
    configure_logging(LoggingConfig())
    target = DPCoordinatorProc.run_coordinator
    emit("plugins", target=f"{target.__module__}.{target.__qualname__}")


def launch(config: dict[str, Any]) -> None:
    from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines
    from vllm.v1.utils import wait_for_completion_or_failure

    plugins(config)

    parallel = ParallelConfig(config["engines"], config["rpc_port"])
    vllm_config = VllmConfig(parallel, ModelConfig(config["is_moe"]))
    front_end = EngineZmqAddresses(
        inputs=["ipc:///nonexistent/front-end-input"],
        outputs=["ipc:///nonexistent/front-end-output"],
    )
    coordinator = None
    try:
        with launch_core_engines(vllm_config, object, False, front_end) as launched:
            coordinator = launched.coordinator
            assert coordinator is not None
            emit(
                "launched",
                pid=coordinator.proc.pid,
                coordinator_input=launched.addresses.coordinator_input,
                coordinator_output=launched.addresses.coordinator_output,
                front=launched.addresses.frontend_stats_publish_address,
                parallel_config_hash=parallel.compute_hash(),
            )
    except Exception as exc:
        exitcode = None
        if coordinator is not None:
            coordinator.proc.join(60)
            exitcode = coordinator.proc.exitcode
        emit("startup_failed", error=f"{type(exc).__name__}: {exc}", exitcode=exitcode)
        return
    assert coordinator is not None
    emit("started")
    command = next_command()
    if command == "monitor":
        try:
            wait_for_completion_or_failure(NoApiServers(), None, coordinator)
        except Exception as exc:
            coordinator.proc.join(60)
            emit(
                "monitor_failed",
                error=f"{type(exc).__name__}: {exc}",
                exitcode=coordinator.proc.exitcode,
            )
            return
        emit("monitor_returned")
    elif command == "shutdown":
        coordinator.shutdown(timeout=30.0)
        emit("shutdown", exitcode=coordinator.proc.exitcode)


def direct(config: dict[str, Any]) -> None:
    from vllm.logger import configure_logging
    from vllm.utils.system_utils import get_mp_context

    from trio_dpcoord.vllm import run_coordinator

    configure_logging(LoggingConfig())

    context = get_mp_context()
    receiving, sending = context.Pipe(duplex=False)
    proc = context.Process(
        target=run_coordinator,
        name="VLLM_DP_Coordinator",
        kwargs={
            "engine_count": config["engines"],
            "front_publish_address": config["front"],
            "back_output_address": config["back_output"],
            "back_publish_address": config["back_publish"],
            "zmq_addr_pipe": sending,
            "enable_wave_coordination": config["wave_coordination"],
            "logging_config": LoggingConfig(),
        },
        daemon=True,
    )
    proc.start()
    sending.close()
    try:
        emit("addresses", addresses=list(receiving.recv()))
    except EOFError:
        proc.join(60)
        emit("pipe_closed", exitcode=proc.exitcode)
        return
    finally:
        receiving.close()
    if next_command() == "terminate":
        proc.terminate()
        proc.join(60)
        emit("exited", exitcode=proc.exitcode)


def main() -> None:
    mode, config = sys.argv[1], json.loads(sys.argv[2])
    try:
        {"plugins": plugins, "launch": launch, "direct": direct}[mode](config)
    except BaseException:
        emit("driver_error", error=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
