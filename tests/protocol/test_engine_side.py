"""The engine's side of the wire: aborts, utility calls and answers, the engine handshake as
the client's handshake state reads it, KV-event batches."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.protocol.wire import (
    U64,
)
from trio_dpcoord.core import HandshakeState
from trio_dpcoord.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineCoreOutputs,
    EngineHandshakeError,
    EventBatch,
    HandshakeMetadata,
    KVEventError,
    ProtocolError,
    UtilityCall,
    UtilityResult,
    decode_abort,
    decode_engine_core_outputs,
    decode_event_batch,
    decode_handshake,
    decode_handshake_metadata,
    decode_kv_event_frames,
    decode_ready_response,
    decode_utility,
    decode_utility_output,
    encode_abort,
    encode_engine_core_outputs,
    encode_event_batch,
    encode_handshake_hello,
    encode_handshake_metadata,
    encode_handshake_ready,
    encode_kv_event_frames,
    encode_ready_response,
    encode_utility,
    encode_utility_output,
    engine_identity,
)

# ------------------------------------------------------------------ the engine's side


def test_abort_as_an_engine_reads_it() -> None:
    assert decode_abort(encode_abort(["req-1", "req-2"])) == ("req-1", "req-2")
    assert decode_abort(encode_abort([])) == ()


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x01"],
        [b"\x03", msgpack.packb(["a"])],
        [b"\x01", msgpack.packb("a")],
        [b"\x01", msgpack.packb(["a", 1])],
        [b"\x01", b"\xc1"],
        [b"\x01", msgpack.packb(["a"]), b""],
    ],
)
def test_bad_abort(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_abort(frames)


def test_utility_call_as_an_engine_reads_it() -> None:
    frames = encode_utility(2, 7, "pause_scheduler", ["keep"])
    assert decode_utility(frames) == UtilityCall(2, 7, "pause_scheduler", ("keep",))
    no_args = [b"\x03", msgpack.packb([0, 1, "is_sleeping", None])]
    assert decode_utility(no_args) == UtilityCall(0, 1, "is_sleeping")


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x03"],
        [b"\x01", msgpack.packb([0, 1, "m", []])],
        [b"\x03", msgpack.packb([0, 1, "m"])],
        [b"\x03", msgpack.packb(["0", 1, "m", []])],
        [b"\x03", msgpack.packb([0, 1, 2, []])],
        [b"\x03", b"\xc1"],
    ],
)
def test_bad_utility_call(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_utility(frames)


@given(
    st.integers(0, 2**16),
    st.integers(0, U64),
    st.text(max_size=20),
    st.lists(st.integers(-5, 5) | st.text(max_size=5), max_size=3),
)
def test_utility_call_round_trip(client: int, call_id: int, method: str, args: list[Any]) -> None:
    call = decode_utility(encode_utility(client, call_id, method, args))
    assert call == UtilityCall(client, call_id, method, tuple(args))


@pytest.mark.parametrize(
    ("failure", "result"),
    [(None, {"paused": True}), (None, None), ("Call to nope method failed", None)],
)
def test_utility_answer_reaches_the_client_as_sent(failure: str | None, result: Any) -> None:
    answer = encode_utility_output(9, failure, result)
    frame = encode_engine_core_outputs(EngineCoreOutputs(engine_index=1, utility_output=answer))
    sent = decode_engine_core_outputs(frame).utility_output
    assert decode_utility_output(sent) == UtilityResult(9, failure, result)


METADATA = {
    "addresses": {
        "inputs": ["tcp://10.0.0.1:5000"],
        "outputs": ["tcp://10.0.0.1:5001"],
        "coordinator_input": "ipc:///run/in",
        "coordinator_output": "ipc:///run/out",
        "frontend_stats_publish_address": None,
    },
    "parallel_config": {"data_parallel_size": 2},
}


def test_engine_handshake_is_what_the_client_accepts() -> None:
    """An engine's HELLO, READY and ready response, through the client's handshake state;
    the client's answer as the engine reads it."""
    state = HandshakeState([0, 1], METADATA)
    hello = decode_handshake(encode_handshake_hello(local=False, headless=True))
    assert hello == {"status": "HELLO", "local": False, "headless": True}
    answer = state.receive(engine_identity(1), hello)
    assert answer is not None
    assert decode_handshake_metadata(encode_handshake_metadata(answer)) == HandshakeMetadata(
        inputs=("tcp://10.0.0.1:5000",),
        outputs=("tcp://10.0.0.1:5001",),
        coordinator_input="ipc:///run/in",
        coordinator_output="ipc:///run/out",
        parallel_config={"data_parallel_size": 2},
    )
    ready = decode_handshake(encode_handshake_ready(num_gpu_blocks=64, parallel_config_hash="h"))
    assert state.receive(engine_identity(1), ready) is None
    assert state.ready[1] == {
        "status": "READY",
        "local": True,
        "headless": True,
        "num_gpu_blocks": 64,
        "dp_stats_address": None,
        "parallel_config_hash": "h",
    }
    response = encode_ready_response(
        max_model_len=4096, num_gpu_blocks=64, data_parallel_rank=1, vllm_version="0.33.0"
    )
    state.receive_ready_response(engine_identity(1), decode_ready_response(response))
    assert state.ready_responses[1]["data_parallel_rank"] == 1
    assert state.ready_responses[1]["vllm_version"] == "0.33.0"
    # without DP (no hash) the READY leaves the key out, as vLLM's engines do
    alone = decode_handshake(encode_handshake_ready(num_gpu_blocks=64))
    assert "parallel_config_hash" not in alone


