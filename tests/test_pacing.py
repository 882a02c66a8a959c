"""The progress pacer (sans-IO, clock readings passed in) and the start-up gate's paced log."""

from __future__ import annotations

import math

import pytest

from trio_dpcoord._pacing import ProgressPacer


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
