"""The pure-Python twin of the compiled hot path, loaded beside the package's own.

An accelerated module (``trio_dpcoord/_compiled.py``) takes some of its names from its
compiled twin at import. :func:`hot_path` gives the package's own names, or the pure
twin's: the modules loaded again from their ``.py`` source under
:data:`PURE_TWIN_PACKAGE`, never accelerated, so that a differential test runs both
builds in one process. The twin's modules import each other; anything else they import
is the package's own (both builds share the value classes: results compare with ``==``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import trio_dpcoord
from trio_dpcoord._compiled import PURE_TWIN_FLAG, kernels_in_use

PURE_TWIN_PACKAGE = "trio_dpcoord_pure_twin"
"""Where :func:`hot_path` loads the pure twin's modules."""

TWIN_MODULES = (
    "routing._keys",
    "routing._prefix_index",
    "routing._prefix_router",
    "routing._chooser",
)
"""The accelerated modules and those that use them, each after those it imports."""


class HotPath(NamedTuple):
    """The prefix policy's hashing and what is built on it, from one build."""

    block_keys: Callable[..., list[int]]
    chunk_hashes: Callable[..., Any]
    ChunkKeys: Any
    PrefixRouter: Any
    EngineChooser: Any


def compiled_twins() -> dict[str, tuple[bool, bool]]:
    """Each compiled twin's module -> (built here, in use in this process)."""
    return {
        name: (importlib.util.find_spec(name) is not None, in_use)
        for name, in_use in kernels_in_use().items()
    }


def hot_path(pure: bool) -> HotPath:
    """The package's own names (``pure=False``: the compiled twins' where in use), or the
    pure-Python twin's (``pure=True``; the same copies on every call)."""
    modules = {name: importlib.import_module(f"trio_dpcoord.{name}") for name in TWIN_MODULES}
    if pure:
        for real in list(sys.modules):  # the package's other modules, under the twin's names
            inside = real.removeprefix("trio_dpcoord")
            ours = real.split(".")[0] == "trio_dpcoord" and not real.startswith(PURE_TWIN_PACKAGE)
            if ours and inside.lstrip(".") not in TWIN_MODULES:
                sys.modules.setdefault(PURE_TWIN_PACKAGE + inside, sys.modules[real])
        root = Path(trio_dpcoord.__file__).parent
        for name in TWIN_MODULES:
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
    keys = modules["routing._keys"]
    return HotPath(
        keys.block_keys,
        keys.chunk_hashes,
        keys.ChunkKeys,
        modules["routing._prefix_router"].PrefixRouter,
        modules["routing._chooser"].EngineChooser,
    )
