"""Which build of the hot path runs: the compiled twins, or the pure-Python modules alone.

A module with a compiled twin (a *kernel*, built from ``KERNEL_SOURCES`` by ``setup.py``
where a C compiler is present) is pure Python and stays the spec: it ends with
``accelerate(globals(), KERNEL)``, which replaces some of its names by the kernel's,
the same behaviour computed in C (``tests/*/test_compiled_twin.py`` prove it, the two
builds side by side). Where the kernel was not built, or with
``TRIO_DPCOORD_PURE_PYTHON=1``, the pure names stay. :func:`log_build` says which runs,
in one line. Stdlib only.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

__all__ = [
    "KERNEL_SOURCES",
    "PURE_PYTHON_ENV",
    "accelerate",
    "build_description",
    "hot_path_build",
    "kernels_in_use",
    "log_build",
    "pure_forced",
]

logger = logging.getLogger(__name__)

PURE_PYTHON_ENV = "TRIO_DPCOORD_PURE_PYTHON"
"""Set to anything but ``""`` or ``"0"``: run the pure-Python modules even where the
compiled twins were built."""

KERNEL_SOURCES: dict[str, str] = {
    "trio_dpcoord.routing._keys_kernel": "trio_dpcoord/routing/_keys_kernel.pyx",
    "trio_dpcoord.routing._prefix_index_kernel": "trio_dpcoord/routing/_prefix_index_kernel.pyx",
    "trio_dpcoord.routing._walk_kernel": "trio_dpcoord/routing/_walk_kernel.pyx",
    "trio_dpcoord.routing._prefix_router_kernel": (
        "trio_dpcoord/routing/_prefix_router_kernel.pyx"
    ),
    "trio_dpcoord.routing._chooser_kernel": "trio_dpcoord/routing/_chooser_kernel.pyx",
    "trio_dpcoord.protocol._output_decoder_kernel": (
        "trio_dpcoord/protocol/_output_decoder_kernel.pyx"
    ),
    "trio_dpcoord.trio_zmq._socket_kernel": "trio_dpcoord/trio_zmq/_socket_kernel.pyx",
}
"""Each compiled twin's module -> its source (read by ``setup.py``)."""

PURE_TWIN_FLAG = "__trio_dpcoord_pure_twin__"
"""A module namespace holding this (true) is never accelerated: the pure twin that the
differential tests load beside the accelerated module (``tests/pure_twin.py``)."""

_used: dict[str, bool] = {}
"""Kernel -> whether an accelerated module took its names (in this process)."""


def pure_forced() -> bool:
    """Whether :data:`PURE_PYTHON_ENV` asks for the pure-Python modules."""
    return os.environ.get(PURE_PYTHON_ENV, "").strip() not in ("", "0")


def accelerate(namespace: dict[str, Any], kernel: str) -> bool:
    """Replace names in ``namespace`` (a pure module's globals) by the compiled twin's,
    unless forced pure, loaded as the pure twin, or not built; returns whether it did.

    The kernel's ``accelerate(namespace)`` returns the replacements (it may keep the
    pure functions, for what its C loops do not take)."""
    if namespace.get(PURE_TWIN_FLAG):
        return False
    if pure_forced():
        _used[kernel] = False
        return False
    try:
        module = importlib.import_module(kernel)
    except ImportError:
        _used[kernel] = False
        return False
    namespace.update(module.accelerate(namespace))
    _used[kernel] = True
    return True


def kernels_in_use() -> dict[str, bool]:
    """Every kernel -> whether it runs (imports the accelerated modules first)."""
    for name in KERNEL_SOURCES:
        if name not in _used:
            # the accelerated module is the kernel's name without "_kernel"
            importlib.import_module(name.removesuffix("_kernel"))
    return {name: _used.get(name, False) for name in KERNEL_SOURCES}


def build_description() -> str:
    """One line: which build of the hot path runs, and why."""
    used = kernels_in_use()
    names = ", ".join(name.rsplit(".", 1)[-1] for name in used)
    if all(used.values()):
        return f"compiled hot path in use ({names})"
    if pure_forced():
        return f"pure-Python hot path in use ({PURE_PYTHON_ENV} is set)"
    missing = ", ".join(name.rsplit(".", 1)[-1] for name, on in used.items() if not on)
    return f"pure-Python hot path in use (not built: {missing})"


def hot_path_build() -> str:
    """``"compiled"`` where every compiled twin runs in this process, else ``"pure"``
    (forced, not built, or only some built): what a benchmark record calls its build."""
    return "compiled" if all(kernels_in_use().values()) else "pure"


def log_build() -> None:
    """Log :func:`build_description` at INFO (a process's start-up line)."""
    logger.info("%s", build_description())
