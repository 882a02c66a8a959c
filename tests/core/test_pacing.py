"""The progress pacer (sans-IO, clock readings passed in) and the start-up gate's paced log."""

from __future__ import annotations

import math

import pytest

from trio_dpcoord.core import BurstSummary, ProgressPacer


def test_first_change_at_once_then_the_newest_at_most_once_per_interval() -> None:
    pacer = ProgressPacer(1.0, logged=0)
    assert pacer.next_due(0) == math.inf  # nothing new to tell
    assert not pacer.should_log(0, 0.0)
    assert pacer.next_due(1) == -math.inf  # the first change is due at once
    assert pacer.should_log(1, 0.0)
    told = [1]
    for step in range(1, 100):  # a count rising every 10 ms for a second
        now = step / 100
        if pacer.should_log(step + 1, now):
            told.append(step + 1)
    assert told == [1]  # everything in that second held back...
    assert pacer.next_due(100) == 1.0  # ...until the interval has passed
    assert pacer.should_log(100, 1.0)
    assert not pacer.should_log(100, 5.0)  # a reading already told is never due again
    assert pacer.should_log(101, 5.0)


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval"):
        ProgressPacer(0)


def test_a_burst_is_told_by_its_first_events_and_one_summary() -> None:
    burst = BurstSummary(interval=1.0, individually=3)
    assert burst.summary_due() == math.inf
    told = [burst.admit(i / 1000) for i in range(2000)]  # 2,000 events in 2 s
    # the first window (0-1 s) tells 3, holds the rest; at 1 s the held count blocks a new
    # window until it is summed up, so those events are told rather than lost
    assert told[:3] == [True, True, True] and not any(told[3:1000])
    assert burst.summary_due() == 1.0
    assert burst.take_summary(0.999) is None
    assert burst.take_summary(1.0) == (997, 0.003, 0.999)
    assert burst.take_summary(1.0) is None  # counted once
    # a quiet second after the summed-up window: a new burst, told by its first events
    assert burst.admit(2.5) and burst.admit(2.6) and burst.admit(2.7) and not burst.admit(2.8)
    assert burst.take_summary(2.9, final=True) == (1, 2.8, 2.8)  # stopping: said at once
    assert burst.summary_due() == math.inf


def test_a_burst_that_goes_on_is_told_by_one_summary_a_window() -> None:
    burst = BurstSummary(interval=1.0, individually=3)
    lines = 0
    for i in range(5000):  # 5,000 events over 5 s: a flood a loaded machine spreads out
        now = i / 1000
        summary = burst.take_summary(now)
        lines += summary is not None
        lines += burst.admit(now)
    summary = burst.take_summary(5.0, final=True)
    lines += summary is not None
    assert lines == 3 + 5  # the first three events, then one summary for each window
    assert burst.admit(6.5)  # a second of quiet after the last window: told again


def test_a_skipped_summary_never_loses_events() -> None:
    burst = BurstSummary(interval=1.0, individually=1)
    assert burst.admit(0.0) and not burst.admit(0.5)
    assert burst.admit(5.0)  # window over but not summed up: told, not held
    assert burst.take_summary(5.0) == (1, 0.5, 0.5)