@pytest.mark.parametrize(
    "metadata",
    [
        {"parallel_config": {}},
        {"addresses": {"inputs": "tcp://a:1", "outputs": []}},
        {"addresses": {"inputs": [1], "outputs": []}},
        {"addresses": {"inputs": [], "outputs": [], "coordinator_input": 5}},
        {"addresses": {"inputs": [], "outputs": []}, "parallel_config": [1]},
    ],
)
def test_bad_handshake_metadata(metadata: dict[str, Any]) -> None:
    with pytest.raises(EngineHandshakeError):
        decode_handshake_metadata(encode_handshake_metadata(metadata))
    with pytest.raises(EngineHandshakeError):
        decode_handshake_metadata(msgpack.packb([1]))
    with pytest.raises(ProtocolError):
        decode_handshake_metadata(b"\xc1")


def test_kv_event_batch_round_trip() -> None:
    batch = EventBatch(
        12.5,
        [
            BlockStored([1, 2], None, list(range(8)), 4),
            BlockStored([b"\x03" * 32], 2, [8, 9, 10, 11], 4),
            BlockRemoved([7, 8]),
            AllBlocksCleared(),
        ],
        3,
    )
    payload = encode_event_batch(batch)
    assert decode_event_batch(payload) == batch
    assert decode_kv_event_frames(encode_kv_event_frames(41, payload)) == (41, payload)
    assert (
        decode_event_batch(encode_event_batch(EventBatch(0.5, [], None))).data_parallel_rank is None
    )


def test_kv_event_batch_layout_is_vllms() -> None:
    """msgspec's layout (vllm/distributed/kv_events.py): the batch array-like with the
    default rank left out, each event a map tagged by "type", fields in declaration
    order; the frames (topic, 8-byte big-endian seq, payload)."""
    stored = BlockStored([5], None, [1, 2], 2)
    payload = encode_event_batch(EventBatch(1.0, [stored, BlockRemoved([5])], 0))
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (1.0, 0)
    assert [list(event) for event in events] == [
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
        ],
        ["type", "block_hashes", "medium"],
    ]
    assert [event["type"] for event in events] == ["BlockStored", "BlockRemoved"]
    assert len(msgpack.unpackb(encode_event_batch(EventBatch(1.0, [], None)))) == 2
    assert encode_kv_event_frames(258, b"p", b"kv") == [b"kv", (258).to_bytes(8, "big"), b"p"]


def test_kv_event_hash_beyond_64_bits_is_refused() -> None:
    with pytest.raises(KVEventError):
        encode_event_batch(EventBatch(0.0, [BlockRemoved([1 << 64])], 0))
