"""The sans-IO CoordinatorCore: unit tests with explicit clock readings, and a hypothesis
state machine that drives the whole core with the bytes peers send.

The wave rules themselves are checked against a reference model in ``test_wave_state.py``
and exhaustively in ``tests/test_model_check.py``; here the oracle for them is a plain
:class:`WaveState` fed the inputs the core should pass on, and what is checked is what the
core adds: the start-up gate, deferral behind READY, bounds checks, the wake-confirmation
watchdog, publish timing, and the counters.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.helpers import core_internals
from trio_dpcoord import protocol
from trio_dpcoord.core import (
    MAX_ENGINES,
    MAX_WAVE,
    Broadcast,
    CoordinatorCore,
    Effect,
    FirstRequest,
    Publish,
    Reject,
    ScaleRequest,
    WaveSnapshot,
    WaveStart,
    WaveStartCause,
    WaveState,
)
from trio_dpcoord.protocol import EngineCoreOutputs, EngineLoad, SchedulerStats

SUB = protocol.SUBSCRIBE
UNSUB = protocol.UNSUBSCRIBE


def output(engine: int, **fields: object) -> list[bytes]:
    return [protocol.encode_engine_core_outputs(EngineCoreOutputs(engine_index=engine, **fields))]  # type: ignore[arg-type]


def stats(
    engine: int,
    waiting: int,
    running: int,
    usage: float = 0.0,
    *,
    step_counter: int = 0,
    current_wave: int = 0,
) -> list[bytes]:
    return output(
        engine,
        scheduler_stats=SchedulerStats(
            num_waiting_reqs=waiting,
            num_running_reqs=running,
            kv_cache_usage=usage,
            step_counter=step_counter,
            current_wave=current_wave,
        ),
    )


def open_core(engines: int = 2, **options: object) -> tuple[CoordinatorCore, list[Effect]]:
    """A core with its gate opened at clock 0; returns it and the gate's effects."""
    core = CoordinatorCore(engines, **options)  # type: ignore[arg-type]
    effects: list[Effect] = []
    for _ in range(engines):
        effects.extend(core.receive_engine_subscription(SUB, 0.0))
    return core, effects


def starts(effects: Sequence[Effect]) -> list[tuple[int, int | bytes | None]]:
    """The START_DP_WAVE broadcasts among ``effects``, decoded from their frames."""
    found = []
    for effect in effects:
        if isinstance(effect, Broadcast) and effect.wave_start is not None:
            decoded = protocol.decode_start_dp_wave(effect.frames)
            found.append((decoded.wave, decoded.exclude_engine_index))
    return found


def publishes(effects: Sequence[Effect]) -> list[protocol.FrontPublish]:
    return [protocol.decode_front_publish(e.payload) for e in effects if isinstance(e, Publish)]


def timed_publish(core: CoordinatorCore, now: float) -> protocol.FrontPublish:
    """The timed publish the clock reaching ``now`` brings (the tick's only effect)."""
    effects = core.tick(now)
    assert len(effects) == 1 and isinstance(effects[0], Publish), effects
    return protocol.decode_front_publish(effects[0].payload)


# --- the start-up gate ---------------------------------------------------------------------


def test_nothing_leaves_before_the_gate_and_ready_goes_first() -> None:
    core = CoordinatorCore(2, publish_to_front_ends=True)
    assert core.receive_engine_subscription(SUB, 0.0) == ()
    # an engine report before the gate is applied at once, its broadcast waits
    assert core.receive_engine_output(output(1, start_wave=0), 0.5) == ()
    assert core.snapshot() == WaveSnapshot(0, True)
    claim = core.claim_first_request(0)
    assert claim is None  # already running
    assert core.receive_command(ScaleRequest(3), 0.6) == ()  # waits for the gate
    assert core.engine_count() == 2
    assert core.next_deadline() == float("inf")
    effects = core.receive_engine_subscription(SUB, 1.0)
    assert isinstance(effects[0], Broadcast) and effects[0].frames == [protocol.READY]
    assert starts(effects) == [(0, 1)]
    assert [p.current_wave for p in publishes(effects)] == [0]
    assert core.next_deadline() == float("-inf")  # the first timed publish: at once
    assert core.engine_count() == 3  # the deferred resize, applied behind READY
    assert core.gate_open() and core.subscriptions().gate_open


