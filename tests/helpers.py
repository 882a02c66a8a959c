"""Helpers shared by several test files (what one file needs stays in that file)."""

from __future__ import annotations

from pathlib import Path

from trio_dpcoord.sim import EngineConfig, SimFrontend

__all__ = ["sim_engine_config"]


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
