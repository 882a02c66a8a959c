"""The pure-Python twin of the prefix policy's hot path, loaded beside the package's own
(:func:`hot_path`; the loader: ``tests/pure_twin.py``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

from tests.pure_twin import PURE_TWIN_PACKAGE, compiled_twins, pure_twin_modules

__all__ = ["PURE_TWIN_PACKAGE", "TWIN_MODULES", "HotPath", "compiled_twins", "hot_path"]

TWIN_MODULES = (
    "routing._keys",
    "routing._walk",
    "routing._prefix_index",
    "routing._prefix_router",
    "routing._chooser",
)
"""The accelerated modules and those that use them, each after those it imports."""


class HotPath(NamedTuple):
    """The prefix policy's hashing and what is built on it, from one build."""

    block_keys: Callable[..., list[int]]
    chunk_hashes: Callable[..., Any]
    bisect_holders: Callable[..., list[tuple[int, int]]]
    ChunkKeys: Any
    RankPrefixIndex: Any
    PrefixRouter: Any
    EngineChooser: Any


def hot_path(pure: bool) -> HotPath:
    """The package's own names (``pure=False``: the compiled twins' where in use), or the
    pure-Python twin's (``pure=True``; the same copies on every call)."""
    modules = {name: importlib.import_module(f"trio_dpcoord.{name}") for name in TWIN_MODULES}
    if pure:
        modules.update(pure_twin_modules(TWIN_MODULES))
    keys = modules["routing._keys"]
    return HotPath(
        keys.block_keys,
        keys.chunk_hashes,
        modules["routing._walk"].bisect_holders,
        keys.ChunkKeys,
        modules["routing._prefix_index"].RankPrefixIndex,
        modules["routing._prefix_router"].PrefixRouter,
        modules["routing._chooser"].EngineChooser,
    )
