"""A restart as an input of the sans-IO core (docs/protocol.md §16, ``core/_recovery.py``).

Each test drives a real :class:`CoordinatorCore` that takes over from one that died
(``restarted(Recovery(...))``) with the bytes engines send, and checks what it decides:
where the wave starts, the one recovery wake, the load reports that are starts, what
settles it, and the wake's deadline. The model checker (tests/test_model_check.py)
explores the interleavings; these pin the single steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from trio_dpcoord import protocol
from trio_dpcoord.core import (
    Broadcast,
    CoordinatorCore,
    Effect,
    Publish,
    Recovery,
    WaveSnapshot,
    WaveStartCause,
)
from trio_dpcoord.protocol import EngineCoreOutputs, EngineLoad, SchedulerStats

SUB = protocol.SUBSCRIBE


def output(engine: int, **fields: object) -> list[bytes]:
    return [protocol.encode_engine_core_outputs(EngineCoreOutputs(engine_index=engine, **fields))]  # type: ignore[arg-type]


def stats(engine: int, waiting: int, running: int, *, wave: int, step: int = 0) -> list[bytes]:
    report = SchedulerStats(
        num_waiting_reqs=waiting, num_running_reqs=running, current_wave=wave, step_counter=step
    )
    return output(engine, scheduler_stats=report)


def starts(effects: Sequence[Effect]) -> list[tuple[int, int | bytes | None, str | None]]:
    """The START_DP_WAVE broadcasts among ``effects``: (wave, exclude, cause)."""
    found = []
    for effect in effects:
        if isinstance(effect, Broadcast) and effect.wave_start is not None:
            decoded = protocol.decode_start_dp_wave(effect.frames)
            found.append((decoded.wave, decoded.exclude_engine_index, effect.cause))
    return found


def published_waves(effects: Sequence[Effect]) -> list[tuple[int, bool]]:
    decoded = [protocol.decode_front_publish(e.payload) for e in effects if isinstance(e, Publish)]
    return [(p.current_wave, p.engines_running) for p in decoded]


def ready_count(effects: Sequence[Effect]) -> int:
    return sum(1 for e in effects if isinstance(e, Broadcast) and e.frames == [protocol.READY])


def restarted_core(recovery: Recovery, engines: int = 2, **options: object) -> CoordinatorCore:
    core = CoordinatorCore(engines, publish_to_front_ends=True, **options)  # type: ignore[arg-type]
    assert core.restarted(recovery, 0.0) == ()
    return core


def open_gate(core: CoordinatorCore, now: float) -> Sequence[Effect]:
    effects: list[Effect] = []
    for _ in range(core.expected_engines):
        effects.extend(core.receive_engine_subscription(SUB, now))
    return effects


RECOVERY = WaveStartCause.RECOVERY


def test_a_new_process_starts_at_the_dead_ones_wave_and_wakes_once_behind_ready() -> None:
    core = restarted_core(Recovery(wave=5))
    assert core.snapshot() == WaveSnapshot(5, False) and not core.gate_open()
    assert core.next_deadline() == float("inf")  # nothing to publish before the gate
    effects = open_gate(core, 1.0)
    assert ready_count(effects) == 1 and effects[0] == Broadcast([protocol.READY], None, 1.0)
    assert starts(effects) == [(5, None, RECOVERY)]  # nobody excluded
    assert published_waves(effects) == [(5, True)]
    assert core.snapshot() == WaveSnapshot(5, True)
    # loads are published again at once, carrying the wave it took over
    assert core.next_deadline() == float("-inf")
    (publish,) = core.tick(1.0)
    assert isinstance(publish, Publish)
    decoded = protocol.decode_front_publish(publish.payload)
    assert (decoded.current_wave, decoded.engines_running) == (5, True)
    # idle engines run one dummy wave: rank 0 mirrors its start, then ends it
    assert core.receive_engine_output(output(0, start_wave=5), 1.1) == ()
    effects = core.receive_engine_output(output(0, wave_complete=5), 1.2)
    assert published_waves(effects) == [(6, False)] and starts(effects) == []
    assert core.counters().waves_completed == 1


def test_in_place_the_gate_and_loads_carry_over_and_the_wake_goes_at_once() -> None:
    loads = (EngineLoad(2, 1, 0.5), EngineLoad(0, 3, 0.25), EngineLoad(0, 0, 0.0))
    core = CoordinatorCore(2, publish_to_front_ends=True)
    recovery = Recovery(wave=3, subscriptions=2, gate_open=True, front_ends=1, loads=loads)
    effects = core.restarted(recovery, 10.0)
    assert ready_count(effects) == 0  # READY went out before: nothing sent again
    assert starts(effects) == [(3, None, RECOVERY)]
    assert core.engine_count() == 3 and core.engine_loads() == loads  # an elastic resize kept
    view = core.subscriptions()
    assert (view.current, view.gate_open, view.front_ends) == (2, True, 1)
    assert core.next_deadline() <= 10.0
    (publish,) = core.tick(10.0)
    assert isinstance(publish, Publish)
    assert protocol.decode_front_publish(publish.payload).counts == loads
    # a late subscription after the restart is answered as before: READY, the running wave
    late = core.receive_engine_subscription(SUB, 11.0)
    assert ready_count(late) == 1 and starts(late) == [(3, None, "late_subscription")]


def test_the_wave_never_goes_back_and_the_engines_settle_it() -> None:
    core = restarted_core(Recovery(wave=7))
    # stale reports queued from before the restart change nothing
    assert core.receive_engine_output(output(1, start_wave=6), 0.1) == ()
    assert core.receive_engine_output(output(0, wave_complete=6), 0.2) == ()
    assert core.receive_engine_output(stats(1, 1, 0, wave=6), 0.3) == ()
    assert core.snapshot() == WaveSnapshot(7, False)
    # the engines ended wave 7 unobserved: rank 0's report moves the wave on, paused
    assert core.receive_engine_output(output(0, wave_complete=7), 0.4) == ()  # gate closed
    assert core.snapshot() == WaveSnapshot(8, False)
    # settled: a load report with work is a load only now...
    assert core.receive_engine_output(stats(1, 2, 0, wave=8), 0.5) == ()
    assert core.snapshot() == WaveSnapshot(8, False)
    # ...but the recovery wake is still owed at the gate (a start may have been lost)
    effects = open_gate(core, 1.0)
    assert starts(effects) == [(8, None, RECOVERY)]
    assert [w for w, _ in published_waves(effects)] == [8, 8]  # the deferred move, the wake


def test_a_running_engines_load_report_wakes_the_sleepers() -> None:
    """Its start_wave went to the dead coordinator: its load report is the only word."""
    core = restarted_core(Recovery(wave=4))
    effects = core.receive_engine_output(stats(1, 1, 0, wave=4), 0.1)
    assert effects == ()  # before the gate it waits, behind READY
    assert core.snapshot() == WaveSnapshot(4, True)
    effects = open_gate(core, 0.2)
    assert ready_count(effects) == 1
    assert starts(effects) == [(4, None, RECOVERY)]  # one start, no second wake for it
    # the running wave's further reports start nothing more
    assert core.receive_engine_output(stats(0, 0, 2, wave=4, step=9), 0.3) == ()
    assert core.counters().wave_starts_by_cause == {}  # nothing handed to ZeroMQ yet


def test_a_step_past_zero_is_running_and_a_newer_idle_wave_is_adopted() -> None:
    core = CoordinatorCore(2, publish_to_front_ends=True)
    assert starts(core.restarted(Recovery(wave=2, subscriptions=2, gate_open=True), 0.0)) == [
        (2, None, RECOVERY)
    ]
    # the engines are past wave 2 already: an idle engine's report of wave 3 moves there
    effects = core.receive_engine_output(stats(1, 0, 0, wave=3), 0.1)
    assert starts(effects) == [] and published_waves(effects) == [(3, False)]
    # an engine still stepping in wave 3 (its last request just finished) runs it
    effects = core.receive_engine_output(stats(0, 0, 0, wave=3, step=5), 0.2)
    assert starts(effects) == [(3, None, RECOVERY)]
    assert published_waves(effects) == [(3, True)]


def test_an_unanswered_recovery_wake_is_followed_by_one_probe_of_the_next_wave() -> None:
    """Paused engines at the wave drop it, engines past it ignore it: no engine answers.
    The gap of docs/protocol.md §16.4: the dead process read rank 0's wave_complete(9)
    and engine 1's start_wave(10) and applied neither; engine 1 runs wave 10 alone and
    reports nothing more. The one probe wakes everyone at 10; unanswered too, it is
    taken back (paused engines at 10 dropped it), and no further probe follows."""
    core = restarted_core(Recovery(wave=9), wake_confirm_timeout=5.0)
    open_gate(core, 1.0)
    assert core.snapshot() == WaveSnapshot(9, True)
    assert core.next_deadline() == float("-inf")
    core.tick(1.0)  # the first timed publish
    assert core.next_deadline() == 6.0  # the wake's deadline comes before the heartbeat
    effects = core.tick(6.0)
    assert starts(effects) == [(10, None, RECOVERY)]  # nobody excluded
    assert set(published_waves(effects)) == {(10, True)}  # never back to 9
    assert core.snapshot() == WaveSnapshot(10, True)
    assert core.counters().unconfirmed_expiries == 1
    assert core.next_deadline() == 11.0
    effects = core.tick(11.0)
    assert starts(effects) == [] and published_waves(effects)[0] == (10, False)
    assert core.snapshot() == WaveSnapshot(10, False)
    assert core.counters().unconfirmed_expiries == 2
    # an engine's start_wave for the wave is then a start of its own
    assert starts(core.receive_engine_output(output(1, start_wave=10), 12.0)) == [
        (10, 1, "engine_start_wave")
    ]


def test_the_probe_is_answered_and_the_lone_engines_wave_ends() -> None:
    core = restarted_core(Recovery(wave=9), wake_confirm_timeout=5.0)
    open_gate(core, 1.0)
    core.tick(1.0)
    assert starts(core.tick(6.0)) == [(10, None, RECOVERY)]
    # rank 0 joins the lone engine's wave 10 and mirrors it, then ends it
    assert core.receive_engine_output(output(0, start_wave=10), 6.1) == ()
    effects = core.receive_engine_output(output(0, wave_complete=10), 6.5)
    assert published_waves(effects) == [(11, False)] and starts(effects) == []
    assert starts(core.tick(20.0)) == []  # answered: no probe of 11
    assert core.snapshot() == WaveSnapshot(11, False)
    assert core.counters().unconfirmed_expiries == 1


def test_a_taken_back_first_request_start_is_no_probes_cue() -> None:
    """Only the recovery wake's silence is a cue: a start an engine's report settled the
    recovery with is not probed."""
    core = restarted_core(Recovery(wave=4), wake_confirm_timeout=5.0)
    open_gate(core, 1.0)
    core.receive_engine_output(output(0, start_wave=4), 1.5)  # answered
    core.receive_engine_output(output(0, wave_complete=4), 2.0)  # [wave 4 -> 5], settled
    assert core.snapshot() == WaveSnapshot(5, False)
    assert starts(core.tick(30.0)) == []
    assert core.snapshot() == WaveSnapshot(5, False)


def test_a_confirmed_wake_is_not_taken_back() -> None:
    core = restarted_core(Recovery(wave=9), wake_confirm_timeout=3.0)
    open_gate(core, 1.0)
    core.tick(1.0)  # the first timed publish
    core.receive_engine_output(output(0, start_wave=9), 1.5)  # rank 0 mirrors the start
    assert core.tick(4.0) == () and core.snapshot() == WaveSnapshot(9, True)
    assert core.counters().unconfirmed_expiries == 0


def test_an_engines_start_before_the_gate_makes_the_wake_unneeded() -> None:
    core = restarted_core(Recovery(wave=3))
    assert core.receive_engine_output(output(1, start_wave=3), 0.1) == ()
    effects = open_gate(core, 0.2)
    assert starts(effects) == [(3, 1, "engine_start_wave")]  # the only one


def test_without_a_known_wave_nobody_is_woken() -> None:
    core = restarted_core(Recovery())
    effects = open_gate(core, 0.5)
    assert ready_count(effects) == 1 and starts(effects) == []
    assert core.snapshot() == WaveSnapshot(0, False)
    # the engines' reports still move it on: an idle engine at wave 12
    effects = core.receive_engine_output(stats(0, 0, 0, wave=12), 0.6)
    assert published_waves(effects) == [(12, False)]


def test_without_wave_coordination_a_restart_only_carries_loads() -> None:
    loads = (EngineLoad(1, 1, 0.5), EngineLoad(0, 0, 0.0))
    core = CoordinatorCore(2, wave_coordination=False, publish_to_front_ends=True)
    effects = core.restarted(Recovery(wave=4, subscriptions=2, gate_open=True, loads=loads), 0.0)
    assert effects == ()
    assert core.receive_engine_output(stats(0, 3, 0, wave=0, step=2), 0.1) == ()
    (publish,) = core.tick(0.1)
    assert isinstance(publish, Publish)
    decoded = protocol.decode_front_publish(publish.payload)
    assert (decoded.current_wave, decoded.engines_running) == (0, False)
    assert decoded.counts == (EngineLoad(3, 0, 0.0), loads[1])


def test_restarted_must_be_a_fresh_cores_first_input() -> None:
    core = CoordinatorCore(2)
    core.receive_engine_subscription(SUB, 0.0)
    with pytest.raises(ValueError, match="first input"):
        core.restarted(Recovery(wave=1), 0.0)
    fresh = CoordinatorCore(2)
    fresh.restarted(Recovery(wave=1), 0.0)
    with pytest.raises(ValueError, match="first input"):
        fresh.restarted(Recovery(wave=1), 0.0)
