"""The sans-IO core's public vocabulary: what goes into :class:`CoordinatorCore` and what
comes out of it (h11's ``_events.py`` plays this part for HTTP).

An embedder that drives the core itself, a test, a benchmark or a model checker imports
everything it needs from here; the private modules behind it may change shape freely.

Inputs
    Raw frames from a socket and clock readings (``receive_engine_output``,
    ``receive_front_frame``, ``receive_engine_subscription``, ...), *commands*, and
    the one timer input: :meth:`CoordinatorCore.next_deadline` (a pure query) and
    :meth:`CoordinatorCore.tick` (timed publishes and wake-confirmation deadlines).
    The commands are :class:`FirstRequest` (a front-end routed a request to paused
    engines: the embedding front-end's comes from
    :meth:`CoordinatorCore.claim_first_request`, a legacy front-end's off the front
    socket) and :class:`ScaleRequest` (elastic EP); ``Command`` is their union, and
    :meth:`CoordinatorCore.receive_command` the one path that applies them
    (``receive_front_frame`` calls it itself).

Outputs: *effects*, in the order they must be carried out
    ===========================  ======================================================
    effect                       what the shell does with it
    ===========================  ======================================================
    :class:`Broadcast`           send its frames on the engine broadcast socket, then
                                 call :meth:`CoordinatorCore.broadcast_sent`
    :class:`Publish`             send its payload on the front socket, then call
                                 :meth:`CoordinatorCore.publish_sent`
    :class:`Reject`              log it (the core has already counted it)
    ===========================  ======================================================

    ``Effect`` is their union. A :class:`Broadcast` carries its :class:`WaveStart`
    (``None`` for READY).

Reads (methods, like trio's ``statistics()``)
    :meth:`CoordinatorCore.snapshot` (a :class:`WaveSnapshot`),
    :meth:`CoordinatorCore.subscriptions` (a :class:`SubscriptionView`),
    :meth:`CoordinatorCore.counters` (a :class:`CoordinatorStatistics`, with its
    :class:`HistogramSnapshot` of wake latency; the keys of ``wave_starts_by_cause`` are
    :class:`WaveStartCause` values).

:class:`FrontendState` is the same for a front-end following a standalone coordinator
(what :class:`~trio_dpcoord.Frontend` knows and decides): the latest publish, the legacy
first-request claim, the engine choice and its in-flight counts.

:class:`WaveState` is the wave rule on its own (``(current_wave, engines_running)`` and
vLLM PR #46833's stale-first-request rule), for oracles and model checkers that want to
compare the whole core against it; :class:`LoadTable` and :class:`PublishSchedule` are
its load table (a :class:`StatsOutcome` says what it did with each report) and publish
timing, :class:`IngestBacklog` and :class:`BurstSummary` /
:class:`ProgressPacer` the ingest backlog's news and the pacing of repeated log lines.

:class:`Recovery` is what a core taking over from one that died is told
(:meth:`CoordinatorCore.restarted`, the first input of a fresh core; docs/protocol.md §16).

:class:`HandshakeState`, :class:`RequestTable` and :class:`SilenceWatch` are the engine
client's sans-IO rooms (:class:`~trio_dpcoord.EngineClient` moves bytes around them):
which ranks said HELLO and READY, which request is on which rank, which busy rank has
been silent too long.
"""

from __future__ import annotations

from ._backlog import BacklogNews, IngestBacklog
from ._coordinator import CoordinatorCore
from ._counters import CoordinatorStatistics, HistogramSnapshot, SubscriptionView
from ._effects import (
    MAX_ENGINES,
    MAX_WAVE,
    Broadcast,
    Command,
    Effect,
    Publish,
    Reject,
    ScaleRequest,
    WaveStartCause,
)
from ._engine_client import HandshakeState, RequestState, RequestTable, SilenceWatch
from ._frontend import FrontendState, FrontendStatistics
from ._pacing import BurstSummary, ProgressPacer
from ._recovery import Recovery, RecoveryRules
from ._wave import (
    HEARTBEAT_INTERVAL,
    FirstRequest,
    LoadTable,
    PublishSchedule,
    StatsOutcome,
    WaveSnapshot,
    WaveStart,
    WaveState,
)

__all__ = [
    "HEARTBEAT_INTERVAL",
    "MAX_ENGINES",
    "MAX_WAVE",
    "BacklogNews",
    "Broadcast",
    "BurstSummary",
    "Command",
    "CoordinatorCore",
    "CoordinatorStatistics",
    "Effect",
    "FirstRequest",
    "FrontendState",
    "FrontendStatistics",
    "HandshakeState",
    "HistogramSnapshot",
    "IngestBacklog",
    "LoadTable",
    "ProgressPacer",
    "Publish",
    "PublishSchedule",
    "Recovery",
    "RecoveryRules",
    "Reject",
    "RequestState",
    "RequestTable",
    "ScaleRequest",
    "SilenceWatch",
    "StatsOutcome",
    "SubscriptionView",
    "WaveSnapshot",
    "WaveStart",
    "WaveStartCause",
    "WaveState",
]
