"""The engine client's sans-IO pieces: handshake state and request table."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

# private import (documented exception): the unit test of the private module itself
from trio_dpcoord._engine_protocol import (
    EngineHandshakeError,
    HandshakeState,
    RequestState,
    RequestTable,
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
    assert state.done
    assert state.ready[1]["num_gpu_blocks"] == 8


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
    assert table.fail_rank(0) == (["a", "c"], [call])
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
        requests, calls = self.table.fail_rank(rank)
        assert set(requests) == {r for r, k in self.model.items() if k == rank}
        assert set(calls) == {c for c, k in self.calls.items() if k == rank}
        self.model = {r: k for r, k in self.model.items() if k != rank}
        self.calls = {c: k for c, k in self.calls.items() if k != rank}

    @invariant()
    def agrees(self) -> None:
        assert set(self.table.in_flight()) == set(self.model)
        for rid, rank in self.model.items():
            assert self.table.rank_of(rid) == rank
        assert set(self.table.pending_calls()) == set(self.calls)


TestRequestTableMachine = RequestTableMachine.TestCase
