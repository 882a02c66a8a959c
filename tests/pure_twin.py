"""The pure-Python twin of the compiled hot path, loaded beside the package's own.

An accelerated module (``trio_dpcoord/_compiled.py``) takes some of its names from its
compiled twin at import. :func:`pure_twin_modules` loads modules again from their ``.py``
source under :data:`PURE_TWIN_PACKAGE`, never accelerated, so that a differential test
runs both builds in one process (``tests/*/test_compiled_twin.py``). The twin's modules
import each other; anything else they import is the package's own (both builds share the
value classes: results compare with ``==``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import trio_dpcoord
from trio_dpcoord._compiled import PURE_PYTHON_ENV, PURE_TWIN_FLAG, kernels_in_use, pure_forced

PURE_TWIN_PACKAGE = "trio_dpcoord_pure_twin"
"""Where :func:`pure_twin_modules` loads the pure twin's modules."""

PURE_PYTHON = pure_forced()
"""This process runs the pure twin everywhere (``TRIO_DPCOORD_PURE_PYTHON``, read as the
package reads it)."""
REQUIRE_COMPILED = bool(os.environ.get("TRIO_DPCOORD_REQUIRE_COMPILED"))
"""CI sets it on the default install: a build that silently fell back fails the twins'
build checks."""


def run_fresh(script: str, *, forced_pure: bool) -> Any:
    """Run ``script`` (which prints one JSON line) in a fresh interpreter, with
    ``TRIO_DPCOORD_PURE_PYTHON=1`` or without it, so that the environment decides the
    build as at start-up; its output, decoded (it must exit 0)."""
    env = {k: v for k, v in os.environ.items() if k != PURE_PYTHON_ENV}
    if forced_pure:
        env[PURE_PYTHON_ENV] = "1"
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def compiled_twins() -> dict[str, tuple[bool, bool]]:
    """Each compiled twin's module -> (built here, in use in this process)."""
    return {
        name: (importlib.util.find_spec(name) is not None, in_use)
        for name, in_use in kernels_in_use().items()
    }


def kernel_state(module: str) -> tuple[bool, bool]:
    """(built here, in use in this process) of the compiled twin of the package's module
    ``module`` (relative to ``trio_dpcoord``; its kernel is the module's name with
    ``_kernel``)."""
    return compiled_twins()[f"trio_dpcoord.{module}_kernel"]


def package_module(module: str) -> ModuleType:
    """The package's own module ``module`` (relative to ``trio_dpcoord``): accelerated
    where its compiled twin runs."""
    return importlib.import_module(f"trio_dpcoord.{module}")


def pure_twin_modules(names: Sequence[str]) -> dict[str, ModuleType]:
    """The pure twins of the package's modules ``names`` (relative to ``trio_dpcoord``,
    each after those it imports; the same copies on every call)."""
    for real in list(sys.modules):  # the package's other modules, under the twin's names
        inside = real.removeprefix("trio_dpcoord")
        ours = real.split(".")[0] == "trio_dpcoord" and not real.startswith(PURE_TWIN_PACKAGE)
        if ours and inside.lstrip(".") not in names:
            sys.modules.setdefault(PURE_TWIN_PACKAGE + inside, sys.modules[real])
    root = Path(trio_dpcoord.__file__).parent
    modules = {}
    for name in names:
        full = f"{PURE_TWIN_PACKAGE}.{name}"
        twin = sys.modules.get(full)
        if twin is None or not getattr(twin, PURE_TWIN_FLAG, False):
            path = root / (name.replace(".", "/") + ".py")
            spec = importlib.util.spec_from_file_location(full, path)
            assert spec is not None and spec.loader is not None
            twin = importlib.util.module_from_spec(spec)
            setattr(twin, PURE_TWIN_FLAG, True)
            sys.modules[full] = twin
            spec.loader.exec_module(twin)
        modules[name] = twin
    return modules
