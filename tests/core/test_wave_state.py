"""The sans-IO wave state machine, load table and publish schedule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_dpcoord.core import (
    FirstRequest,
    LoadTable,
    PublishSchedule,
    StatsOutcome,
    WaveSnapshot,
    WaveStart,
    WaveState,
)
from trio_dpcoord.protocol import EngineLoad, StatsReport

# --- the two cases of vLLM PR #46833, stated literally -----------------------------------


def test_current_first_request_excludes_its_target() -> None:
    state = WaveState(WaveSnapshot(3, False))
    assert state.start_wave_for_first_request(3, 2) == WaveStart(3, 2)
    assert state.snapshot == WaveSnapshot(3, True)


def test_stale_first_request_wakes_everyone_at_the_current_wave() -> None:
    state = WaveState(WaveSnapshot(4, False))
    assert state.start_wave_for_first_request(3, 2) == WaveStart(4, None)
    assert state.snapshot == WaveSnapshot(4, True)


# --- the basic rules ------------------------------------------------------------------------


def test_wave_complete_moves_forward_and_pauses() -> None:
    state = WaveState(WaveSnapshot(5, True))
    assert state.wave_complete(5)
    assert state.snapshot == WaveSnapshot(6, False)


def test_wave_complete_for_a_later_wave_jumps_past_it() -> None:
    state = WaveState(WaveSnapshot(2, False))
    assert state.wave_complete(7)
    assert state.snapshot == WaveSnapshot(8, False)


def test_old_wave_complete_is_ignored() -> None:
    state = WaveState(WaveSnapshot(6, True))
    assert not state.wave_complete(5)
    assert state.snapshot == WaveSnapshot(6, True)


@pytest.mark.parametrize(
    ("before", "wave", "expected"),
    [
        (WaveSnapshot(3, False), 3, WaveStart(3, 1)),  # same wave, paused: start it
        (WaveSnapshot(3, False), 5, WaveStart(5, 1)),  # newer wave: jump
        (WaveSnapshot(3, True), 4, WaveStart(4, 1)),  # newer wave while running: jump
        (WaveSnapshot(3, True), 3, None),  # duplicate for the running wave
        (WaveSnapshot(3, False), 2, None),  # stale
        (WaveSnapshot(3, True), 2, None),  # stale
    ],
)
def test_engine_start_wave_rules(
    before: WaveSnapshot, wave: int, expected: WaveStart | None
) -> None:
    state = WaveState(before)
    assert state.engine_start_wave(wave, 1) == expected
    if expected is None:
        assert state.snapshot == before
    else:
        assert state.snapshot == WaveSnapshot(expected.wave, True)


def test_first_request_while_running_is_ignored() -> None:
    state = WaveState(WaveSnapshot(3, True))
    assert state.start_wave_for_first_request(3, 0) is None
    assert state.snapshot == WaveSnapshot(3, True)


def test_claims_coalesce_behind_one_broadcast() -> None:
    state = WaveState(WaveSnapshot(2, False))
    claims = [state.claim_first_request(i % 4) for i in range(100)]
    assert claims[0] == FirstRequest(0, 2)
    assert claims[1:] == [None] * 99
    assert state.snapshot == WaveSnapshot(2, True)
    assert state.start_wave_for_first_request(2, 0) == WaveStart(2, 0)
    assert not state.first_request_pending


# --- the races of docs/protocol.md §8 ----------------------------------------------------------


def test_r1_stale_first_request_after_wave_complete_does_not_rewind() -> None:
    """R1: FirstRequest{W} queued, wave W completes, then the request is handled."""
    state = WaveState(WaveSnapshot(7, False))
    claimed = state.claim_first_request(1)
    assert claimed == FirstRequest(1, 7)
    assert state.wave_complete(7)  # handled before the queued first request
    assert state.snapshot == WaveSnapshot(8, False)
    assert state.start_wave_for_first_request(claimed.wave, claimed.engine) == WaveStart(8, None)
    assert state.snapshot == WaveSnapshot(8, True)


def test_r1_claim_then_engine_start_then_first_request_broadcasts_once() -> None:
    """A claim pending while an engine reports start_wave: exactly one broadcast."""
    state = WaveState(WaveSnapshot(4, False))
    claimed = state.claim_first_request(2)
    assert claimed is not None
    # the snapshot already says running, so the engine's report is a duplicate
    assert state.engine_start_wave(4, 2) is None
    assert state.start_wave_for_first_request(claimed.wave, claimed.engine) == WaveStart(4, 2)
    assert state.snapshot == WaveSnapshot(4, True)


def test_r2_request_stamped_for_a_finished_wave() -> None:
    state = WaveState(WaveSnapshot(4, True))
    assert state.wave_complete(4)
    # engine 2 got a request stamped 4, keeps 5 and reports start_wave(5)
    assert state.engine_start_wave(5, 2) == WaveStart(5, 2)
    assert state.snapshot == WaveSnapshot(5, True)


def test_r3_start_wave_overtakes_wave_complete() -> None:
    state = WaveState(WaveSnapshot(4, True))
    assert state.engine_start_wave(5, 2) == WaveStart(5, 2)
    assert not state.wave_complete(4)  # late, ignored
    assert state.snapshot == WaveSnapshot(5, True)
    assert state.engine_start_wave(4, 1) is None  # stale
    assert state.engine_start_wave(5, 1) is None  # duplicate


@pytest.mark.parametrize("order", list(itertools.permutations(["complete", "start", "first"])))
def test_every_interleaving_of_wave_end_restart_and_first_request(order: tuple[str, ...]) -> None:
    """Wave 4 runs; rank 0 completes it, engine 2 restarts at 5, a front-end's FIRST_REQ
    stamped 4 for engine 1 arrives: whatever the order, the wave ends at 5, running,
    never rewinds, and the engines are woken by at most one broadcast per accepted start.
    """
    state = WaveState(WaveSnapshot(4, True))
    starts: list[WaveStart] = []
    waves = [4]
    for step in order:
        if step == "complete":
            state.wave_complete(4)
        elif step == "start":
            start = state.engine_start_wave(5, 2)
            if start is not None:
                starts.append(start)
        else:
            start = state.start_wave_for_first_request(4, 1)
            if start is not None:
                starts.append(start)
        waves.append(state.snapshot.current_wave)
    assert waves == sorted(waves)
    assert state.snapshot == WaveSnapshot(5, True)
    assert all(s.wave == 5 for s in starts)
    assert WaveStart(5, 2) in starts or WaveStart(5, None) in starts
    # a stale (wave 4) first request never excludes its target
    assert WaveStart(5, 1) not in starts


def test_r8_rank0_mirror_after_the_coordinator_missed_the_start() -> None:
    state = WaveState(WaveSnapshot(9, False))
    assert state.engine_start_wave(9, 0) == WaveStart(9, 0)
    assert state.engine_start_wave(9, 0) is None  # the mirror of a start we already know


def test_unconfirmed_first_request_start_does_not_latch_running() -> None:
    """#51476/#51481: paused engines drop the broadcast; without an engine's word the
    coordinator goes back to paused, so the next start_wave for the wave is accepted."""
    state = WaveState(WaveSnapshot(2, False))
    assert state.start_wave_for_first_request(2, 0) == WaveStart(2, 0)
    assert state.unconfirmed_wave == 2
    assert state.expire_unconfirmed_start(2)
    assert state.snapshot == WaveSnapshot(2, False)
    # after resume, an engine with a kept request starts the wave: accepted, not a duplicate
    assert state.engine_start_wave(2, 1) == WaveStart(2, 1)
    assert not state.expire_unconfirmed_start(2)  # nothing left unconfirmed
    assert state.snapshot == WaveSnapshot(2, True)


@pytest.mark.parametrize("confirmation", ["mirror", "complete", "newer_start"])
def test_an_engine_report_confirms_the_start(confirmation: str) -> None:
    state = WaveState(WaveSnapshot(5, False))
    state.start_wave_for_first_request(5, 3)
    if confirmation == "mirror":
        assert state.engine_start_wave(5, 0) is None  # rank 0's mirror (R8)
        expected = WaveSnapshot(5, True)
    elif confirmation == "complete":
        assert state.wave_complete(5)
        expected = WaveSnapshot(6, False)
    else:
        assert state.engine_start_wave(6, 2) == WaveStart(6, 2)
        expected = WaveSnapshot(6, True)
    assert state.unconfirmed_wave is None
    assert not state.expire_unconfirmed_start(5)
    assert state.snapshot == expected


# --- a stateful property test against a reference model --------------------------------------


class WaveRules(RuleBasedStateMachine):
    """Random sequences of every input, checked against a plain reference model."""

    def __init__(self) -> None:
        super().__init__()
        self.state = WaveState()
        self.model_wave = 0
        self.model_running = False
        self.model_pending = False
        self.queued: list[FirstRequest] = []
        self.highest_wave_seen = 0
        self.model_unconfirmed: int | None = None

    def _model_confirm(self, wave: int) -> None:
        if self.model_unconfirmed is not None and wave >= self.model_unconfirmed:
            self.model_unconfirmed = None

    def _check_unchanged_when_ignored(self, before: WaveSnapshot, start: WaveStart | None) -> None:
        if start is None:
            assert self.state.snapshot == before

    @rule(wave=st.integers(0, 12))
    def wave_complete(self, wave: int) -> None:
        before = self.state.snapshot
        changed = self.state.wave_complete(wave)
        self._model_confirm(wave)
        if self.model_wave <= wave:
            self.model_wave, self.model_running = wave + 1, False
        else:
            assert not changed
            assert self.state.snapshot == before

    @rule(wave=st.integers(0, 12), engine=st.integers(0, 3))
    def engine_start_wave(self, wave: int, engine: int) -> None:
        before = self.state.snapshot
        start = self.state.engine_start_wave(wave, engine)
        self._model_confirm(wave)
        accepted = wave > self.model_wave or (wave == self.model_wave and not self.model_running)
        if accepted:
            assert start == WaveStart(wave, engine)
            self.model_wave, self.model_running = wave, True
            self.model_pending = False  # everyone is woken: a pending claim is moot
        else:
            assert start is None
        self._check_unchanged_when_ignored(before, start)

    @rule(engine=st.integers(0, 3))
    def claim(self, engine: int) -> None:
        claimed = self.state.claim_first_request(engine)
        if self.model_running:
            assert claimed is None
        else:
            assert claimed == FirstRequest(engine, self.model_wave)
            self.model_running = self.model_pending = True
            self.queued.append(claimed)

    @precondition(lambda self: bool(self.queued))
    @rule()
    def handle_claimed(self) -> None:
        request = self.queued.pop(0)
        self._handle(request.wave, request.engine)

    @rule(wave=st.integers(0, 12), engine=st.integers(0, 3))
    def legacy_first_request(self, wave: int, engine: int) -> None:
        self._handle(wave, engine)

    def _handle(self, wave: int, engine: int | bytes | None) -> None:
        before = self.state.snapshot
        start = self.state.start_wave_for_first_request(wave, engine)
        acts = self.model_pending or not self.model_running
        self.model_pending = False
        if acts:
            assert start is not None
            assert start.wave == self.model_wave  # the current wave, never the request's
            if wave < self.model_wave:
                assert start.exclude is None  # a stale request is never excluded
            else:
                assert start.exclude == engine
            self.model_running = True
            self.model_unconfirmed = self.model_wave
        else:
            assert start is None
        self._check_unchanged_when_ignored(before, start)

    @rule(wave=st.integers(0, 12))
    def expire_unconfirmed_start(self, wave: int) -> None:
        before = self.state.snapshot
        changed = self.state.expire_unconfirmed_start(wave)
        expected = (
            self.model_unconfirmed == wave and self.model_running and (self.model_wave == wave)
        )
        assert changed == expected
        if expected:
            self.model_running = self.model_pending = False
            self.model_unconfirmed = None
        else:
            assert self.state.snapshot == before

    @invariant()
    def matches_model_and_never_rewinds(self) -> None:
        snap = self.state.snapshot
        assert snap == WaveSnapshot(self.model_wave, self.model_running)
        assert self.state.first_request_pending == self.model_pending
        assert self.state.unconfirmed_wave == self.model_unconfirmed
        assert snap.current_wave >= self.highest_wave_seen
        self.highest_wave_seen = snap.current_wave


TestWaveRules = WaveRules.TestCase
TestWaveRules.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


# --- load table -------------------------------------------------------------------------------


def report(
    waiting: int, running: int, usage: float, *, wave: int = 0, step: int = 0
) -> StatsReport:
    return StatsReport(
        EngineLoad(waiting=waiting, running=running, kv_cache_usage=usage), wave=wave, step=step
    )


def test_load_table_applies_and_reports_unknown_engines() -> None:
    table = LoadTable(3)
    assert table.apply_stats(1, report(3, 12, 0.4375, wave=0, step=1)) is StatsOutcome.APPLIED
    assert table.loads() == ((0, 0, 0.0), (3, 12, 0.4375), (0, 0, 0.0))
    assert table.apply_stats(3, report(1, 1, 0.0)) is StatsOutcome.UNKNOWN_ENGINE
    assert table.apply_stats(-1, report(1, 1, 0.0)) is StatsOutcome.UNKNOWN_ENGINE
    assert table.loads()[1] == (3, 12, 0.4375)


def test_lockstep_snapshot_captures_counts_at_the_step_boundary() -> None:
    table = LoadTable(2)
    table.apply_stats(0, report(1, 0, 0.0, wave=0, step=1))
    table.apply_stats(1, report(2, 0, 0.0, wave=0, step=1))
    # first report of step 2: the counts as of the end of step 1 are kept
    table.apply_stats(0, report(0, 5, 0.5, wave=0, step=2))
    assert table.pending_snapshot == ((1, 0, 0.0), (2, 0, 0.0))
    assert table.take_publish_counts() == ((1, 0, 0.0), (2, 0, 0.0))
    assert table.stats_changed  # the live counts follow
    assert table.take_publish_counts() == ((0, 5, 0.5), (2, 0, 0.0))
    assert not table.stats_changed


def test_slower_engine_is_not_out_of_order_but_a_regression_is() -> None:
    table = LoadTable(2)
    table.apply_stats(0, report(0, 1, 0.0, wave=1, step=5))
    # engine 1 is still reporting step 4: behind the others, but in order for itself
    assert table.apply_stats(1, report(0, 1, 0.0, wave=1, step=4)) is StatsOutcome.APPLIED
    assert table.apply_stats(0, report(0, 2, 0.0, wave=1, step=3)) is StatsOutcome.OUT_OF_ORDER
    assert table.loads()[0] == (0, 2, 0.0)  # still applied, as vLLM does


def test_non_lockstep_table_never_snapshots() -> None:
    table = LoadTable(2, lockstep=False)
    table.apply_stats(0, report(1, 0, 0.0))
    table.apply_stats(0, report(2, 0, 0.0, wave=3, step=9))
    assert table.pending_snapshot is None
    assert table.take_publish_counts() == ((2, 0, 0.0), (0, 0, 0.0))


def test_resize_grows_with_zero_loads_and_truncates() -> None:
    table = LoadTable(2)
    table.apply_stats(1, report(4, 4, 0.25))
    table.take_publish_counts()
    table.resize(4)
    assert table.stats_changed  # the next timed publish carries the new size
    assert table.loads() == ((0, 0, 0.0), (4, 4, 0.25), (0, 0, 0.0), (0, 0, 0.0))
    table.resize(1)
    assert table.loads() == ((0, 0, 0.0),)
    assert table.apply_stats(1, report(9, 9, 0.9)) is StatsOutcome.UNKNOWN_ENGINE


@given(
    reports=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.integers(0, 50),
            st.integers(0, 50),
            st.floats(0, 1),
            st.integers(0, 3),
            st.integers(0, 20),
        ),
        max_size=60,
    )
)
def test_load_table_live_counts_are_the_last_report_per_engine(
    reports: list[tuple[int, int, int, float, int, int]],
) -> None:
    table = LoadTable(4)
    last: dict[int, tuple[int, int, float]] = {}
    for engine, waiting, running, usage, wave, step in reports:
        table.apply_stats(engine, report(waiting, running, usage, wave=wave, step=step))
        last[engine] = (waiting, running, usage)
        assert table.stats_changed
    assert table.loads() == tuple(last.get(i, (0, 0, 0.0)) for i in range(4))


# --- publish schedule (sans-IO timing, the clock is passed in) ------------------------------


def test_publish_schedule_first_publish_is_due_at_once() -> None:
    schedule = PublishSchedule(interval=0.1, heartbeat=5.0)
    assert schedule.next_due(LoadTable(1)) == float("-inf")


def test_publish_schedule_heartbeat_and_interval() -> None:
    table = LoadTable(1)
    schedule = PublishSchedule(interval=0.1, heartbeat=5.0)
    schedule.published(10.0)
    assert schedule.next_due(table) == pytest.approx(15.0)
    table.apply_stats(0, report(1, 1, 0.0))
    assert schedule.next_due(table) == pytest.approx(10.1)
    table.take_publish_counts()
    schedule.published(10.1)
    assert schedule.next_due(table) == pytest.approx(15.1)


def test_publish_schedule_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="positive"):
        PublishSchedule(interval=0)


# --- a batch of reports: only the newest of each engine written, the same table -----------

positions = st.tuples(st.integers(0, 2), st.integers(0, 4))
stats_reports = st.builds(
    lambda load, position: report(load, load % 3, load / 8, wave=position[0], step=position[1]),
    st.integers(0, 7),
    positions,
)


def table_state(table: LoadTable) -> tuple[object, ...]:
    """Everything a load table holds (what every later input and publish depends on)."""
    return (
        table.loads(),
        table.cursors,
        table.step_cursor,
        table.pending_snapshot,
        table.stats_changed,
    )


class BatchedTableRules(RuleBasedStateMachine):
    """A table fed batches with :meth:`LoadTable.apply_stats_batch` and one fed the same
    reports one by one hold the same state after every batch, and between batches take
    the same publishes; the batch says how many reports it did not write, and which were
    out of order, as one by one would have said."""

    def __init__(self) -> None:
        super().__init__()
        self.one_by_one: LoadTable | None = None
        self.batched: LoadTable | None = None

    @precondition(lambda self: self.one_by_one is None)
    @rule(engines=st.integers(1, 4), lockstep=st.booleans())
    def start(self, engines: int, lockstep: bool) -> None:
        self.one_by_one = LoadTable(engines, lockstep=lockstep)
        self.batched = LoadTable(engines, lockstep=lockstep)

    @precondition(lambda self: self.one_by_one is not None)
    @rule(data=st.data())
    def batch(self, data: st.DataObject) -> None:
        assert self.one_by_one is not None and self.batched is not None
        engines = self.one_by_one.engine_count
        reports = data.draw(
            st.lists(st.tuples(st.integers(0, engines - 1), stats_reports), max_size=12)
        )
        out_of_order = [
            (engine, r)
            for engine, r in reports
            if self.one_by_one.apply_stats(engine, r) is StatsOutcome.OUT_OF_ORDER
        ]
        superseded, batched_out_of_order = self.batched.apply_stats_batch(reports)
        assert superseded == len(reports) - len({engine for engine, _ in reports})
        assert batched_out_of_order == out_of_order

    @precondition(lambda self: self.one_by_one is not None)
    @rule()
    def publish(self) -> None:
        assert self.one_by_one is not None and self.batched is not None
        assert self.one_by_one.take_publish_counts() == self.batched.take_publish_counts()

    @precondition(lambda self: self.one_by_one is not None)
    @rule(engines=st.integers(1, 4))
    def resize(self, engines: int) -> None:
        assert self.one_by_one is not None and self.batched is not None
        self.one_by_one.resize(engines)
        self.batched.resize(engines)

    @invariant()
    def same_table(self) -> None:
        if self.one_by_one is not None and self.batched is not None:
            assert table_state(self.batched) == table_state(self.one_by_one)


TestBatchedTableRules = BatchedTableRules.TestCase
TestBatchedTableRules.settings = settings(max_examples=300, stateful_step_count=30)


def test_a_batch_keeps_the_counts_before_the_last_step_advance() -> None:
    """Engines 0 and 1 report step 1, then step 2 in turn: the snapshot of step 1 needs
    engine 1's step-1 report, superseded in the same batch by its step-2 report."""
    table = LoadTable(2)
    superseded, _ = table.apply_stats_batch(
        [
            (0, report(1, 0, 0.0, step=1)),
            (1, report(2, 0, 0.0, step=1)),
            (0, report(3, 0, 0.0, step=2)),
            (1, report(4, 0, 0.0, step=2)),
        ]
    )
    assert superseded == 2
    assert table.take_publish_counts() == ((1, 0, 0.0), (2, 0, 0.0))  # as step 1 ended
    assert table.take_publish_counts() == ((3, 0, 0.0), (4, 0, 0.0))  # the live counts
