"""A simulated vLLM DP cluster: lock-step MoE engines, a front-end and a load generator.

Built only on the public API (:func:`trio_dpcoord.open_coordinator`,
:func:`trio_dpcoord.open_frontend`, :class:`trio_dpcoord.EngineChooser`), the wire codec
(:mod:`trio_dpcoord.protocol`) and the trio/ZeroMQ shim, so it exercises exactly what
users get.

* :mod:`.engine` — one DP rank (``python -m trio_dpcoord.sim engine --rank R ...``),
  faithful to docs/protocol.md §6, stepping in lock-step with its peers through a real
  collective between processes (:mod:`.collective`); its rules and busy loop in
  :mod:`.engine_loop`, what it is told in :mod:`.engine_config`, what it keeps and
  counts in :mod:`.engine_state`, how it fails in :mod:`.engine_errors`, its sockets in
  :mod:`.engine_sockets`;
* :mod:`.frontend` — the front-end (wave stamp, engine choice, optional
  ``notify_first_request``) and wake-latency measurement; :mod:`.load` — the bursty
  load generator;
* :mod:`.cluster` — :func:`run_cluster`: coordinator + front-end + N engine processes
  + load, as ``examples/launch_cluster.py`` runs it; :func:`open_engine_fleet` for
  other front-ends (``examples/http_frontend.py``); its configuration and report in
  :mod:`.cluster_config`;
* :mod:`.fleet` — process supervision: the engine processes and the standalone
  coordinator process, watched, restarted when asked, always reaped;
* :mod:`.engine_core` — the same rank speaking vLLM's engine-core protocol (handshake,
  ``EngineCoreRequest``/``EngineCoreOutputs``, utility calls), a fleet of them behind
  :func:`trio_dpcoord.open_engine_client` (one code path for simulated and real engines);
* :mod:`.timeline` — what the front-end saw over time, and :func:`plot_timeline`.
"""

from __future__ import annotations

from .cluster import EmbeddedCoordinator, open_engine_fleet, run_cluster
from .cluster_config import ClusterConfig, ClusterReport, Mode, Progress
from .collective import AllReduceResult, CollectiveTimeoutError
from .engine import SimEngine, run_engine, run_sim_engine
from .engine_config import EngineConfig
from .engine_core import (
    ENGINE_CLIENT_MODE,
    EngineCoreFleet,
    SimEngineCore,
    open_engine_core_fleet,
    open_sim_engine_client,
    run_engine_core_cluster,
)
from .engine_errors import CoordinatorLostError, EngineProtocolError
from .frontend import SimFrontend, TokenListener, WakePath, open_sim_frontend
from .load import LoadPlan, generate_load
from .timeline import Timeline, plot_timeline

__all__ = [
    "ENGINE_CLIENT_MODE",
    "AllReduceResult",
    "ClusterConfig",
    "ClusterReport",
    "CollectiveTimeoutError",
    "CoordinatorLostError",
    "EmbeddedCoordinator",
    "EngineConfig",
    "EngineCoreFleet",
    "EngineProtocolError",
    "LoadPlan",
    "Mode",
    "Progress",
    "SimEngine",
    "SimEngineCore",
    "SimFrontend",
    "Timeline",
    "TokenListener",
    "WakePath",
    "generate_load",
    "open_engine_core_fleet",
    "open_engine_fleet",
    "open_sim_engine_client",
    "open_sim_frontend",
    "plot_timeline",
    "run_cluster",
    "run_engine",
    "run_engine_core_cluster",
    "run_sim_engine",
]
