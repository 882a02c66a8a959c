"""The vLLM reference loader itself: vLLM's real modules import torch-free in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.vllm_reference import open_vllm_coordinator, prepare_import_root, vllm_env
from trio_dpcoord.testing import connect_engines

pytestmark = pytest.mark.vllm

PROBE = """
import json, sys
import torch
import vllm.v1.engine as engine
import vllm.v1.engine.coordinator as coordinator
import vllm.v1.serial_utils as serial_utils
print(json.dumps({
    "vllm": __import__("vllm").__version__,
    "torch_is_standin": torch.__file__.startswith(sys.argv[1]),
    "engine": engine.__file__,
    "coordinator": coordinator.DPCoordinatorProc.__module__,
    "encoder": serial_utils.MsgpackEncoder.__module__,
    "standin_config": type(__import__("vllm.config").config.ParallelConfig).__name__,
}))
"""


def test_real_vllm_modules_import_without_torch(vllm_root: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(vllm_root)],
        env=vllm_env(vllm_root),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    seen = json.loads(result.stdout)
    assert seen["vllm"] == "0.33.0"
    assert seen["torch_is_standin"]
    assert seen["engine"] == str(vllm_root / "vllm" / "v1" / "engine" / "__init__.py")
    assert seen["coordinator"] == "vllm.v1.engine.coordinator"
    assert seen["encoder"] == "vllm.v1.serial_utils"
    assert seen["standin_config"] == "_PlaceholderMeta"


def test_a_consumer_adds_its_own_standins(vllm_root: Path) -> None:
    root = prepare_import_root(
        modules={"vllm.v1.engine.coordinator": "WHO = 'consumer stand-in'\n"},
        inert=["vllm.v1.engine.core"],
        real=["vllm.utils.torch_utils"],
    )
    assert root != vllm_root
    probe = (
        "import vllm.v1.engine.coordinator as c, vllm.v1.engine.core as core;"
        "import vllm.utils.torch_utils as t;"
        "print(c.WHO, core.EngineCoreProc.__name__, t.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env=vllm_env(root),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.split() == [
        "consumer",
        "stand-in",
        "EngineCoreProc",
        str(root / "vllm" / "utils" / "torch_utils.py"),  # vLLM's own, no longer inert
    ]
    with pytest.raises(ValueError, match="cannot be made real"):
        prepare_import_root(real=["vllm.v1.engine"])


async def test_vllms_coordinator_runs_and_gates_on_subscriptions(vllm_root: Path) -> None:
    with trio.fail_after(60):
        async with open_vllm_coordinator(2, root=vllm_root) as addresses:
            async with connect_engines(
                addresses.back_publish_address, addresses.back_output_address, 2
            ) as engines:
                for engine in engines:
                    assert await engine.next_broadcast_frames() == [b"READY"]
