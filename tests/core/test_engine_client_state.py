"""The engine client's sans-IO pieces: handshake state and request table."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from trio_dpcoord.core import HandshakeState, RequestState, RequestTable, SilenceWatch
from trio_dpcoord.protocol import (
    ENGINE_CORE_DEAD,
    EngineDead,
    EngineHandshakeError,
    ProtocolError,
    SamplingParams,
    UtilityResult,
    decode_engine_frames,
    decode_utility_output,
    encode_abort,
    encode_add,
    encode_utility,
    engine_identity,
    rank_of_identity,
)

METADATA = {"addresses": {"inputs": ["tcp://127.0.0.1:1"]}, "parallel_config": {}}


def test_identity_round_trips_and_is_vllms_two_little_endian_bytes() -> None:
    assert engine_identity(1) == b"\x01\x00"
    assert engine_identity(258) == b"\x02\x01"
    assert rank_of_identity(engine_identity(300)) == 300
    with pytest.raises(EngineHandshakeError):
        rank_of_identity(b"\x01")


def test_hello_is_answered_and_ready_completes() -> None:
    state = HandshakeState([0, 1], METADATA)
    assert state.receive(engine_identity(1), {"status": "HELLO"}) == METADATA
    assert state.missing() == [0, 1]
    assert state.receive(engine_identity(1), {"status": "READY", "num_gpu_blocks": 8}) is None
    assert state.missing() == [0]
    assert not state.done
    state.receive(engine_identity(0), {"status": "HELLO"})
    state.receive(engine_identity(0), {"status": "READY"})
    assert state.missing() == []
    assert not state.done  # the ready responses on the input socket are still due
    assert "no ready response on the input socket: ranks [0, 1]" in state.describe_missing()
    state.receive_ready_response(engine_identity(0), {"data_parallel_rank": 0})
    state.receive_ready_response(engine_identity(1), {"data_parallel_rank": 1})
    assert state.done
    assert state.ready[1]["num_gpu_blocks"] == 8
    with pytest.raises(EngineHandshakeError, match="twice"):
        state.receive_ready_response(engine_identity(1), {})


@pytest.mark.parametrize(
    ("steps", "bad"),
    [
        ([], (5, "HELLO")),
        ([], (0, "READY")),
        ([(0, "HELLO")], (0, "HELLO")),
        ([(0, "HELLO"), (0, "READY")], (0, "READY")),
        ([], (0, "BOGUS")),
    ],
)
def test_out_of_order_handshake_is_refused(
    steps: list[tuple[int, str]], bad: tuple[int, str]
) -> None:
    state = HandshakeState([0, 1], METADATA)
    for rank, status in steps:
        state.receive(engine_identity(rank), {"status": status})
    with pytest.raises(EngineHandshakeError):
        state.receive(engine_identity(bad[0]), {"status": bad[1]})


def test_request_table_fails_only_the_dead_ranks_work() -> None:
    table = RequestTable()
    table.add("a", 0)
    table.add("b", 1)
    table.add("c", 0)
    call = table.new_call(0)
    other_call = table.new_call(1)
    with pytest.raises(ValueError):
        table.add("a", 1)
    assert table.fail_engine(0) == (["a", "c"], [call])
    assert table.in_flight() == ["b"]
    assert table.pending_calls() == [other_call]
    assert table.finish("b", RequestState.ABORTED)
    assert not table.finish("b")
    assert table.complete_call(other_call)
    assert not table.complete_call(other_call)


class RequestTableMachine(RuleBasedStateMachine):
    """The table agrees with a plain model under any order of operations."""

    def __init__(self) -> None:
        super().__init__()
        self.table = RequestTable()
        self.model: dict[str, int] = {}
        self.calls: dict[int, int] = {}

    @rule(rid=st.sampled_from("abcdef"), rank=st.integers(0, 2))
    def add(self, rid: str, rank: int) -> None:
        if rid in self.model:
            with pytest.raises(ValueError):
                self.table.add(rid, rank)
        else:
            self.table.add(rid, rank)
            self.model[rid] = rank

    @rule(rid=st.sampled_from("abcdef"))
    def finish(self, rid: str) -> None:
        assert self.table.finish(rid) == (self.model.pop(rid, None) is not None)

    @rule(rank=st.integers(0, 2))
    def call(self, rank: int) -> None:
        call_id = self.table.new_call(rank)
        assert call_id not in self.calls
        self.calls[call_id] = rank

    @rule(call_id=st.integers(0, 20))
    def complete(self, call_id: int) -> None:
        assert self.table.complete_call(call_id) == (self.calls.pop(call_id, None) is not None)

    @rule(rank=st.integers(0, 2))
    def fail(self, rank: int) -> None:
        requests, calls = self.table.fail_engine(rank)
        assert set(requests) == {r for r, k in self.model.items() if k == rank}
        assert set(calls) == {c for c, k in self.calls.items() if k == rank}
        self.model = {r: k for r, k in self.model.items() if k != rank}
        self.calls = {c: k for c, k in self.calls.items() if k != rank}

    @invariant()
    def agrees(self) -> None:
        assert set(self.table.in_flight()) == set(self.model)
        for rid, rank in self.model.items():
            assert self.table.engine_index_of(rid) == rank
        assert set(self.table.pending_calls()) == set(self.calls)


TestRequestTableMachine = RequestTableMachine.TestCase


def test_metadata_per_rank_and_a_missing_report_that_names_ranks() -> None:
    state = HandshakeState([0, 1, 2], lambda rank: {"rank": rank})
    assert state.receive(engine_identity(2), {"status": "HELLO"}) == {"rank": 2}
    state.receive(engine_identity(2), {"status": "READY"})
    state.receive(engine_identity(1), {"status": "HELLO"})
    assert state.describe_missing() == (
        "never said HELLO: ranks [0]; said HELLO but not READY: ranks [1]; "
        "no ready response on the input socket: ranks [2]"
    )


def test_ranks_with_different_parallel_config_hashes_are_refused() -> None:
    state = HandshakeState([0, 1], METADATA)
    for rank in (0, 1):
        state.receive(engine_identity(rank), {"status": "HELLO"})
    state.receive(engine_identity(0), {"status": "READY", "parallel_config_hash": "aa"})
    with pytest.raises(EngineHandshakeError, match="rank 1's parallel config hash 'bb'"):
        state.receive(engine_identity(1), {"status": "READY", "parallel_config_hash": "bb"})


def test_dead_rank_is_remembered_and_its_work_returned() -> None:
    table = RequestTable()
    table.add("a", 1)
    table.add("b", 0)
    assert table.busy_engines() == {0, 1}
    assert table.mark_dead(1) == (["a"], [])
    assert table.dead == {1}
    assert table.busy_engines() == {0}


def test_wire_messages() -> None:
    assert encode_abort(["a", "b"]) == [b"\x01", msgpack.packb(["a", "b"])]
    assert encode_utility(0, 7, "is_sleeping", ()) == [
        b"\x03",
        bytes.fromhex("940007ab69735f736c656570696e6790"),  # vLLM 0.32.0's bytes
    ]
    frames = encode_add(
        "r",
        [1, 2],
        SamplingParams(max_tokens=3),
        arrival_time=2.0,
        current_wave=4,
        data_parallel_rank=1,
    )
    items = msgpack.unpackb(frames[1])
    assert frames[0] == b"\x00" and len(items) == 22
    assert items[:2] == ["r", [1, 2]] and items[3]["max_tokens"] == 3
    assert (items[8], items[12]) == (1, 4)
    with pytest.raises(ValueError):
        encode_add("r", [], SamplingParams(), arrival_time=0.0, current_wave=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0).to_wire()


def test_engine_frames_and_utility_outputs_decode() -> None:
    assert decode_engine_frames([ENGINE_CORE_DEAD]) == EngineDead()
    output = ["r", [5, 6], None, None, None, 1]
    outputs = decode_engine_frames(
        [msgpack.packb([1, [output], None, 0.5, [3, None, [None, True]]])]
    )
    assert not isinstance(outputs, EngineDead)
    assert outputs.engine_index == 1
    assert outputs.outputs[0].new_token_ids == (5, 6) and outputs.outputs[0].finish_reason == 1
    assert decode_utility_output(outputs.utility_output) == UtilityResult(3, None, True)
    assert decode_utility_output([4, "boom", None]) == UtilityResult(4, "boom", None)
    for bad in ([], ["x"], [1, 2]):
        with pytest.raises(ProtocolError):
            decode_utility_output(bad)
    with pytest.raises(ProtocolError):
        decode_engine_frames([])
    with pytest.raises(ProtocolError):
        decode_engine_frames([b"\xc1"])


def test_silence_watch_only_times_out_busy_engines() -> None:
    watch = SilenceWatch(10.0)
    watch.sent(0, now=0.0, idle_before=True)
    assert watch.overdue(5.0, busy=[0]) == []
    assert watch.next_check(5.0, busy=[0]) == 10.0
    assert watch.overdue(10.5, busy=[0]) == [0]
    assert watch.overdue(10.5, busy=[]) == []  # idle: never overdue
    watch.heard(0, 10.5)
    assert watch.overdue(15.0, busy=[0]) == []
    watch.sent(0, now=100.0, idle_before=True)  # idle for long, then work: clock restarts
    assert watch.overdue(105.0, busy=[0]) == []
    watch.sent(0, now=108.0, idle_before=False)  # more work: the clock keeps running
    assert watch.overdue(110.5, busy=[0]) == [0]
    assert watch.next_check(0.0, busy=[]) == float("inf")
    with pytest.raises(ValueError):
        SilenceWatch(0)
