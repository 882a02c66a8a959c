"""The supervisor's rules, sans-IO, on a fake clock (``trio_dpcoord/_supervisor.py``):
a crash loop is workers that never served; a worker that served is replaced every time,
the pause before the next doubling from 0 to 1 s while each dies soon after serving; the
watchdog kills a worker not bound in time or silent too long."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_dpcoord._heartbeat import HeartbeatWriter, read_heartbeat
from trio_dpcoord._supervisor import (
    MAX_FAILED_STARTS,
    MAX_PAUSE,
    QUICK_DEATH,
    RULE,
    RestartRule,
    WorkerWatch,
)


def test_workers_that_never_served_give_up_at_the_fifth_in_a_row() -> None:
    rule = RestartRule()
    verdicts = [rule.died(float(t), None) for t in range(MAX_FAILED_STARTS)]
    assert [v.give_up for v in verdicts] == [False] * (MAX_FAILED_STARTS - 1) + [True]
    assert [v.failed_starts for v in verdicts] == list(range(1, MAX_FAILED_STARTS + 1))
    assert [v.pause for v in verdicts] == [0.0] * MAX_FAILED_STARTS  # no pause: it ends soon
    assert not any(v.served for v in verdicts)


def test_one_worker_that_served_resets_the_count_of_failed_starts() -> None:
    rule = RestartRule()
    for t in range(MAX_FAILED_STARTS - 1):
        assert not rule.died(float(t), None).give_up
    served = rule.died(100.0, served_at=90.0)
    assert served.served and not served.give_up and served.pause == 0.0
    for t in range(MAX_FAILED_STARTS - 1):
        assert not rule.died(200.0 + t, None).give_up
    assert rule.died(300.0, None).give_up


def test_a_worker_that_served_is_replaced_every_time_and_the_pause_is_bounded() -> None:
    rule = RestartRule()
    now, pauses = 0.0, []
    for _ in range(100):  # each dies 0.1 s after it began to serve: a tight loop
        served_at = now + 0.05
        now = served_at + 0.1
        verdict = rule.died(now, served_at)
        assert not verdict.give_up and verdict.served
        pauses.append(verdict.pause)
        now += verdict.pause
    assert pauses[:7] == [0.0, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert max(pauses) == MAX_PAUSE


def test_a_worker_that_served_long_enough_resets_the_pause() -> None:
    rule = RestartRule()
    for t in range(4):
        rule.died(float(t), served_at=t - 0.1)  # quick deaths: the pause grows
    assert rule.died(10.0, served_at=10.0 - QUICK_DEATH).pause == 0.0
    assert rule.died(20.0, served_at=19.9).pause == 0.0  # doubling starts from 0 again
    assert rule.died(30.0, served_at=29.9).pause == 0.1


def test_failed_starts_neither_pause_nor_reset_the_pause_of_quick_deaths() -> None:
    """A storm that kills some workers before they serve: those start the next at once,
    and the pause of quick deaths after serving goes on from where it was."""
    rule = RestartRule()
    assert rule.died(1.0, served_at=0.9).pause == 0.0
    assert rule.died(2.0, served_at=1.9).pause == 0.1
    assert [rule.died(3.0 + t, None).pause for t in range(4)] == [0.0] * 4
    assert rule.died(8.0, served_at=7.9).pause == 0.2


def test_kills_one_second_apart_are_never_paused() -> None:
    """The kill storm of the issue: a worker killed 1 s after the last death, serving
    again 0.1-0.45 s after it, is replaced at once every time."""
    rule = RestartRule()
    for kill in range(1, 21):
        served_at = kill - 1 + 0.1 + 0.35 * (kill % 2)
        verdict = rule.died(float(kill), served_at)
        assert verdict == verdict.__class__(False, 0.0, True, 0)


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 100)), max_size=60))
def test_never_gives_up_while_failed_starts_are_interrupted(
    deaths: list[tuple[bool, float]],
) -> None:
    rule = RestartRule()
    now, in_a_row = 0.0, 0
    for served, lived in deaths:
        now += lived
        verdict = rule.died(now, now - lived if served else None)
        in_a_row = 0 if served else in_a_row + 1
        assert verdict.give_up == (in_a_row >= MAX_FAILED_STARTS)
        assert 0.0 <= verdict.pause <= MAX_PAUSE
        if verdict.give_up:
            break


def test_rejects_a_budget_below_one() -> None:
    with pytest.raises(ValueError, match="max_failed_starts"):
        RestartRule(0)


def test_the_watchdog_kills_a_worker_that_does_not_bind_in_time() -> None:
    watch = WorkerWatch(0.0, start_deadline=30.0, silence_deadline=3.0)
    assert watch.overdue(29.9) is None
    reason = watch.overdue(30.1)
    assert reason is not None and "did not bind its addresses within 30 s" in reason


def test_the_watchdog_kills_a_silent_worker_and_not_a_beating_one() -> None:
    watch = WorkerWatch(0.0, silence_deadline=3.0)
    watch.bound(1.0)
    now = 1.0
    for beat in range(1, 100):  # a beat every 0.1 s, one 2.5 s late
        now += 2.5 if beat == 50 else 0.1
        watch.heartbeat(beat, gate_open=False, now=now)
        assert watch.overdue(now + 0.05) is None
    assert watch.longest_silence == pytest.approx(2.5)
    assert watch.overdue(now + 3.0) is None
    reason = watch.overdue(now + 3.2)
    assert reason is not None and "silent for 3.2 s" in reason and "hung" in reason
    # the same reading again is no sign of life
    watch.heartbeat(99, gate_open=True, now=now + 3.3)
    assert watch.overdue(now + 3.3) is not None


def test_serving_begins_when_the_gate_opens_after_binding() -> None:
    watch = WorkerWatch(0.0)
    assert not watch.heartbeat(1, gate_open=True, now=0.5)  # not bound yet: not serving
    watch.bound(1.0)
    assert not watch.heartbeat(2, gate_open=False, now=1.1)
    assert watch.served_at is None
    assert watch.heartbeat(3, gate_open=True, now=1.2)
    assert not watch.heartbeat(4, gate_open=True, now=1.3)
    assert watch.served_at == 1.2


def test_without_a_heartbeat_binding_is_serving() -> None:
    watch = WorkerWatch(0.0, silence_deadline=0.0)
    watch.bound(0.5, serving=True)
    assert watch.served_at == 0.5
    assert watch.overdue(1000.0) is None  # the silence deadline 0: off


def test_the_heartbeat_record_round_trips_beside_the_wave(tmp_path: object) -> None:
    import os
    from pathlib import Path

    path = str(Path(str(tmp_path)) / "wave")
    wave_fields = bytes(range(24))  # the wave file's own 24 bytes (WaveFile's layout)
    with open(path, "wb") as wave:
        wave.write(wave_fields)
    writer = HeartbeatWriter(path, interval=0.1, pid=4242)
    writer.beat(10.0, gate_open=False)
    writer.beat(10.6, gate_open=True)  # 0.5 s late
    writer.beat(10.7, gate_open=False)  # the gate, once open, stays so in the record
    fd = os.open(path, os.O_RDONLY)
    try:
        beat = read_heartbeat(fd)
    finally:
        os.close(fd)
    writer.close()
    assert beat is not None
    assert (beat.pid, beat.beats, beat.gate_open) == (4242, 3, True)
    assert beat.longest_silence == pytest.approx(0.5)
    with open(path, "rb") as wave:
        assert wave.read(24) == wave_fields  # the wave's own fields are untouched


def test_the_rule_is_one_sentence() -> None:
    assert RULE.count(". ") == 0 and "replaced every time" in RULE