def test_late_subscriptions_get_ready_again_and_unsubscriptions_count() -> None:
    core, _ = open_core(2)
    assert core.receive_engine_subscription(UNSUB, 1.0) == ()
    effects = core.receive_engine_subscription(SUB, 2.0)
    assert [e.frames for e in effects if isinstance(e, Broadcast)] == [[protocol.READY]]
    view = core.subscriptions()
    assert (view.current, view.subscribed, view.unsubscribed, view.late_subscriptions) == (
        2,
        3,
        1,
        1,
    )


def test_a_late_subscriber_gets_the_running_wave_after_ready() -> None:
    """A restarted engine, or one back from a partition, missed the START_DP_WAVE of the
    wave its peers run; they wait for it in the collective, so it goes out again."""
    core, _ = open_core(2)
    core.receive_engine_output(output(0, start_wave=3), 1.0)
    core.receive_engine_subscription(UNSUB, 2.0)
    effects = core.receive_engine_subscription(SUB, 3.0)
    assert isinstance(effects[0], Broadcast) and effects[0].frames == [protocol.READY]
    assert starts(effects) == [(3, None)]
    assert effects[-1] == Broadcast(
        protocol.encode_start_dp_wave(3, None), WaveStart(3, None), 3.0, "late_subscription"
    )
    core.receive_engine_output(output(0, wave_complete=3), 4.0)
    paused = core.receive_engine_subscription(SUB, 5.0)  # paused: READY only
    assert starts(paused) == [] and len(paused) == 1


def test_ready_sent_counts_and_silent_engines() -> None:
    core, effects = open_core(3)
    for effect in effects:
        assert isinstance(effect, Broadcast)
        core.broadcast_sent(effect, 0.0)
    assert core.counters().ready_broadcasts == 1
    core.receive_engine_output(stats(2, 0, 0), 0.1)
    assert core.silent_engines() == [0, 1]


# --- waves and the first-request path --------------------------------------------------------


def test_stale_first_request_wakes_everyone_at_the_current_wave() -> None:
    """vLLM PR #46833: a FirstRequest claimed in wave 0, handled after wave_complete(0)."""
    core, _ = open_core(2)
    claim = core.claim_first_request(1)
    assert claim == FirstRequest(1, 0)
    core.receive_engine_output(output(0, wave_complete=0), 1.0)
    assert core.snapshot() == WaveSnapshot(1, False)
    effects = core.receive_command(claim, 1.5)
    assert starts(effects) == [(1, None)]
    assert core.next_deadline() == 1.5 + core.wake_confirm_timeout
    assert core.snapshot() == WaveSnapshot(1, True)


def test_a_current_first_request_excludes_its_target_and_is_counted_by_cause() -> None:
    core, _ = open_core(3)
    claim = core.claim_first_request(2)
    assert claim is not None and core.claim_first_request(0) is None  # coalesced
    effects = core.receive_command(claim, 2.0)
    assert starts(effects) == [(0, 2)]
    legacy = core.receive_front_frame(protocol.encode_legacy_first_request(1, 0), 2.1)
    assert legacy == ()  # applied at once: the wave already runs
    for effect in effects:
        if isinstance(effect, Broadcast):
            core.broadcast_sent(effect, 2.0004)
    counters = core.counters()
    assert counters.wave_starts_by_cause == {WaveStartCause.FIRST_REQUEST: 1}
    assert counters.commands == 2
    latency = counters.wake_latency
    assert latency.count == 1 and latency.sum == pytest.approx(0.0004)
    assert latency.counts[latency.bounds.index(0.0005)] == 1


def test_claim_checks_the_index_and_non_wave_mode_ignores_waves() -> None:
    core, _ = open_core(2, wave_coordination=False, publish_to_front_ends=True)
    with pytest.raises(ValueError, match="out of range"):
        core.claim_first_request(2)
    assert core.claim_first_request(1) is None
    assert core.receive_engine_output(output(0, start_wave=4), 1.0) == ()
    assert core.receive_engine_output(output(0, wave_complete=4), 1.0) == ()
    assert core.receive_command(FirstRequest(0, 0, legacy=True), 1.0) == ()
    core.receive_engine_output(stats(1, 2, 3, current_wave=7, step_counter=1), 1.1)
    assert core.snapshot() == WaveSnapshot(0, False)
    timed = timed_publish(core, 1.2)
    assert (timed.current_wave, timed.engines_running) == (0, False)
    assert timed.counts is not None and timed.counts[1] == EngineLoad(2, 3, 0.0)


