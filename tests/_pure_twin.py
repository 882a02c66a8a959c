"""The pure-Python twin of the accelerated modules, loaded beside them in one process.

An accelerated module (see :mod:`trio_dpcoord._compiled`) takes some of its names from
its compiled twin at import. For a differential test both must run side by side: this
loads fresh copies of package modules from their ``.py`` source under
``trio_dpcoord._pure_twin.<name>``, never accelerated; their relative imports of each
other resolve to the copies, of any other module to the package's own (so both builds
share the plain value classes: their results compare with ``==``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import trio_dpcoord
from trio_dpcoord._compiled import PURE_TWIN_FLAG

TWIN_PACKAGE = "trio_dpcoord._pure_twin"


def load_pure_twin(names: Sequence[str]) -> dict[str, ModuleType]:
    """``names`` (``"routing._keys"``, ...; each after those it imports) from source,
    unaccelerated, under :data:`TWIN_PACKAGE`; the same copies on every call."""
    for name in names:  # the package's own first, with everything they import
        importlib.import_module(f"trio_dpcoord.{name}")
    for real in list(sys.modules):
        if real == "trio_dpcoord" or real.startswith("trio_dpcoord."):
            alias = TWIN_PACKAGE + real.removeprefix("trio_dpcoord")
            if (
                not real.startswith(TWIN_PACKAGE)
                and real.removeprefix("trio_dpcoord.") not in names
            ):
                sys.modules.setdefault(alias, sys.modules[real])
    root = Path(trio_dpcoord.__file__).parent
    twins: dict[str, ModuleType] = {}
    for name in names:
        full = f"{TWIN_PACKAGE}.{name}"
        loaded = sys.modules.get(full)
        if loaded is None or not getattr(loaded, PURE_TWIN_FLAG, False):
            spec = importlib.util.spec_from_file_location(
                full, root / (name.replace(".", "/") + ".py")
            )
            assert spec is not None and spec.loader is not None
            loaded = importlib.util.module_from_spec(spec)
            setattr(loaded, PURE_TWIN_FLAG, True)
            sys.modules[full] = loaded
            spec.loader.exec_module(loaded)
        twins[name] = loaded
    return twins
