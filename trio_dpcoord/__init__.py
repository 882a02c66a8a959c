"""trio_dpcoord: a trio-native data-parallel wave coordinator for vLLM-style DP engines.

What a trio application uses is here: the entry points (:func:`open_coordinator`,
:func:`open_frontend`, :func:`open_engine_client`, :func:`open_connection_monitor`), the
handles they give, their settings, values and errors. The layers below have their own
fronts: the wire in :mod:`trio_dpcoord.protocol`, the sans-IO rooms (the coordinator's
core, the wave state, a front-end's and the engine client's state) in
:mod:`trio_dpcoord.core`, engine choice in :mod:`trio_dpcoord.routing`.

=========================  ===============================================================
package / module           owns
=========================  ===============================================================
``protocol``               bytes only: every message of vLLM's DP and engine-core protocols
``core``                   sans-IO rules: waves, loads, publish timing, client state
``routing``                sans-IO engine choice: vLLM's score, the prefix policy
``trio_zmq``               the small trio shim over pyzmq
``_shell``                 the trio tasks and handles around the sans-IO rooms (private)
``vllm``, ``cli``,         integrations: vLLM's plugin, ``trio-dpcoord serve``,
``metrics``, ``testing``   Prometheus metrics, test peers
``sim``                    a simulated vLLM DP fleet built on the public names
=========================  ===============================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

if TYPE_CHECKING:
    from ._compiled import hot_path_build as hot_path_build
    from ._errors import CoordinatorClosedError as CoordinatorClosedError
    from ._errors import CoordinatorError as CoordinatorError
    from ._errors import EngineClientClosedError as EngineClientClosedError
    from ._errors import EngineClientError as EngineClientError
    from ._errors import EngineDeadError as EngineDeadError
    from ._errors import EngineStartupError as EngineStartupError
    from ._errors import ReadyTimeoutError as ReadyTimeoutError
    from ._errors import RequestAbortedError as RequestAbortedError
    from ._errors import UtilityCallError as UtilityCallError
    from ._shell.coordinator import Coordinator as Coordinator
    from ._shell.coordinator import open_coordinator as open_coordinator
    from ._shell.endpoints import Liveness as Liveness
    from ._shell.endpoints import PrivateIpcDirectory as PrivateIpcDirectory
    from ._shell.engine_client import EngineClient as EngineClient
    from ._shell.engine_startup import open_engine_client as open_engine_client
    from ._shell.frontend import Frontend as Frontend
    from ._shell.frontend import open_frontend as open_frontend
    from ._shell.monitor import ConnectionMonitor as ConnectionMonitor
    from ._shell.monitor import open_connection_monitor as open_connection_monitor
    from ._shell.request_stream import Completion as Completion
    from ._shell.request_stream import EngineClientStatistics as EngineClientStatistics
    from ._shell.request_stream import RequestOutput as RequestOutput
    from ._shell.request_stream import RequestStream as RequestStream
    from ._shell.supervision import RestartStatistics as RestartStatistics
    from ._shell.view import CoordinatorView as CoordinatorView
    from ._shell.view import Route as Route
    from .core._counters import CoordinatorStatistics as CoordinatorStatistics
    from .core._counters import HistogramSnapshot as HistogramSnapshot
    from .core._counters import SubscriptionView as SubscriptionView
    from .core._effects import WaveStartCause as WaveStartCause
    from .core._frontend import FrontendStatistics as FrontendStatistics
    from .core._wave import WaveSnapshot as WaveSnapshot
    from .protocol import EngineLoad as EngineLoad
    from .protocol import ProtocolError as ProtocolError
    from .protocol import SamplingParams as SamplingParams
    from .routing._chooser import ChooserStatistics as ChooserStatistics
    from .routing._chooser import EngineChooser as EngineChooser
    from .routing._chooser import Routing as Routing
    from .routing._decision import RouteDecision as RouteDecision
    from .routing._decision import RouterStatistics as RouterStatistics
    from .routing._settings import PrefixRouting as PrefixRouting

__version__ = "0.1.0"

__all__ = [
    "ChooserStatistics",
    "Completion",
    "ConnectionMonitor",
    "Coordinator",
    "CoordinatorClosedError",
    "CoordinatorError",
    "CoordinatorStatistics",
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
    "FrontendStatistics",
    "HistogramSnapshot",
    "Liveness",
    "PrefixRouting",
    "PrivateIpcDirectory",
    "ProtocolError",
    "ReadyTimeoutError",
    "RequestAbortedError",
    "RequestOutput",
    "RequestStream",
    "RestartStatistics",
    "Route",
    "RouteDecision",
    "RouterStatistics",
    "Routing",
    "SamplingParams",
    "SubscriptionView",
    "UtilityCallError",
    "WaveSnapshot",
    "WaveStartCause",
    "hot_path_build",
    "open_connection_monitor",
    "open_coordinator",
    "open_engine_client",
    "open_frontend",
]

_EXPORTS: dict[str, str] = {
    "hot_path_build": "._compiled",
    "ChooserStatistics": ".routing._chooser",
    "Completion": "._shell.request_stream",
    "ConnectionMonitor": "._shell.monitor",
    "Coordinator": "._shell.coordinator",
    "CoordinatorClosedError": "._errors",
    "CoordinatorStatistics": ".core._counters",
    "CoordinatorError": "._errors",
    "CoordinatorView": "._shell.view",
    "EngineChooser": ".routing._chooser",
    "EngineClient": "._shell.engine_client",
    "EngineClientClosedError": "._errors",
    "EngineClientError": "._errors",
    "EngineClientStatistics": "._shell.request_stream",
    "EngineDeadError": "._errors",
    "EngineLoad": ".protocol",
    "EngineStartupError": "._errors",
    "Frontend": "._shell.frontend",
    "FrontendStatistics": ".core._frontend",
    "HistogramSnapshot": ".core._counters",
    "Liveness": "._shell.endpoints",
    "PrefixRouting": ".routing._settings",
    "PrivateIpcDirectory": "._shell.endpoints",
    "ProtocolError": ".protocol",
    "ReadyTimeoutError": "._errors",
    "RequestAbortedError": "._errors",
    "RequestOutput": "._shell.request_stream",
    "RequestStream": "._shell.request_stream",
    "RestartStatistics": "._shell.supervision",
    "Route": "._shell.view",
    "RouteDecision": ".routing._decision",
    "RouterStatistics": ".routing._decision",
    "Routing": ".routing._chooser",
    "SamplingParams": ".protocol",
    "SubscriptionView": ".core._counters",
    "UtilityCallError": "._errors",
    "WaveSnapshot": ".core._wave",
    "WaveStartCause": ".core._effects",
    "open_connection_monitor": "._shell.monitor",
    "open_coordinator": "._shell.coordinator",
    "open_engine_client": "._shell.engine_startup",
    "open_frontend": "._shell.frontend",
}

_SUBMODULES = frozenset(
    {
        "cli",
        "core",
        "engine_protocol",
        "metrics",
        "protocol",
        "routing",
        "sim",
        "testing",
        "trio_zmq",
        "vllm",
    }
)

# Names this package exported before the layers had folders of their own: they still
# work, with a DeprecationWarning naming their home.
_MOVED: dict[str, str] = {
    "CoordinatorCore": "trio_dpcoord.core",
    "FrontendState": "trio_dpcoord.core",
    "WaveStart": "trio_dpcoord.core",
    "PrefixRouter": "trio_dpcoord.routing",
    "block_keys": "trio_dpcoord.routing",
    "decode_kv_event_frames": "trio_dpcoord.protocol",
    "cancel_at_stdin_eof": "trio_dpcoord.cli",
}

if not TYPE_CHECKING:  # for type checkers, the imports above are the package
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, submodules=_SUBMODULES, moved=_MOVED)
