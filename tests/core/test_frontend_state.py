"""The front-end's sans-IO state (:class:`FrontendState`): publishes in, frames out.

What :class:`~trio_dpcoord.Frontend` does over a real socket (tests/shell/test_frontend.py),
here as plain calls with clock readings: the latest publish wins, a bad one is counted
and the rest of its batch kept, the legacy first-request claim sends one FIRST_REQ per
paused wave, and the engine choice counts this front-end's requests in flight.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_dpcoord import CoordinatorError, WaveSnapshot, protocol
from trio_dpcoord.core import FrontendState, Reject
from trio_dpcoord.protocol import EngineLoad, FrontPublish


def publish(wave: int, running: bool, counts: tuple[EngineLoad, ...] | None = None) -> bytes:
    return protocol.encode_front_publish(FrontPublish(counts, wave, running))


def loads(*waiting: int) -> tuple[EngineLoad, ...]:
    return tuple(EngineLoad(waiting=w, running=0, kv_cache_usage=0.0) for w in waiting)


def fresh(engine_count: int | None = None) -> FrontendState:
    return FrontendState(client_index=0, client_count=1, engine_count=engine_count, now=10.0)


def test_before_any_publish_the_state_is_paused_wave_zero_and_idle() -> None:
    state = fresh(engine_count=3)
    assert state.snapshot() == WaveSnapshot(0, False)
    assert state.engine_loads() == loads(0, 0, 0)
    assert state.statistics().publishes_received == 0
    assert state.statistics().last_publish_time is None
    assert state.silent_since() == 10.0
    assert fresh().engine_loads() == ()


def test_the_latest_publish_of_a_batch_wins_and_counts_survive_a_wave_only_publish() -> None:
    state = fresh()
    frames = [publish(1, True, loads(2, 0)), publish(2, True), publish(2, False)]
    assert state.receive_publishes(frames, now=11.5) == []
    assert state.snapshot() == WaveSnapshot(2, False)
    assert state.engine_loads() == loads(2, 0)  # the wave-only publishes carry no counts
    assert state.statistics().publishes_received == 3
    assert state.statistics().last_publish_time == 11.5
    assert state.silent_since() == 11.5


def test_an_undecodable_publish_is_counted_and_the_rest_of_the_batch_kept() -> None:
    state = fresh()
    rejects = state.receive_publishes([b"\xc1", publish(4, True)], now=12.0)
    assert [r.reason for r in rejects] == ["undecodable_front_publish"]
    assert isinstance(rejects[0], Reject)
    assert state.statistics().rejected == {"undecodable_front_publish": 1}
    assert state.snapshot() == WaveSnapshot(4, True)
    # a batch of nothing but bad frames changes no state, not even the silence
    state.receive_publishes([b"\xc1"], now=13.0)
    assert state.statistics().rejected == {"undecodable_front_publish": 2}
    assert state.statistics().last_publish_time == 12.0


def test_statistics_is_a_frozen_copy_and_engine_count_a_property() -> None:
    state = fresh()
    assert state.engine_count == 0
    state.receive_publishes([publish(1, True, loads(0, 0, 0))], now=11.0)
    assert state.engine_count == 3
    engine = state.choose()
    before = state.statistics()
    state.receive_publishes([publish(2, False), b"\xc1"], now=12.0)
    state.finished(engine)
    assert (before.publishes_received, before.last_publish_time) == (1, 11.0)
    assert before.rejected == {} and sum(before.inflight) == 1
    assert before.router is None and before.disconnects == 0
    after = state.statistics(disconnects=2)
    assert (after.publishes_received, after.last_publish_time) == (2, 12.0)
    assert after.inflight == (0, 0, 0) and after.disconnects == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.publishes_received = 5  # type: ignore[misc]


def test_the_first_request_claim_sends_one_first_req_per_paused_wave() -> None:
    state = fresh(engine_count=2)
    state.receive_publishes([publish(5, False)], now=11.0)
    frame = state.claim_first_request(1)
    assert frame is not None
    assert protocol.decode_front_message(frame) == protocol.LegacyFirstRequest(1, 5)
    assert state.snapshot() == WaveSnapshot(5, True)  # concurrent requests coalesce
    assert state.claim_first_request(0) is None
    # the next publish that says paused re-arms the claim
    state.receive_publishes([publish(6, False)], now=12.0)
    frame = state.claim_first_request(0)
    assert frame is not None
    assert protocol.decode_front_message(frame) == protocol.LegacyFirstRequest(0, 6)


def test_a_bad_engine_index_is_the_callers_mistake() -> None:
    state = fresh(engine_count=2)
    with pytest.raises(TypeError):
        state.claim_first_request("0")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        state.claim_first_request(True)
    with pytest.raises(ValueError, match="out of range"):
        state.claim_first_request(2)
    with pytest.raises(ValueError, match="out of range"):
        state.claim_first_request(-1)
    assert state.snapshot() == WaveSnapshot(0, False)  # nothing was claimed
    # with the engine count unknown, any index >= 0 is taken
    assert fresh().claim_first_request(7) is not None


def test_resize_is_validated_and_encoded() -> None:
    frame = FrontendState.resize(4)
    assert protocol.decode_front_message(frame) == protocol.ScaleElasticEP(4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError):
            FrontendState.resize(bad)  # type: ignore[arg-type]


def test_bad_construction_arguments_are_rejected() -> None:
    with pytest.raises(ValueError):
        FrontendState(client_index=1, client_count=1, engine_count=None, now=0.0)
    with pytest.raises(ValueError):
        FrontendState(client_index=0, client_count=0, engine_count=None, now=0.0)
    with pytest.raises(ValueError):
        FrontendState(client_index=0, client_count=1, engine_count=0, now=0.0)


def test_choose_needs_an_engine_count() -> None:
    with pytest.raises(CoordinatorError, match="engine count unknown"):
        fresh().choose()


@given(st.lists(st.sampled_from(["choose", "finish0", "finish1", "finish2"]), max_size=40))
def test_in_flight_counts_follow_choices_and_finishes(steps: list[str]) -> None:
    state = fresh(engine_count=3)
    expected = [0, 0, 0]
    for step in steps:
        if step == "choose":
            expected[state.choose()] += 1
        else:
            engine = int(step[-1])
            state.finished(engine)
            if expected[engine] and state.statistics().inflight:
                expected[engine] -= 1
        if state.statistics().inflight:
            assert list(state.statistics().inflight) == expected
    assert all(n >= 0 for n in state.statistics().inflight)