# --- the wake-confirmation watchdog -------------------------------------------------------


def test_an_unconfirmed_start_goes_back_to_paused_at_its_deadline() -> None:
    core, _ = open_core(2, wake_confirm_timeout=30.0, publish_to_front_ends=True)
    claim = core.claim_first_request(0)
    assert claim is not None
    core.receive_command(claim, 10.0)
    assert timed_publish(core, 39.9).engines_running  # a heartbeat: still believed running
    assert core.next_deadline() == 40.0  # before the next heartbeat, at 44.9
    expired = core.tick(40.0)
    assert core.snapshot() == WaveSnapshot(0, False)
    assert [(p.counts, p.current_wave, p.engines_running) for p in publishes(expired)] == [
        (None, 0, False)
    ]
    assert core.counters().unconfirmed_expiries == 1
    assert core.tick(41.0) == ()  # once


def test_an_engine_report_confirms_the_start() -> None:
    core, _ = open_core(2, wake_confirm_timeout=30.0)
    claim = core.claim_first_request(0)
    assert claim is not None
    core.receive_command(claim, 10.0)
    core.receive_engine_output(output(0, start_wave=0), 10.01)  # rank 0's mirror (R8)
    assert core.tick(40.0) == ()
    assert core.snapshot() == WaveSnapshot(0, True)
    assert core.counters().unconfirmed_expiries == 0


# --- bounds checks: every bad input is a counted Reject, nothing else ----------------------


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"\xc1"], "undecodable_engine_output"),
        ([b"a", b"b"], "multipart_engine_output"),
        (stats(5, 1, 1), "unknown_engine_index"),
        (output(9, start_wave=1), "unknown_engine_index"),
        (output(0, wave_complete=MAX_WAVE), "wave_out_of_range"),
        (output(0, utility_output=[1, 2]), "non_control_output_utility_reply"),
        (output(0, finished_requests=["r"]), "non_control_output_request_batch"),
        (output(0), "non_control_output_empty"),
        (output(0, start_wave=1, wave_complete=1), "non_control_output_mixed"),
    ],
)
def test_bad_engine_outputs_are_rejected_by_reason(frames: list[bytes], reason: str) -> None:
    core, _ = open_core(2)
    before = core.snapshot()
    effects = core.receive_engine_output(frames, 1.0)
    assert len(effects) == 1 and isinstance(effects[0], Reject)
    assert effects[0].reason == reason
    assert core.counters().rejected == {reason: 1}
    assert core.counters().engine_messages == 1
    assert core.snapshot() == before


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (protocol.encode_scale_elastic_ep(MAX_ENGINES + 1), "bad_scale_request"),
        (b"\x92\xa1x\x01", "undecodable_front_message"),
        (b"\xff", "undecodable_front_message"),
    ],
)
def test_bad_front_frames_are_rejected_by_reason(frame: bytes, reason: str) -> None:
    core, _ = open_core(2, publish_to_front_ends=True)
    effects = core.receive_front_frame(frame, 1.0)
    assert [(e.reason) for e in effects if isinstance(e, Reject)] == [reason]
    assert core.counters().errors == 1


def test_a_payload_on_the_broadcast_socket_is_rejected() -> None:
    core, _ = open_core(1)
    effects = core.receive_engine_subscription(b"\x02hello", 1.0)
    assert [e.reason for e in effects if isinstance(e, Reject)] == [
        "unexpected_broadcast_socket_frame"
    ]


