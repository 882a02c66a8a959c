"""A picture of the waves: what the timeline records, and the drawn file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trio

from trio_dpcoord.sim import ClusterConfig, LoadPlan, plot_timeline, run_cluster

LAUNCHER = Path(__file__).resolve().parents[2] / "examples" / "launch_cluster.py"
GUARD = 120.0  # engine processes on a shared 2-core machine


async def test_timeline_records_every_wave_on_every_engine_and_draws_it(tmp_path: Path) -> None:
    config = ClusterConfig(
        engines=2,
        load=LoadPlan(requests=60, seed=3, burst=(5, 15), gap=(0.05, 0.1), pause_every=2),
        record_timeline=True,
    )
    lines: list[str] = []
    with trio.fail_after(GUARD):
        report = await run_cluster(config, log_line=lines.append)
    assert report.ok, (report.to_json(), lines)
    timeline = report.timeline
    assert timeline is not None and timeline.end is not None
    spans = timeline.spans()
    assert all(timeline.start <= s.start <= s.end <= timeline.end for s in spans)
    running = [s for s in spans if s.state == "running"]
    waves = [{s.wave for s in running if s.rank == rank} for rank in range(2)]
    # Lock-step: every wave ran on both engines, and at least the completed ones show.
    assert waves[0] == waves[1]
    assert len(waves[0]) >= report.waves >= 2
    started = [wave for _, wave in timeline.wave_starts()]
    assert started == sorted(set(started))  # each wave starts once, in order
    # Every wake-up the front-end measured is drawn; every pause shows on both ranks.
    assert len(timeline.wakes) == len(report.wake_latencies) >= 1
    assert all(0 < end - start < 30 for start, end in timeline.wakes)
    for rank in range(2):
        paused = [s for s in spans if s.state == "paused" and s.rank == rank]
        assert len(paused) == report.pauses >= 1
    counts = [n for _, n in timeline.in_flight]
    assert max(counts) >= 5 and counts[-1] == 0
    assert len(counts) >= 2 * report.completed // 8  # a change per submit, per finishing step

    png, svg = tmp_path / "waves.png", tmp_path / "waves.svg"
    plot_timeline(timeline, png)
    plot_timeline(timeline, svg, title="two engines")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert png.stat().st_size > 20_000
    assert b"<svg" in svg.read_bytes()[:1000]
    assert svg.stat().st_size > 50_000


async def test_launcher_timeline_option_writes_the_picture(tmp_path: Path) -> None:
    picture = tmp_path / "run.png"
    with trio.fail_after(GUARD):
        result = await trio.run_process(
            [
                sys.executable,
                str(LAUNCHER),
                "--engines=2",
                "--requests=30",
                f"--timeline={picture}",
                "--json",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    stdout = result.stdout.decode()
    assert result.returncode == 0, (stdout, result.stderr.decode())
    assert f"timeline: {picture}" in stdout
    assert json.loads(stdout.strip().splitlines()[-1])["ok"] is True
    assert picture.read_bytes().startswith(b"\x89PNG")
    assert picture.stat().st_size > 20_000
