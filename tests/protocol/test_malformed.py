"""Malformed input: truncated, extended and corrupted frames of every message, encoders
refusing values vLLM could not read, and hypothesis throwing arbitrary bytes and msgpack at
every decoder: only ever a ``ProtocolError``, with a message."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.protocol.wire import (
    ECO_KIND,
    U64,
    Vectors,
    frames_of,
    msgpack_values,
    pack,
)
from trio_dpcoord import protocol as P
from trio_dpcoord.protocol import (
    SUBSCRIBE,
    UNSUBSCRIBE,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FrontPublish,
    ProtocolError,
    SchedulerStats,
    decode_abort,
    decode_engine_broadcast,
    decode_engine_core_outputs,
    decode_engine_request,
    decode_front_message,
    decode_front_publish,
    decode_request_type,
    decode_start_dp_wave,
    decode_subscription,
    decode_utility,
    encode_add_request,
    encode_engine_core_outputs,
    encode_front_publish,
    encode_legacy_first_request,
    encode_scale_elastic_ep,
    encode_start_dp_wave,
)

# ------------------------------------------------------------------ malformed input

# decoder per vector name, taking the message's frames
DECODERS: dict[str, Callable[[Sequence[bytes]], object]] = {
    "ready": decode_engine_broadcast,
    "live_ready": decode_engine_broadcast,
    "start_dp_wave_exclude_int": decode_start_dp_wave,
    "start_dp_wave_exclude_none": decode_start_dp_wave,
    "live_start_dp_wave": decode_engine_broadcast,
    **{n: (lambda f: decode_engine_core_outputs(f[0])) for n in ECO_KIND},
    **{
        n: (lambda f: decode_front_publish(f[0]))
        for n in (
            "front_publish_counts",
            "front_publish_wave_only",
            "live_front_publish_initial",
            "live_front_publish_after_stats",
            "live_front_publish_running",
            "live_front_publish_paused",
        )
    },
    **{
        n: (lambda f: decode_front_message(f[0]))
        for n in (
            "front_scale_elastic_ep",
            "legacy_first_req_int",
            "legacy_first_req_none",
            "legacy_first_req_identity_bytes",
        )
    },
    "front_to_engine_add_request_skeleton": decode_engine_request,
    "request_type_enum": lambda fs: [decode_request_type(f) for f in fs],
}
FRAME_LIST_DECODERS = {
    "ready",
    "live_ready",
    "start_dp_wave_exclude_int",
    "start_dp_wave_exclude_none",
    "live_start_dp_wave",
    "front_to_engine_add_request_skeleton",
}
# subscribe/unsubscribe: decode_subscription never rejects bytes (non-subscriptions are None)
UNDECODED = {"subscribe", "unsubscribe"}


def test_decoder_table_is_complete(vectors: Vectors) -> None:
    assert set(DECODERS) | UNDECODED == set(vectors)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_truncated_and_extended_frames_rejected(vectors: Vectors, name: str) -> None:
    frames = frames_of(vectors[name])
    decode = DECODERS[name]
    decode(frames)  # the intact message is valid
    for k, frame in enumerate(frames):
        for i in range(len(frame)):
            mutated = [*frames[:k], frame[:i], *frames[k + 1 :]]
            with pytest.raises(ProtocolError):
                decode(mutated)
        for extra in (b"\x00", b"\xc0", b"\x01\x02"):
            mutated = [*frames[:k], frame + extra, *frames[k + 1 :]]
            with pytest.raises(ProtocolError):
                decode(mutated)
    if name in FRAME_LIST_DECODERS:  # decoders that take the whole multipart message
        for k in range(len(frames)):
            with pytest.raises(ProtocolError):
                decode(frames[:k])
        with pytest.raises(ProtocolError):
            decode([*frames, b""])


def eco(*slots: Any) -> bytes:
    return pack(list(slots))


def stats_frame(**overrides: Any) -> bytes:
    m: dict[str, Any] = {
        "num_running_reqs": 1,
        "num_waiting_reqs": 2,
        "step_counter": 3,
        "current_wave": 4,
        "kv_cache_usage": 0.5,
    }
    m.update(overrides)
    return eco(0, [], m, 1.0)


NOT_MSGPACK = [
    b"",
    b"\xc1",  # never-used type byte
    b"\x99",  # truncated array
    b"\xa5abc",  # truncated str
    b"\xa2\xff\xfe",  # invalid utf-8
    b"\x91" * 100_000,  # nesting deeper than msgpack's stack
    b"\x90\x90",  # trailing object
    b"\xd6\xff\x00",  # truncated timestamp ext
    b"\xd4\xff\x00",  # timestamp ext with an invalid length
]

BAD_ECO = [
    *NOT_MSGPACK,
    pack({"engine_index": 0}),  # a map where the array belongs
    pack("x"),
    pack(None),
    eco(True),  # bool for an int
    eco(-1),  # negative engine index
    eco(1.0),
    eco("0"),
    eco(0, {}),  # outputs must be an array
    eco(0, None),
    eco(0, [1]),
    eco(0, [["id"]]),  # EngineCoreOutput arity < 2
    eco(0, [[1, []]]),
    eco(0, [["id", None]]),
    eco(0, [["id", [True]]]),
    eco(0, [["id", [-1]]]),
    eco(0, [["id", [], None, None, None, "stop"]]),
    eco(0, [["id", [], None, None, None, False]]),
    eco(0, [], []),  # stats must be a map
    eco(0, [], 5),
    stats_frame(num_running_reqs=True),
    stats_frame(num_waiting_reqs=-1),
    stats_frame(step_counter=1.0),
    stats_frame(current_wave="1"),
    stats_frame(kv_cache_usage="0.5"),
    stats_frame(kv_cache_usage=True),
    stats_frame(kv_cache_usage=math.nan),
    stats_frame(kv_cache_usage=math.inf),
    eco(0, [], None, True),  # timestamp
    eco(0, [], None, "now"),
    eco(0, [], None, 0.0, 7),  # utility_output must be an array
    eco(0, [], None, 0.0, None, "req"),  # finished_requests
    eco(0, [], None, 0.0, None, [1]),
    eco(0, [], None, 0.0, None, [b"id"]),
    eco(0, [], None, 0.0, None, None, True),  # wave_complete
    eco(0, [], None, 0.0, None, None, -5),
    eco(0, [], None, 0.0, None, None, 5.0),
    eco(0, [], None, 0.0, None, None, None, False),  # start_wave
    eco(0, [], None, 0.0, None, None, None, [6]),
    eco(0, [], None, 0.0, None, None, None, None, 1),  # weight_version
    eco(0, [], None, 0.0, None, None, None, None, b"v"),
    b"\x99\x00\x90\x81\x01\x02" + b"\xc0" * 6,  # int map key in stats
]


@pytest.mark.parametrize("frame", BAD_ECO, ids=lambda b: b[:24].hex())
def test_bad_engine_core_outputs(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_engine_core_outputs(frame)
    assert str(info.value)


def test_engine_core_outputs_lenient_arity() -> None:
    assert decode_engine_core_outputs(pack([])) == EngineCoreOutputs()
    assert decode_engine_core_outputs(pack([3])) == EngineCoreOutputs(engine_index=3)
    longer = [0, [], None, 1.5, None, None, 4, None, None, "extra", {"x": 1}]
    assert decode_engine_core_outputs(pack(longer)) == EngineCoreOutputs(
        timestamp=1.5, wave_complete=4
    )
    # int timestamp accepted as float, missing/unknown stats keys tolerated
    got = decode_engine_core_outputs(eco(1, [], {"num_running_reqs": 2, "new_key": [1]}, 7))
    assert got.timestamp == 7.0 and type(got.timestamp) is float
    assert got.scheduler_stats == SchedulerStats(num_running_reqs=2)
    # EngineCoreOutput arrays shorter/longer than 19 slots
    got = decode_engine_core_outputs(eco(0, [["a", [1]], ["b", [], 0, 0, 0, 1, *[0] * 20]]))
    assert got.outputs == (EngineCoreOutput("a", (1,)), EngineCoreOutput("b", (), 1))
    # uint64 max is a valid wave
    assert decode_engine_core_outputs(eco(0, [], None, 0.0, None, None, U64)).wave_complete == U64


def test_oversized_frames_rejected() -> None:
    big = pack([None, 0, False]) + b"\xc0" * P.MAX_CONTROL_FRAME_BYTES
    with pytest.raises(ProtocolError, match="exceeds limit"):
        decode_front_publish(big)
    with pytest.raises(ProtocolError, match="exceeds limit"):
        decode_start_dp_wave([b"\x02", big])


BAD_BROADCAST: list[list[bytes]] = [
    [],
    [b"READY", b""],
    [b"READ"],
    [b"ready"],
    [b"\x03", pack([1, 2])],
    [b"\x00", pack([1, 2])],
    [b"\x02"],
    [b"\x02", pack([1, 2]), b""],
    [b"\x02", pack([1])],
    [b"\x02", pack([1, 2, 3])],
    [b"\x02", pack({"wave": 1, "exclude": 2})],
    [b"\x02", pack([True, 1])],
    [b"\x02", pack([1, True])],
    [b"\x02", pack([1, False])],
    [b"\x02", pack([-1, 1])],
    [b"\x02", pack([1, -1])],
    [b"\x02", pack([1.0, 1])],
    [b"\x02", pack([1, 1.0])],
    [b"\x02", pack([1, "1"])],
    [b"\x02", pack([None, 1])],
    [b"\x02", pack([1, [1]])],
    *[[b"\x02", bad] for bad in NOT_MSGPACK],
]


@pytest.mark.parametrize("frames", BAD_BROADCAST, ids=repr)
def test_bad_engine_broadcast(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_engine_broadcast(frames)
    if frames and frames[0] == b"\x02":
        with pytest.raises(ProtocolError):
            decode_start_dp_wave(frames)


def test_bad_start_dp_wave_type_frame() -> None:
    with pytest.raises(ProtocolError, match="02"):
        decode_start_dp_wave([b"\x03", pack([1, 2])])
    with pytest.raises(ProtocolError):
        decode_start_dp_wave([b"READY"])


BAD_PUBLISH = [
    *NOT_MSGPACK,
    pack({"counts": None}),
    pack([None, 1]),
    pack([None, 1, False, 0]),
    pack([None, True, False]),
    pack([None, -1, False]),
    pack([None, 1.0, False]),
    pack([None, 1, 1]),  # int where the bool belongs
    pack([None, 1, 0]),
    pack([None, 1, None]),
    pack([{}, 1, False]),
    pack([[[0, 0]], 1, False]),
    pack([[[0, 0, 0.0, 0]], 1, False]),
    pack([[(0, 0, 0.0), 5], 1, False]),
    pack([[[True, 0, 0.0]], 1, False]),
    pack([[[0, False, 0.0]], 1, False]),
    pack([[[0, 0, False]], 1, False]),
    pack([[[0, 0, "0.1"]], 1, False]),
    pack([[[0, 0, None]], 1, False]),
    pack([[[0, 0, math.nan]], 1, False]),
    pack([[[-1, 0, 0.0]], 1, False]),
]


@pytest.mark.parametrize("frame", BAD_PUBLISH, ids=lambda b: b[:24].hex())
def test_bad_front_publish(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_front_publish(frame)


BAD_FRONT = [
    *NOT_MSGPACK,
    SUBSCRIBE,
    UNSUBSCRIBE,
    b"\x01\x92\x01\x05",
    pack({"SCALE_ELASTIC_EP": 4}),
    pack(["SCALE_ELASTIC_EP"]),
    pack(["SCALE_ELASTIC_EP", 4, 5]),
    pack(["SCALE_ELASTIC_EP", True]),
    pack(["SCALE_ELASTIC_EP", -1]),
    pack(["SCALE_ELASTIC_EP", 4.0]),
    pack(["SCALE_ELASTIC_EP", None]),
    pack(["scale_elastic_ep", 4]),
    pack([b"SCALE_ELASTIC_EP", 4.0]),
    pack(["FIRST_REQ", 4]),
    pack([1]),
    pack([1, 2, 3]),
    pack([True, 5]),
    pack([-1, 5]),
    pack([1.0, 5]),
    pack([[1], 5]),
    pack([1, None]),
    pack([1, False]),
    pack([1, -5]),
    pack([None, "5"]),
    pack(5),
]


@pytest.mark.parametrize("frame", BAD_FRONT, ids=lambda b: b[:24].hex())
def test_bad_front_message(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_front_message(frame)


def req_wire(**changes: Any) -> list[Any]:
    wire: list[Any] = msgpack.unpackb(encode_add_request(EngineCoreRequest("r", (1, 2), 1.0))[1])
    fields = [
        "request_id",
        "prompt_token_ids",
        "mm_features",
        "sampling_params",
        "pooling_params",
        "arrival_time",
        "lora_request",
        "cache_salt",
        "data_parallel_rank",
        "prompt_embeds",
        "prompt_is_token_ids",
        "client_index",
        "current_wave",
    ]
    for k, value in changes.items():
        wire[fields.index(k)] = value
    return wire


BAD_REQUEST: list[list[bytes]] = [
    [],
    [b"\x00"],
    [pack(req_wire())],
    [b"\x00", pack(req_wire()), b""],
    [b"\x01", pack(req_wire())],
    [b"\x02", pack(req_wire())],
    [b"\x09", pack(req_wire())],
    [b"\x00\x00", pack(req_wire())],
    [b"\x00", pack(req_wire()[:5])],
    [b"\x00", pack({"request_id": "r"})],
    [b"\x00", pack(req_wire(request_id=1))],
    [b"\x00", pack(req_wire(request_id=b"r"))],
    [b"\x00", pack(req_wire(prompt_token_ids=[1, "2"]))],
    [b"\x00", pack(req_wire(prompt_token_ids=[True]))],
    [b"\x00", pack(req_wire(prompt_token_ids=[-1]))],
    [b"\x00", pack(req_wire(prompt_token_ids="12"))],
    [b"\x00", pack(req_wire(sampling_params=[16]))],
    [b"\x00", pack(req_wire(sampling_params={"max_tokens": "16"}))],
    [b"\x00", pack(req_wire(sampling_params={"max_tokens": True}))],
    [b"\x00", pack(req_wire(sampling_params={"max_tokens": -1}))],
    [b"\x00", pack(req_wire(arrival_time="now"))],
    [b"\x00", pack(req_wire(arrival_time=False))],
    [b"\x00", pack(req_wire(arrival_time=None))],
    [b"\x00", pack(req_wire(data_parallel_rank=True))],
    [b"\x00", pack(req_wire(data_parallel_rank=-1))],
    [b"\x00", pack(req_wire(client_index=None))],
    [b"\x00", pack(req_wire(client_index=True))],
    [b"\x00", pack(req_wire(current_wave=-1))],
    [b"\x00", pack(req_wire(current_wave=5.0))],
    *[[b"\x00", bad] for bad in NOT_MSGPACK],
]


@pytest.mark.parametrize("frames", BAD_REQUEST, ids=lambda f: repr(f)[:60])
def test_bad_engine_request(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_engine_request(frames)


def test_request_lenient_arity() -> None:
    short = req_wire()[:6]
    assert decode_engine_request([b"\x00", pack(short)]) == EngineCoreRequest("r", (1, 2), 1.0)
    longer = [*req_wire(current_wave=9, client_index=2), 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    got = decode_engine_request([b"\x00", pack(longer)])
    assert (got.current_wave, got.client_index) == (9, 2)
    none_prompt = req_wire(prompt_token_ids=None, arrival_time=3)
    got = decode_engine_request([b"\x00", pack(none_prompt)])
    assert got.prompt_token_ids == () and got.arrival_time == 3.0


@pytest.mark.parametrize("frame", [b"", b"\x06", b"\xff", b"\x00\x00", "0"], ids=repr)
def test_bad_request_type(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_request_type(frame)


# ------------------------------------------------------------------ encoder validation

ENCODE_ERRORS: list[Callable[[], object]] = [
    lambda: encode_start_dp_wave(True, None),
    lambda: encode_start_dp_wave(-1, None),
    lambda: encode_start_dp_wave(2**64, None),
    lambda: encode_start_dp_wave(1.0, None),  # type: ignore[arg-type]
    lambda: encode_start_dp_wave(1, -1),
    lambda: encode_start_dp_wave(1, True),
    lambda: encode_start_dp_wave(1, 2**64),
    lambda: encode_start_dp_wave(1, "1"),  # type: ignore[arg-type]
    lambda: encode_front_publish(FrontPublish(None, 1, 1)),  # type: ignore[arg-type]
    lambda: encode_front_publish(FrontPublish(None, True, False)),
    lambda: encode_front_publish(FrontPublish(None, 2**64, False)),
    lambda: encode_front_publish(FrontPublish(((True, 0, 0.0),), 0, False)),  # type: ignore[arg-type]
    lambda: encode_front_publish(FrontPublish(((0, -1, 0.0),), 0, False)),  # type: ignore[arg-type]
    lambda: encode_front_publish(FrontPublish(((0, 0, False),), 0, False)),  # type: ignore[arg-type]
    lambda: encode_front_publish(FrontPublish(((0, 0, "0"),), 0, False)),  # type: ignore[arg-type]
    lambda: encode_front_publish(FrontPublish(((0, 0, math.nan),), 0, False)),  # type: ignore[arg-type]
    lambda: encode_front_publish(FrontPublish(((0, 0, 10**400),), 0, False)),  # type: ignore[arg-type]
    lambda: encode_front_publish(FrontPublish(((0, 0),), 0, False)),  # type: ignore[arg-type]
    lambda: encode_front_publish(FrontPublish(5, 0, False)),  # type: ignore[arg-type]
    lambda: encode_front_publish("x"),  # type: ignore[arg-type]
    lambda: encode_scale_elastic_ep(True),
    lambda: encode_scale_elastic_ep(-1),
    lambda: encode_scale_elastic_ep(2**64),
    lambda: encode_legacy_first_request(True, 1),
    lambda: encode_legacy_first_request(-1, 1),
    lambda: encode_legacy_first_request(1, None),  # type: ignore[arg-type]
    lambda: encode_legacy_first_request(1, 2**70),
    lambda: encode_engine_core_outputs(EngineCoreOutputs(engine_index=-1)),
    lambda: encode_engine_core_outputs(EngineCoreOutputs(engine_index=True)),
    lambda: encode_engine_core_outputs(EngineCoreOutputs(engine_index=2**64)),
    lambda: encode_engine_core_outputs(EngineCoreOutputs(outputs=("x",))),  # type: ignore[arg-type]
    lambda: encode_engine_core_outputs(EngineCoreOutputs(outputs=(EngineCoreOutput(1),))),  # type: ignore[arg-type]
    lambda: encode_engine_core_outputs(
        EngineCoreOutputs(outputs=(EngineCoreOutput("a", (True,)),))
    ),
    lambda: encode_engine_core_outputs(EngineCoreOutputs(outputs=(EngineCoreOutput("a", (), -1),))),
    lambda: encode_engine_core_outputs(EngineCoreOutputs(scheduler_stats=5)),  # type: ignore[arg-type]
    lambda: encode_engine_core_outputs(
        EngineCoreOutputs(scheduler_stats=SchedulerStats(num_running_reqs=True))
    ),
    lambda: encode_engine_core_outputs(
        EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_cache_usage=math.inf))
    ),
    lambda: encode_engine_core_outputs(
        EngineCoreOutputs(scheduler_stats=SchedulerStats(current_wave=2**64))
    ),
    lambda: encode_engine_core_outputs(EngineCoreOutputs(timestamp="now")),  # type: ignore[arg-type]
    lambda: encode_engine_core_outputs(EngineCoreOutputs(utility_output=object())),
    lambda: encode_engine_core_outputs(EngineCoreOutputs(utility_output=[2**64])),
    lambda: encode_engine_core_outputs(EngineCoreOutputs(finished_requests="ab")),  # type: ignore[arg-type]
    lambda: encode_engine_core_outputs(EngineCoreOutputs(finished_requests=("a", 1))),  # type: ignore[arg-type]
    lambda: encode_engine_core_outputs(EngineCoreOutputs(wave_complete=False)),
    lambda: encode_engine_core_outputs(EngineCoreOutputs(start_wave=-2)),
    lambda: encode_engine_core_outputs(EngineCoreOutputs(weight_version=1)),  # type: ignore[arg-type]
    lambda: encode_engine_core_outputs(None),  # type: ignore[arg-type]
    lambda: encode_add_request(EngineCoreRequest(1, (), 0.0)),  # type: ignore[arg-type]
    lambda: encode_add_request(EngineCoreRequest("r", (True,), 0.0)),
    lambda: encode_add_request(EngineCoreRequest("r", "12", 0.0)),  # type: ignore[arg-type]
    lambda: encode_add_request(EngineCoreRequest("r", (2**64,), 0.0)),
    lambda: encode_add_request(EngineCoreRequest("r", (), "0")),  # type: ignore[arg-type]
    lambda: encode_add_request(EngineCoreRequest("r", (), 0.0, client_index=-1)),
    lambda: encode_add_request(EngineCoreRequest("r", (), 0.0, current_wave=True)),
    lambda: encode_add_request(EngineCoreRequest("r", (), 0.0, data_parallel_rank=False)),
    lambda: encode_add_request(EngineCoreRequest("r", (), 0.0, max_tokens=-1)),
    lambda: encode_add_request(EngineCoreRequest("\ud800", (), 0.0)),  # unencodable str
]


@pytest.mark.parametrize("call", ENCODE_ERRORS)
def test_encoder_rejects_invalid_values(call: Callable[[], object]) -> None:
    with pytest.raises(ProtocolError):
        call()


# ------------------------------------------------------------------ hypothesis: robustness

SINGLE_FRAME_DECODERS: list[Callable[[bytes], object]] = [
    decode_engine_core_outputs,
    decode_front_publish,
    decode_front_message,
    decode_subscription,
    decode_request_type,
]
MULTI_FRAME_DECODERS: list[Callable[[Sequence[bytes]], object]] = [
    decode_engine_broadcast,
    decode_start_dp_wave,
    decode_engine_request,
    decode_abort,
    decode_utility,
]


def only_protocol_errors(call: Callable[[], object]) -> None:
    try:
        call()
    except ProtocolError as exc:
        assert str(exc)


def feed_everything(frame: bytes) -> None:
    for dec in SINGLE_FRAME_DECODERS:
        only_protocol_errors(lambda dec=dec: dec(frame))  # type: ignore[misc]
    for head in (b"\x00", b"\x01", b"\x02", b"\x03", b"READY"):
        for mdec in MULTI_FRAME_DECODERS:
            only_protocol_errors(lambda mdec=mdec, head=head: mdec([head, frame]))  # type: ignore[misc]
            only_protocol_errors(lambda mdec=mdec: mdec([frame]))  # type: ignore[misc]


@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_protocol_error(data: bytes) -> None:
    feed_everything(data)


@given(msgpack_values)
def test_arbitrary_msgpack_only_raise_protocol_error(value: Any) -> None:
    feed_everything(pack(value))


@given(st.lists(st.binary(max_size=30), max_size=4))
def test_arbitrary_frame_lists_only_raise_protocol_error(frames: list[bytes]) -> None:
    for mdec in MULTI_FRAME_DECODERS:
        only_protocol_errors(lambda mdec=mdec: mdec(frames))  # type: ignore[misc]


MSGPACK_VECTORS = sorted(set(DECODERS) - {"request_type_enum", "ready", "live_ready"})


@given(st.data())
def test_mutated_vectors_only_raise_protocol_error(vectors: Vectors, data: st.DataObject) -> None:
    """Replace one slot (or one stats key) of a real vLLM message with arbitrary msgpack."""
    name = data.draw(st.sampled_from(MSGPACK_VECTORS))
    frames = frames_of(vectors[name])
    k = len(frames) - 1
    wire = msgpack.unpackb(frames[k], raw=False)
    i = data.draw(st.integers(0, len(wire) - 1))
    replacement = data.draw(msgpack_values)
    if isinstance(wire[i], dict) and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(wire[i])))
        wire[i][key] = replacement
    else:
        wire[i] = replacement
    mutated = [*frames[:k], pack(wire)]
    only_protocol_errors(lambda: DECODERS[name](mutated))
