"""trio_dpcoord: a trio-native data-parallel wave coordinator for vLLM-style DP engines.

Embed it in a trio front-end with :func:`open_coordinator`, or run it standalone with
``python -m trio_dpcoord serve`` and follow it from trio front-ends with
:func:`open_frontend`. The wire codec lives in :mod:`trio_dpcoord.protocol`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._balance import EngineChooser as EngineChooser
    from ._balance import engine_score as engine_score
    from ._core import CoordinatorCore as CoordinatorCore
    from ._core import CoordinatorCounters as CoordinatorCounters
    from ._core import HistogramSnapshot as HistogramSnapshot
    from ._core import SubscriptionView as SubscriptionView
    from ._core import WaveStartCause as WaveStartCause
    from ._endpoints import Liveness as Liveness
    from ._errors import CoordinatorClosedError as CoordinatorClosedError
    from ._errors import CoordinatorError as CoordinatorError
    from ._errors import ReadyTimeoutError as ReadyTimeoutError
    from ._frontend import Frontend as Frontend
    from ._frontend import open_frontend as open_frontend
    from ._service import Coordinator as Coordinator
    from ._service import open_coordinator as open_coordinator
    from ._state import WaveSnapshot as WaveSnapshot
    from ._state import WaveStart as WaveStart
    from ._view import CoordinatorView as CoordinatorView
    from .protocol import EngineLoad as EngineLoad
    from .protocol import ProtocolError as ProtocolError

__version__ = "0.1.0"

__all__ = [
    "Coordinator",
    "CoordinatorClosedError",
    "CoordinatorCore",
    "CoordinatorCounters",
    "CoordinatorError",
    "CoordinatorView",
    "EngineChooser",
    "EngineLoad",
    "Frontend",
    "HistogramSnapshot",
    "Liveness",
    "ProtocolError",
    "ReadyTimeoutError",
    "SubscriptionView",
    "WaveSnapshot",
    "WaveStart",
    "WaveStartCause",
    "engine_score",
    "open_coordinator",
    "open_frontend",
]

# Names are imported on first use (PEP 562), so that importing a submodule on its own, as
# vLLM does with the plugin in every one of its processes, costs only that submodule: not
# trio, pyzmq and the whole service. ``from trio_dpcoord import X`` works as usual.
_EXPORTS: dict[str, str] = {
    "Coordinator": "._service",
    "CoordinatorClosedError": "._errors",
    "CoordinatorCore": "._core",
    "CoordinatorCounters": "._core",
    "CoordinatorError": "._errors",
    "CoordinatorView": "._view",
    "EngineChooser": "._balance",
    "EngineLoad": ".protocol",
    "Frontend": "._frontend",
    "HistogramSnapshot": "._core",
    "Liveness": "._endpoints",
    "ProtocolError": ".protocol",
    "ReadyTimeoutError": "._errors",
    "SubscriptionView": "._core",
    "WaveSnapshot": "._state",
    "WaveStart": "._state",
    "WaveStartCause": "._core",
    "engine_score": "._balance",
    "open_coordinator": "._service",
    "open_frontend": "._frontend",
}

_SUBMODULES = frozenset({"cli", "metrics", "protocol", "sim", "testing", "trio_zmq", "vllm"})


if not TYPE_CHECKING:  # for type checkers, the imports above are the package

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, __name__), name)
        elif name in _SUBMODULES:
            value = importlib.import_module(f".{name}", __name__)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value


    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__, *_SUBMODULES})