def test_constructor_refuses_nonsense() -> None:
    for bad in (0, MAX_ENGINES + 1, True, 2.0):
        with pytest.raises(ValueError, match="engine_count"):
            CoordinatorCore(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wake_confirm_timeout"):
        CoordinatorCore(1, wake_confirm_timeout=0)


# --- publish timing (the clock is passed in) -------------------------------------------------


def test_publish_timing_follows_the_clock_passed_in() -> None:
    core, _ = open_core(2, stats_interval=0.1, heartbeat_interval=5.0, publish_to_front_ends=True)
    assert core.next_deadline() == float("-inf")  # the first one at once
    first = timed_publish(core, 100.0)
    assert first.counts == (EngineLoad(0, 0, 0.0),) * 2
    assert core.next_deadline() == pytest.approx(105.0)  # heartbeat: no news
    assert core.tick(104.9) == ()  # not due yet
    # news moves the deadline earlier (the shell asks again after every input)
    assert core.receive_engine_output(stats(1, 4, 2, 0.5), 104.95) == ()
    assert core.next_deadline() == pytest.approx(100.1)
    assert core.receive_engine_output(stats(0, 1, 1), 104.96) == ()
    second = timed_publish(core, 105.0)
    assert second.counts == (EngineLoad(1, 1, 0.0), EngineLoad(4, 2, 0.5))
    assert core.next_deadline() == pytest.approx(110.0)


def test_a_new_front_end_gets_the_counts_at_once() -> None:
    core, _ = open_core(2, publish_to_front_ends=True)
    core.receive_engine_output(stats(0, 3, 1), 1.0)
    effects = core.receive_front_frame(SUB, 2.0)
    assert [p.counts for p in publishes(effects)] == [
        (EngineLoad(3, 1, 0.0), EngineLoad(0, 0, 0.0))
    ]
    assert core.subscriptions().front_ends == 1
    core.receive_front_frame(UNSUB, 3.0)
    assert core.subscriptions().front_ends == 0


def test_a_front_end_before_the_gate_sees_no_state_older_than_the_gate() -> None:
    """Its counts wait for the first timed publish, so they never say paused after the
    wave change that a report before the gate caused (the order vLLM's publishes have)."""
    core = CoordinatorCore(2, publish_to_front_ends=True)
    assert core.receive_front_frame(SUB, 0.1) == ()
    core.receive_engine_subscription(SUB, 0.2)
    core.receive_engine_output(output(1, start_wave=0), 0.3)
    effects = core.receive_engine_subscription(SUB, 0.4)
    assert [(p.counts, p.current_wave, p.engines_running) for p in publishes(effects)] == [
        (None, 0, True)
    ]
    assert core.next_deadline() <= 0.4
    timed = timed_publish(core, 0.4)
    assert (timed.counts, timed.current_wave, timed.engines_running) == (
        (EngineLoad(0, 0, 0.0),) * 2,
        0,
        True,
    )


def test_without_a_front_socket_nothing_is_published() -> None:
    core, _ = open_core(2)
    effects = core.receive_engine_output(output(1, start_wave=0), 1.0)
    assert publishes(effects) == [] and starts(effects) == [(0, 1)]
    assert core.next_deadline() == float("inf")
    assert core.tick(100.0) == ()


# --- the whole core, driven by random peers --------------------------------------------------

ENGINES = 3
TIMEOUT = 30.0


class CoreRules(RuleBasedStateMachine):
    """Random sequences of every input the pumps can feed, at random clock readings.

    The oracle for the wave rules is a :class:`WaveState` fed what the core should pass
    on (engine reports at once, commands only after the gate); what is checked is the
    gate, deferral behind READY, bounds, the watchdog, publishes and the counters.
    """

    def __init__(self) -> None:
        super().__init__()
        self.core = CoordinatorCore(
            ENGINES, wake_confirm_timeout=TIMEOUT, publish_to_front_ends=True
        )
        self.oracle = WaveState()
        self.now = 0.0
        self.subscribed = 0
        self.gate_open = False
        self.deferred_commands: list[FirstRequest | ScaleRequest] = []
        self.deferred_starts: list[WaveStart] = []
        self.deadlines: list[tuple[float, int]] = []
        """(deadline, wave) of each first-request start, as the core must schedule them."""
        self.last_timed_publish = 0.0
        self.engine_messages = 0
        self.rejects = 0
        self.highest_wave = 0
        self.engine_count = ENGINES

    # -- carrying out effects, and what must hold of them --

    def _apply(self, effects: Sequence[Effect], expected_starts: list[WaveStart]) -> None:
        seen_starts: list[WaveStart] = []
        for effect in effects:
            assert self.gate_open or isinstance(effect, Reject), (
                f"{effect!r} left before the gate opened"
            )
            if isinstance(effect, Broadcast):
                if effect.wave_start is not None:
                    decoded = protocol.decode_start_dp_wave(effect.frames)
                    start = effect.wave_start
                    assert (decoded.wave, decoded.exclude_engine_index) == (
                        start.wave,
                        start.exclude,
                    )
                    seen_starts.append(start)
                self.core.broadcast_sent(effect, self.now)
            elif isinstance(effect, Publish):
                protocol.decode_front_publish(effect.payload)
                self.core.publish_sent()
            else:
                self.rejects += 1
        assert seen_starts == expected_starts

    def _oracle_command(self, command: FirstRequest | ScaleRequest) -> list[WaveStart]:
        if isinstance(command, ScaleRequest):
            self.engine_count = command.engine_count
            return []
        start = self.oracle.start_wave_for_first_request(command.wave, command.engine)
        if start is None:
            return []
        self.deadlines.append((self.now + TIMEOUT, start.wave))
        return [start]

    def _command(self, command: FirstRequest | ScaleRequest, effects: Sequence[Effect]) -> None:
        expected: list[WaveStart] = []
        if self.gate_open:
            expected = self._oracle_command(command)
        else:
            self.deferred_commands.append(command)
        self._apply(effects, expected)

    # -- the rules --

    @rule(seconds=st.floats(0, 40))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @rule(subscribe=st.booleans())
    def engine_subscription(self, subscribe: bool) -> None:
        effects = self.core.receive_engine_subscription(SUB if subscribe else UNSUB, self.now)
        expected: list[WaveStart] = []
        if subscribe:
            self.subscribed += 1
            if self.gate_open and self.oracle.snapshot.engines_running:
                # a late subscriber missed the running wave's start: it goes out again
                expected = [WaveStart(self.oracle.snapshot.current_wave, None)]
            if not self.gate_open and self.subscribed >= ENGINES:
                self.gate_open = True
                assert isinstance(effects[0], Broadcast) and effects[0].frames == [protocol.READY]
                expected = self.deferred_starts
                self.deferred_starts = []
                for command in self.deferred_commands:
                    expected += self._oracle_command(command)
                self.deferred_commands = []
        else:
            self.subscribed -= 1
        self._apply(effects, expected)

    @rule(engine=st.integers(0, ENGINES), wave=st.integers(0, 8), complete=st.booleans())
    def engine_wave_report(self, engine: int, wave: int, complete: bool) -> None:
        fields = {"wave_complete" if complete else "start_wave": wave}
        effects = self.core.receive_engine_output(output(engine, **fields), self.now)
        self.engine_messages += 1
        expected: list[WaveStart] = []
        if engine < self.engine_count:
            if complete:
                self.oracle.wave_complete(wave)
            else:
                start = self.oracle.engine_start_wave(wave, engine)
                if start is not None:
                    expected = [start]
        if not self.gate_open:
            self.deferred_starts += expected
            expected = []
        self._apply(effects, expected)

    @rule(
        engine=st.integers(0, ENGINES),
        waiting=st.integers(0, 9),
        running=st.integers(0, 9),
        step=st.integers(0, 5),
    )
    def engine_stats(self, engine: int, waiting: int, running: int, step: int) -> None:
        frames = stats(engine, waiting, running, current_wave=self.highest_wave, step_counter=step)
        self.engine_messages += 1
        self._apply(self.core.receive_engine_output(frames, self.now), [])
        if engine < self.engine_count:
            assert self.core.engine_loads()[engine] == EngineLoad(waiting, running, 0.0)

    @rule(frame=st.binary(max_size=12), multipart=st.booleans())
    def engine_garbage(self, frame: bytes, multipart: bool) -> None:
        # two frames, or one that starts with 0xc1 (never used by msgpack): always bad
        frames = [frame, frame] if multipart else [b"\xc1" + frame]
        self.engine_messages += 1
        self._apply(self.core.receive_engine_output(frames, self.now), [])

    @rule(engine=st.integers(0, ENGINES - 1))
    def handle_claim(self, engine: int) -> None:
        if engine >= self.engine_count:
            return
        claim = self.core.claim_first_request(engine)
        expected = self.oracle.claim_first_request(engine)
        assert claim == expected
        if claim is not None:  # applied at once, in the caller's task, as the handle does
            self._command(claim, self.core.receive_command(claim, self.now))

    @rule(engine=st.integers(0, ENGINES - 1), wave=st.integers(0, 8))
    def legacy_first_request(self, engine: int, wave: int) -> None:
        frame = protocol.encode_legacy_first_request(engine, wave)
        effects = self.core.receive_front_frame(frame, self.now)
        self._command(FirstRequest(engine, wave, legacy=True), effects)

    @rule(count=st.integers(0, 6))
    def scale(self, count: int) -> None:
        frame = protocol.encode_scale_elastic_ep(count)
        effects = self.core.receive_front_frame(frame, self.now)
        if count == 0:
            self._apply(effects, [])  # rejected
        else:
            self._command(ScaleRequest(count), effects)

    @rule(jump=st.booleans())
    def clock_ticks(self, jump: bool) -> None:
        """The timer: at its next deadline (``jump``) or whenever it happens to wake."""
        due = self.core.next_deadline()
        if self.deadlines:
            assert due <= self.deadlines[0][0]
        if self.gate_open:  # a heartbeat at the latest
            assert due <= max(self.now, self.last_timed_publish) + 5.0
        if jump and due != float("inf"):
            self.now = max(self.now, due)
        while self.deadlines and self.deadlines[0][0] <= self.now:
            self.oracle.expire_unconfirmed_start(self.deadlines.pop(0)[1])
        effects = self.core.tick(self.now)
        self._apply(effects, [])
        snap = self.oracle.snapshot
        for payload in publishes(effects):
            assert (payload.current_wave, payload.engines_running) == (
                snap.current_wave,
                snap.engines_running,
            )
            if payload.counts is not None:  # the timed one (an expiry's carries no counts)
                assert len(payload.counts) == self.engine_count
                self.last_timed_publish = self.now

    @invariant()
    def agrees_with_the_oracle_and_counts_right(self) -> None:
        snap = self.core.snapshot()
        assert snap == self.oracle.snapshot
        assert snap.current_wave >= self.highest_wave
        self.highest_wave = snap.current_wave
        assert self.core.gate_open() == self.gate_open
        assert self.core.engine_count() == self.engine_count
        counters = self.core.counters()
        assert counters.engine_messages == self.engine_messages
        assert counters.errors == self.rejects
        assert counters.wave_starts == sum(counters.wave_starts_by_cause.values())
        assert counters.wake_latency.count == counters.wave_starts


TestCoreRules = CoreRules.TestCase
TestCoreRules.settings = settings(max_examples=250, stateful_step_count=50, deadline=None)


# --- a batch read off the socket: stats held, only each engine's newest written ------------


def engine_messages(engines: int) -> st.SearchStrategy[list[bytes]]:
    """What the engine-output socket may deliver: stats (lock-stepped or not, some for
    engines beyond the table), wave reports, and bad frames."""
    engine = st.integers(0, engines)
    return st.one_of(
        st.builds(
            lambda e, w, r, wave, step: stats(e, w, r, w / 4, current_wave=wave, step_counter=step),
            engine,
            st.integers(0, 4),
            st.integers(0, 4),
            st.integers(0, 2),
            st.integers(0, 3),
        ),
        st.builds(lambda e, w: output(e, wave_complete=w), engine, st.integers(0, 3)),
        st.builds(lambda e, w: output(e, start_wave=w), engine, st.integers(0, 3)),
        st.sampled_from([[b"\xc1"], [b"x", b"y"], output(0, finished_requests=("r",))]),
    )


class HeldStatsRules(RuleBasedStateMachine):
    """Two cores take the same inputs; one applies each engine output at once, the other
    takes batches as the listener does (stats held, the piece ended by a broadcast, then
    ``apply_held_stats``). After every piece both hold the same state and counters (but
    ``stats_coalesced``), and every effect is the same and in the same order (a
    publisher's wake-up may move within the piece); timed publishes carry the same
    bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.engines = 3
        self.now = 1.0
        self.one_by_one, _ = open_core(self.engines, publish_to_front_ends=True)
        self.batched, _ = open_core(self.engines, publish_to_front_ends=True)
        self.held_total = 0
        self.written_total = 0

    @rule(data=st.data())
    def batch(self, data: st.DataObject) -> None:
        messages = data.draw(st.lists(engine_messages(self.engines), max_size=10))
        self.now += 0.01
        index = 0
        while index < len(messages):
            expected: list[Effect] = []
            got: list[Effect] = []
            while index < len(messages):
                frames = messages[index]
                index += 1
                expected.extend(self.one_by_one.receive_engine_output(frames, self.now))
                effects = self.batched.receive_engine_output(frames, self.now, hold_stats=True)
                got.extend(effects)
                if any(isinstance(e, Broadcast) for e in effects):
                    break
            got.extend(self.batched.apply_held_stats())
            assert got == expected
            self.same_state()

    @rule(engines=st.integers(1, 4))
    def resize(self, engines: int) -> None:
        self.engines = engines
        for core in (self.one_by_one, self.batched):
            core.receive_command(ScaleRequest(engines), self.now)

    @rule(engine=st.integers(0, 3), wave=st.integers(0, 3))
    def first_request(self, engine: int, wave: int) -> None:
        command = FirstRequest(wave, min(engine, self.engines - 1))
        a = self.one_by_one.receive_command(command, self.now)
        b = self.batched.receive_command(command, self.now)
        assert a == b

    @rule(later=st.floats(0.0, 6.0))
    def timed_publish(self, later: float) -> None:
        self.now += later
        due = self.one_by_one.next_deadline()
        assert self.batched.next_deadline() == due
        assert self.batched.tick(self.now) == self.one_by_one.tick(self.now)

    @invariant()
    def same_state(self) -> None:
        a, b = self.one_by_one, self.batched
        assert b.snapshot() == a.snapshot()
        assert b.engine_loads() == a.engine_loads()
        inside_a, inside_b = core_internals(a), core_internals(b)
        assert inside_b.pending_snapshot == inside_a.pending_snapshot
        assert inside_b.stats_changed == inside_a.stats_changed
        ca, cb = a.counters(), b.counters()
        assert ca.stats_coalesced == 0
        assert cb.stats_coalesced <= cb.stats_applied
        assert replace(cb, stats_coalesced=0) == ca


TestHeldStatsRules = HeldStatsRules.TestCase
TestHeldStatsRules.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_held_stats_write_each_engines_newest_and_count_the_rest() -> None:
    core, _ = open_core(2)
    for waiting in range(3):
        for engine in range(2):
            assert core.receive_engine_output(stats(engine, waiting, 1), 1.0, hold_stats=True) == ()
    assert core.engine_loads() == ((0, 0, 0.0), (0, 0, 0.0))  # nothing written yet
    core.apply_held_stats()
    assert core.engine_loads() == ((2, 1, 0.0), (2, 1, 0.0))
    counters = core.counters()
    assert (counters.stats_applied, counters.stats_coalesced) == (6, 4)
    assert core.apply_held_stats() == ()


def test_an_expected_shutdown_is_told_at_info_and_a_mass_rejoin_is_summed_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core, _ = open_core(20)
    caplog.set_level(logging.DEBUG, logger="trio_dpcoord.core")

    def lines(level: int) -> list[str]:
        found = [r.getMessage() for r in caplog.records if r.levelno == level]
        caplog.clear()
        return found

    core.receive_engine_subscription(UNSUB, 1.0)  # an engine dies: that is news
    assert lines(logging.WARNING) == [
        "an engine unsubscribed (19 still subscribed); it will get READY again when it comes back"
    ]
    core.receive_engine_subscription(SUB, 1.5)  # it comes back
    for engine in range(20):  # every engine rejoins (a restart of the fleet)
        core.receive_engine_subscription(UNSUB, 2.0)
        core.receive_engine_subscription(SUB, 2.0 + engine / 100)
    caplog.clear()
    core.log_summaries(3.5)
    # the churn of the restart: five unsubscriptions told one by one, the rest summed up
    assert [r.getMessage()[:37] for r in caplog.records if r.levelno == logging.WARNING] == [
        "15 more engines unsubscribed in 0.0 s"
    ]
    assert lines(logging.INFO) == [
        "16 more late engine subscriptions in 0.1 s, each sent READY again (logged at DEBUG); "
        "20 subscribed"
    ]  # the one at 1.5 s and four more were told one by one
    assert core.next_deadline() == math.inf  # nothing held: nothing scheduled
    core.log_summaries(10.0, final=True)
    core.expect_shutdown()  # the fleet is stopped on purpose
    for _ in range(20):
        core.receive_engine_subscription(UNSUB, 20.0)
    core.log_summaries(20.0, final=True)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    told = [m for m in lines(logging.INFO) if "unsubscribed" in m]
    assert len(told) == 6  # five one by one, then the rest summed up
    assert told[-1].startswith("15 more engines unsubscribed in 0.0 s")
    assert core.subscriptions().unsubscribed == 41
