"""The soak: a long run against the standalone coordinator; not in CI's
default run (``-m "not slow"``). Figures of a full run are in benchmarks/README.md."""

from __future__ import annotations

import pytest
import trio

from trio_dpcoord.sim.soak import SoakConfig, run_soak


@pytest.mark.slow
async def test_soak_ten_thousand_waves_and_a_million_engine_messages() -> None:
    config = SoakConfig(waves=10_000, messages=1_000_000)
    with trio.fail_after(20 * 60):
        report = await run_soak(config)
    assert report.failures == []
    assert report.waves >= 10_000
    assert report.coordinator_engine_messages is not None
    assert report.coordinator_engine_messages >= 1_000_000
    assert report.stranded == 0 and report.completed == report.requests
    assert report.wave_regressions == 0
    assert report.final_wave >= report.waves
    assert report.coordinator_errors == 0
    assert report.rss_growth_percent < 5.0, report.to_json()
