"""Names a package hands on from its modules, imported on first use (PEP 562).

Importing a package then costs only the package: vLLM imports the plugin in every one of
its processes, and :mod:`trio_dpcoord.routing`'s score must not load msgpack, trio or
pyzmq on the way. ``from package import X`` works as usual; type checkers read the
package's ``TYPE_CHECKING`` imports instead (``tests/test_package.py`` keeps the three
lists, ``__all__``, the table and those imports, equal).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str,
    exports: Mapping[str, str],
    *,
    submodules: frozenset[str] = frozenset(),
    moved: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a name to the module
    (relative to the package) that defines it; ``submodules`` are imported by name;
    ``moved`` maps a name that used to be here to the module that has it now (it still
    works, with a ``DeprecationWarning`` saying where to import it from)."""
    namespace = importlib.import_module(package).__dict__
    moved = moved or {}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, package), name)
        elif name in submodules:
            value = importlib.import_module(f".{name}", package)
        elif name in moved:
            warnings.warn(
                f"{package}.{name} moved: import it from {moved[name]}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(moved[name]), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports, *submodules})

    return __getattr__, __dir__
