"""The engine-output backlog rule (sans-IO): the gauge, one WARNING while behind at a
steady pace, one INFO once caught up; clock readings passed in."""

from __future__ import annotations

import logging

import pytest

from trio_dpcoord.core import BacklogNews, CoordinatorCore, IngestBacklog


def test_keeping_up_says_nothing_and_reads_zero() -> None:
    backlog = IngestBacklog(warn_after=2.0, warn_every=30.0)
    for tick in range(100):
        now = tick * 0.05
        # full batches now and then, but the queue empties between them
        assert backlog.batch_read(drained=tick % 3 == 0, coalesced=5, now=now) is None
        if tick % 3 == 0:
            assert backlog.behind_for(now) == 0.0


def test_behind_one_warning_per_interval_then_one_info() -> None:
    backlog = IngestBacklog(warn_after=2.0, warn_every=30.0)
    news = []
    now = 0.0
    while now < 70.0:  # 70 s of full batches, 10 reports superseded in each
        found = backlog.batch_read(drained=False, coalesced=10, now=now)
        if found is not None:
            news.append((now, found))
        now += 0.5
    assert [at for at, _ in news] == [2.0, 32.0, 62.0]
    assert news[0][1] == BacklogNews(False, 2.0, 50)  # 5 batches of 10 so far
    assert backlog.behind_for(69.5) == 69.5
    caught_up = backlog.batch_read(drained=True, coalesced=10, now=70.0)
    assert caught_up == BacklogNews(True, 70.0, 1410)
    assert backlog.behind_for(70.0) == 0.0
    # a short backlog later: under warn_after, so no line at all, not even the INFO
    assert backlog.batch_read(drained=False, coalesced=0, now=80.0) is None
    assert backlog.batch_read(drained=False, coalesced=0, now=81.0) is None
    assert backlog.batch_read(drained=True, coalesced=0, now=81.5) is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="warn_after"):
        IngestBacklog(warn_after=0)


def test_the_core_logs_the_backlog_and_shows_it_in_its_counters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core = CoordinatorCore(2)
    caplog.set_level(logging.INFO, logger="trio_dpcoord.core")
    for tick in range(20):
        core.engine_output_batch_read(drained=False, now=tick * 0.25)
    assert core.counters().engine_output_backlog == 4.75
    assert core.engine_output_backlog(5.0) == 5.0
    core.engine_output_batch_read(drained=True, now=5.0)
    assert core.counters().engine_output_backlog == 0.0
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["WARNING", "INFO"]
    assert lines[0][1].startswith("engine output socket behind for 2.0 s")
    assert lines[1][1].startswith("engine output socket caught up after 5.0 s behind")
