"""Helpers shared by several test files (what one file needs stays in that file)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from trio_dpcoord import protocol
from trio_dpcoord.core import Command, CoordinatorCore, Effect
from trio_dpcoord.sim import EngineConfig, SimFrontend

__all__ = ["CoreInternals", "core_internals", "sim_engine_config"]


def sim_engine_config(
    rank: int,
    engine_count: int,
    back_publish_address: str,
    back_output_address: str,
    frontend: SimFrontend,
    tmp_path: Path,
    **overrides: object,
) -> EngineConfig:
    """One simulated engine as the tests run it: connected to a coordinator's engine
    sockets and to ``frontend``, its DP group's collective in ``tmp_path``, stepping
    fast (1 ms steps, a collective every 4 steps); ``overrides`` are other
    :class:`~trio_dpcoord.sim.EngineConfig` fields (each test file sets the collective
    timeout its faults need)."""
    settings: dict[str, object] = {"step_time": 0.001, "sync_interval": 4}
    settings.update(overrides)
    return EngineConfig(
        rank=rank,
        engine_count=engine_count,
        back_publish_address=back_publish_address,
        back_output_address=back_output_address,
        request_address=frontend.request_address,
        completion_address=frontend.completion_address,
        collective_address=f"ipc://{tmp_path}/collective",
        **settings,  # type: ignore[arg-type]
    )


# --- white-box: a core's private decision state ----------------------------------------


class CoreInternals(NamedTuple):
    """What a :class:`~trio_dpcoord.core.CoordinatorCore` decides with beyond its public
    reads (see :func:`core_internals`): what a model checker memoises states by, and what
    two cores fed the same inputs two ways must agree on."""

    first_request_pending: bool
    """A wake-up was claimed and its :class:`~trio_dpcoord.core.FirstRequest` not applied."""
    unconfirmed_wave: int | None
    """The wave a first request started that no engine has reported on yet."""
    deferred: tuple[Effect, ...]
    """Effects decided before the start-up gate opened: they come out behind READY."""
    deferred_commands: tuple[Command, ...]
    """Commands received before the gate opened: applied behind READY."""
    pending_snapshot: tuple[protocol.EngineLoad, ...] | None
    """The load table's lock-step snapshot, waiting for the next timed publish."""
    stats_changed: bool
    """Whether the load table has news for the next timed publish."""
    recovering: bool
    """The core took over from a dead coordinator and the engines have not settled it."""
    recovery_wake_owed: bool | None
    """While recovering: whether the recovery wake is still to go out (None otherwise)."""


def core_internals(core: CoordinatorCore) -> CoreInternals:
    """A copy of ``core``'s private decision state (:class:`CoreInternals`); read-only."""
    wave, loads = core._wave, core._loads
    return CoreInternals(
        wave.first_request_pending,
        wave.unconfirmed_wave,
        tuple(core._gate.deferred),
        tuple(core._gate.deferred_commands),
        loads.pending_snapshot,
        loads.stats_changed,
        core._rules.recovery is not None,
        None if core._rules.recovery is None else core._rules.recovery.wake_owed,
    )
