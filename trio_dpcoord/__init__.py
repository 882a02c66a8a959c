"""trio_dpcoord: a trio-native data-parallel wave coordinator for vLLM-style DP engines.

Embed it in a trio front-end with :func:`open_coordinator`, or run it standalone with
``python -m trio_dpcoord serve`` and follow it from trio front-ends with
:func:`open_frontend`. The wire codec lives in :mod:`trio_dpcoord.protocol`; the sans-IO
core's whole vocabulary (its commands, effects and views, beside :class:`CoordinatorCore`)
in :mod:`trio_dpcoord.core`. Front-ends choose engines with :class:`EngineChooser`:
vLLM's score by default, or ``routing="prefix"`` (:class:`PrefixRouting`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._balance import EngineChooser as EngineChooser
    from ._balance import Routing as Routing
    from ._balance import engine_score as engine_score
    from ._core import CoordinatorCore as CoordinatorCore
    from ._core import CoordinatorCounters as CoordinatorCounters
    from ._core import HistogramSnapshot as HistogramSnapshot
    from ._core import SubscriptionView as SubscriptionView
    from ._core import WaveStartCause as WaveStartCause
    from ._endpoints import Liveness as Liveness
    from ._endpoints import PrivateIpcDirectory as PrivateIpcDirectory
    from ._engine_client import Completion as Completion
    from ._engine_client import EngineClient as EngineClient
    from ._engine_client import EngineClientStatistics as EngineClientStatistics
    from ._engine_client import RequestOutput as RequestOutput
    from ._engine_client import RequestStream as RequestStream
    from ._engine_client import open_engine_client as open_engine_client
    from ._engine_protocol import SamplingParams as SamplingParams
    from ._errors import CoordinatorClosedError as CoordinatorClosedError
    from ._errors import CoordinatorError as CoordinatorError
    from ._errors import EngineClientClosedError as EngineClientClosedError
    from ._errors import EngineClientError as EngineClientError
    from ._errors import EngineDeadError as EngineDeadError
    from ._errors import EngineStartupError as EngineStartupError
    from ._errors import ReadyTimeoutError as ReadyTimeoutError
    from ._errors import RequestAbortedError as RequestAbortedError
    from ._errors import UtilityCallError as UtilityCallError
    from ._frontend import Frontend as Frontend
    from ._frontend import open_frontend as open_frontend
    from ._frontend_state import FrontendState as FrontendState
    from ._monitor import ConnectionMonitor as ConnectionMonitor
    from ._monitor import open_connection_monitor as open_connection_monitor
    from ._router import PrefixRouter as PrefixRouter
    from ._router import PrefixRouting as PrefixRouting
    from ._router import RouteDecision as RouteDecision
    from ._router import RouterCounters as RouterCounters
    from ._router import block_keys as block_keys
    from ._router import decode_kv_event_frames as decode_kv_event_frames
    from ._service import Coordinator as Coordinator
    from ._service import open_coordinator as open_coordinator
    from ._state import WaveSnapshot as WaveSnapshot
    from ._state import WaveStart as WaveStart
    from ._tasks import cancel_at_stdin_eof as cancel_at_stdin_eof
    from ._view import CoordinatorView as CoordinatorView
    from .protocol import EngineLoad as EngineLoad
    from .protocol import ProtocolError as ProtocolError

__version__ = "0.1.0"

__all__ = [
    "Completion",
    "ConnectionMonitor",
    "Coordinator",
    "CoordinatorClosedError",
    "CoordinatorCore",
    "CoordinatorCounters",
    "CoordinatorError",
    "CoordinatorView",
    "EngineChooser",
    "EngineClient",
    "EngineClientClosedError",
    "EngineClientError",
    "EngineClientStatistics",
    "EngineDeadError",
    "EngineLoad",
    "EngineStartupError",
    "Frontend",
    "FrontendState",
    "HistogramSnapshot",
    "Liveness",
    "PrefixRouter",
    "PrefixRouting",
    "PrivateIpcDirectory",
    "ProtocolError",
    "ReadyTimeoutError",
    "RequestAbortedError",
    "RequestOutput",
    "RequestStream",
    "RouteDecision",
    "RouterCounters",
    "Routing",
    "SamplingParams",
    "SubscriptionView",
    "UtilityCallError",
    "WaveSnapshot",
    "WaveStart",
    "WaveStartCause",
    "block_keys",
    "cancel_at_stdin_eof",
    "decode_kv_event_frames",
    "engine_score",
    "open_connection_monitor",
    "open_coordinator",
    "open_engine_client",
    "open_frontend",
]

# Names are imported on first use (PEP 562), so that importing a submodule on its own, as
# vLLM does with the plugin in every one of its processes, costs only that submodule: not
# trio, pyzmq and the whole service. ``from trio_dpcoord import X`` works as usual.
_EXPORTS: dict[str, str] = {
    "Completion": "._engine_client",
    "ConnectionMonitor": "._monitor",
    "Coordinator": "._service",
    "CoordinatorClosedError": "._errors",
    "CoordinatorCore": "._core",
    "CoordinatorCounters": "._core",
    "CoordinatorError": "._errors",
    "CoordinatorView": "._view",
    "EngineChooser": "._balance",
    "EngineClient": "._engine_client",
    "EngineClientClosedError": "._errors",
    "EngineClientError": "._errors",
    "EngineClientStatistics": "._engine_client",
    "EngineDeadError": "._errors",
    "EngineLoad": ".protocol",
    "EngineStartupError": "._errors",
    "Frontend": "._frontend",
    "FrontendState": "._frontend_state",
    "HistogramSnapshot": "._core",
    "Liveness": "._endpoints",
    "PrefixRouter": "._router",
    "PrefixRouting": "._router",
    "PrivateIpcDirectory": "._endpoints",
    "ProtocolError": ".protocol",
    "ReadyTimeoutError": "._errors",
    "RequestAbortedError": "._errors",
    "RequestOutput": "._engine_client",
    "RequestStream": "._engine_client",
    "RouteDecision": "._router",
    "Routing": "._balance",
    "RouterCounters": "._router",
    "SamplingParams": "._engine_protocol",
    "SubscriptionView": "._core",
    "UtilityCallError": "._errors",
    "WaveSnapshot": "._state",
    "WaveStart": "._state",
    "WaveStartCause": "._core",
    "block_keys": "._router",
    "decode_kv_event_frames": "._router",
    "cancel_at_stdin_eof": "._tasks",
    "engine_score": "._balance",
    "open_connection_monitor": "._monitor",
    "open_coordinator": "._service",
    "open_engine_client": "._engine_client",
    "open_frontend": "._frontend",
}

_SUBMODULES = frozenset(
    {
        "cli",
        "core",
        "engine_protocol",
        "metrics",
        "protocol",
        "sim",
        "testing",
        "trio_zmq",
        "vllm",
    }
)


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
