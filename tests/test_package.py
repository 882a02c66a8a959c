"""The package's public names, imported on first use (in fresh interpreters: what a
process that imports only the vLLM plugin pays)."""

from __future__ import annotations

import subprocess
import sys
from typing import Literal, get_origin

import pytest

import trio_dpcoord


def _fresh(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return result.stdout.strip()


def test_the_vllm_plugin_imports_neither_trio_nor_the_service() -> None:
    loaded = _fresh(
        "import sys, trio_dpcoord.vllm\n"
        "print(sorted(m for m in ('trio', 'zmq', 'msgpack', 'trio_dpcoord._service',"
        " 'trio_dpcoord._core') if m in sys.modules))"
    )
    assert loaded == "[]"


def test_every_public_name_resolves_to_its_module_object() -> None:
    for name in trio_dpcoord.__all__:
        value = getattr(trio_dpcoord, name)
        if get_origin(value) is Literal:  # a type alias (Routing) has no module of its own
            continue
        assert value.__module__.startswith("trio_dpcoord"), name
    # private import (documented exception): the lazy export is the private object itself
    from trio_dpcoord._shell.coordinator import open_coordinator

    assert trio_dpcoord.open_coordinator is open_coordinator
    assert set(trio_dpcoord.__all__) <= set(dir(trio_dpcoord))


def test_star_import_and_submodules_work_in_a_fresh_interpreter() -> None:
    out = _fresh(
        "from trio_dpcoord import *\n"
        "import trio_dpcoord\n"
        "print(open_coordinator.__name__, trio_dpcoord.protocol.__name__)"
    )
    assert out == "open_coordinator trio_dpcoord.protocol"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'open_coordinatr'"):
        getattr(trio_dpcoord, "open_coordinatr")  # noqa: B009 -- the lookup is the test
