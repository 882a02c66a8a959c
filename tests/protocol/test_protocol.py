"""Tests for the wire codec against vLLM 0.33.0's own frames (tests/data/vectors.json)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_dpcoord import protocol as P
from trio_dpcoord.core import HandshakeState
from trio_dpcoord.protocol import (
    READY,
    SUBSCRIBE,
    UNSUBSCRIBE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineHandshakeError,
    EngineLoad,
    EventBatch,
    FrontPublish,
    HandshakeMetadata,
    KVEventError,
    LegacyFirstRequest,
    OutputKind,
    ProtocolError,
    RequestType,
    ScaleElasticEP,
    SchedulerStats,
    StartDPWave,
    Subscription,
    UtilityCall,
    UtilityResult,
    classify_output,
    decode_abort,
    decode_engine_broadcast,
    decode_engine_core_outputs,
    decode_engine_request,
    decode_event_batch,
    decode_front_message,
    decode_front_publish,
    decode_handshake,
    decode_handshake_metadata,
    decode_kv_event_frames,
    decode_ready_response,
    decode_request_type,
    decode_start_dp_wave,
    decode_subscription,
    decode_utility,
    decode_utility_output,
    encode_abort,
    encode_add_request,
    encode_engine_core_outputs,
    encode_event_batch,
    encode_front_publish,
    encode_handshake_hello,
    encode_handshake_metadata,
    encode_handshake_ready,
    encode_kv_event_frames,
    encode_legacy_first_request,
    encode_ready_response,
    encode_scale_elastic_ep,
    encode_start_dp_wave,
    encode_utility,
    encode_utility_output,
    engine_identity,
)

Vector = dict[str, Any]
Vectors = dict[str, Vector]

U64 = 2**64 - 1


def frames_of(v: Vector) -> list[bytes]:
    return [bytes.fromhex(h) for h in v["frames_hex"]]


def unhex(value: Any) -> Any:
    """JSON meaning -> Python value ({"hex": ...} -> bytes)."""
    if isinstance(value, dict):
        if set(value) == {"hex"}:
            return bytes.fromhex(value["hex"])
        return {k: unhex(x) for k, x in value.items()}
    if isinstance(value, list):
        return [unhex(x) for x in value]
    return value


def pack(value: Any) -> bytes:
    out: bytes = msgpack.packb(value, use_bin_type=True)
    return out


# ------------------------------------------------------------------ per-vector checks
# Each check decodes the vector, compares with its `decoded` meaning, and for messages
# we send re-encodes from that meaning and compares bytes.


def check_subscribe(v: Vector) -> None:
    (frame,) = frames_of(v)
    assert frame == SUBSCRIBE
    topic = v["decoded"]["topic"].encode()
    assert decode_subscription(frame) == Subscription(subscribe=True, topic=topic)


def check_unsubscribe(v: Vector) -> None:
    (frame,) = frames_of(v)
    assert frame == UNSUBSCRIBE
    topic = v["decoded"]["topic"].encode()
    assert decode_subscription(frame) == Subscription(subscribe=False, topic=topic)


def check_ready(v: Vector) -> None:
    frames = frames_of(v)
    assert decode_engine_broadcast(frames) == "READY"
    assert frames == [READY]  # what we send


def check_start_dp_wave(v: Vector) -> None:
    frames = frames_of(v)
    wave, exclude = unhex(v["decoded"]["payload"])
    expected = StartDPWave(wave=wave, exclude_engine_index=exclude)
    assert decode_start_dp_wave(frames) == expected
    assert decode_engine_broadcast(frames) == expected
    if "request_type" in v["decoded"]:
        rt = v["decoded"]["request_type"]
        assert RequestType[rt["name"]].frame == bytes.fromhex(rt["hex"]) == frames[0]
    assert encode_start_dp_wave(wave, exclude) == frames


ECO_KIND = {
    "eco_scheduler_stats_moe": OutputKind.STATS,
    "eco_scheduler_stats_dense": OutputKind.STATS,
    "eco_wave_complete": OutputKind.WAVE_COMPLETE,
    "eco_start_wave": OutputKind.START_WAVE,
    "eco_normal_output_batch": OutputKind.REQUEST_BATCH,
    "eco_utility_output": OutputKind.UTILITY_REPLY,
}
# shapes a simulated engine sends to the coordinator: must be byte-identical
ECO_SENT = {"eco_scheduler_stats_moe", "eco_scheduler_stats_dense", "eco_wave_complete"}
ECO_SENT |= {"eco_start_wave"}


def eco_from_meaning(fields: dict[str, Any], wire: list[Any]) -> EngineCoreOutputs:
    s = fields["scheduler_stats"]
    stats = (
        None
        if s is None
        else SchedulerStats(
            num_running_reqs=s["num_running_reqs"],
            num_waiting_reqs=s["num_waiting_reqs"],
            step_counter=s["step_counter"],
            current_wave=s["current_wave"],
            kv_cache_usage=s["kv_cache_usage"],
        )
    )
    outputs = tuple(
        EngineCoreOutput(o["request_id"], tuple(o["new_token_ids"]), o["finish_reason"])
        for o in fields["outputs"]
    )
    finished = fields["finished_requests"]
    return EngineCoreOutputs(
        engine_index=fields["engine_index"],
        outputs=outputs,
        scheduler_stats=stats,
        timestamp=fields["timestamp"],
        utility_output=wire[4],
        finished_requests=None if finished is None else tuple(finished),
        wave_complete=fields["wave_complete"],
        start_wave=fields["start_wave"],
        weight_version=fields["weight_version"],
    )


def check_eco(v: Vector) -> None:
    (frame,) = frames_of(v)
    d = v["decoded"]
    assert d["field_order"] == [
        "engine_index",
        "outputs",
        "scheduler_stats",
        "timestamp",
        "utility_output",
        "finished_requests",
        "wave_complete",
        "start_wave",
        "weight_version",
    ]
    expected = eco_from_meaning(d["fields"], d["wire"])
    got = decode_engine_core_outputs(frame)
    assert got == expected
    assert classify_output(got) is ECO_KIND[v["name"]]
    if v["name"] in ECO_SENT:
        assert encode_engine_core_outputs(expected) == frame
        assert got.timestamp == 81234.5678
    else:
        # we keep a subset of EngineCoreOutput's slots; re-encoding preserves the meaning
        assert decode_engine_core_outputs(encode_engine_core_outputs(got)) == got


def check_front_publish(v: Vector) -> None:
    (frame,) = frames_of(v)
    d = v["decoded"]
    if isinstance(d, dict):
        counts, wave, running = d["counts"], d["current_wave"], d["engines_running"]
    else:
        counts, wave, running = d
    expected = FrontPublish(
        counts=None if counts is None else tuple(EngineLoad(w, r, float(u)) for w, r, u in counts),
        current_wave=wave,
        engines_running=running,
    )
    assert decode_front_publish(frame) == expected
    assert encode_front_publish(expected) == frame


def check_scale(v: Vector) -> None:
    (frame,) = frames_of(v)
    d = v["decoded"]
    assert d["kind"] == "SCALE_ELASTIC_EP"
    assert decode_subscription(frame) is None  # an upstream payload
    assert decode_front_message(frame) == ScaleElasticEP(d["new_engine_count"])
    assert encode_scale_elastic_ep(d["new_engine_count"]) == frame


def check_legacy(v: Vector) -> None:
    (frame,) = frames_of(v)
    d = unhex(v["decoded"])
    assert v["legacy"] is True
    assert decode_subscription(frame) is None
    expected = LegacyFirstRequest(engine=d["engine_to_exclude"], wave=d["wave"])
    assert decode_front_message(frame) == expected
    assert encode_legacy_first_request(d["engine_to_exclude"], d["wave"]) == frame


def check_add_request(v: Vector) -> None:
    frames = frames_of(v)
    d = v["decoded"]
    wire = d["wire"]
    assert d["request_type"]["name"] == "ADD"
    assert frames[0] == bytes.fromhex(d["request_type"]["hex"]) == RequestType.ADD.frame
    fo = d["field_order"]
    assert len(fo) == 22
    assert fo.index("current_wave") == d["current_wave_index"] == 12
    expected = EngineCoreRequest(
        request_id=wire[fo.index("request_id")],
        prompt_token_ids=tuple(wire[fo.index("prompt_token_ids")]),
        arrival_time=wire[fo.index("arrival_time")],
        client_index=wire[fo.index("client_index")],
        current_wave=d["decoded_current_wave"],
        data_parallel_rank=wire[fo.index("data_parallel_rank")],
        max_tokens=None,
    )
    assert decode_engine_request(frames) == expected
    assert encode_add_request(expected) == frames


def check_request_type_enum(v: Vector) -> None:
    d = v["decoded"]
    assert set(d) == {m.name for m in RequestType}
    frames = frames_of(v)
    for (name, hx), frame in zip(d.items(), frames, strict=True):
        assert frame == bytes.fromhex(hx)
        assert RequestType[name].value == int(hx, 16)
        assert RequestType[name].frame == frame
        assert decode_request_type(frame) is RequestType[name]


CHECKS: dict[str, Callable[[Vector], None]] = {
    "subscribe": check_subscribe,
    "unsubscribe": check_unsubscribe,
    "ready": check_ready,
    "live_ready": check_ready,
    "start_dp_wave_exclude_int": check_start_dp_wave,
    "start_dp_wave_exclude_none": check_start_dp_wave,
    "live_start_dp_wave": check_start_dp_wave,
    **dict.fromkeys(ECO_KIND, check_eco),
    "front_publish_counts": check_front_publish,
    "front_publish_wave_only": check_front_publish,
    "live_front_publish_initial": check_front_publish,
    "live_front_publish_after_stats": check_front_publish,
    "live_front_publish_running": check_front_publish,
    "live_front_publish_paused": check_front_publish,
    "front_scale_elastic_ep": check_scale,
    "legacy_first_req_int": check_legacy,
    "legacy_first_req_none": check_legacy,
    "legacy_first_req_identity_bytes": check_legacy,
    "front_to_engine_add_request_skeleton": check_add_request,
    "request_type_enum": check_request_type_enum,
}


def test_every_vector_is_covered(vectors: Vectors) -> None:
    assert len(vectors) == 25
    assert set(CHECKS) == set(vectors)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_vector(vectors: Vectors, name: str) -> None:
    v = vectors[name]
    assert v["vllm_version"] == "0.33.0"
    CHECKS[name](v)


def test_protocol_md_wave_complete_example() -> None:
    # docs/protocol.md §4.5: wave_complete=5 from engine 0 with timestamp 81234.5678
    out = EngineCoreOutputs(engine_index=0, timestamp=81234.5678, wave_complete=5)
    assert encode_engine_core_outputs(out).hex() == "990090c0cb40f3d52915b573ebc0c005c0c0"


def test_stats_map_is_vllm_shape() -> None:
    frame = encode_engine_core_outputs(EngineCoreOutputs(scheduler_stats=SchedulerStats()))
    wire = msgpack.unpackb(frame)
    assert len(wire) == 9
    assert len(wire[2]) == 18
    assert frame[3:6] == b"\xde\x00\x12"  # 16-bit map header, as vLLM
    assert len(frame) == 496  # docs/protocol.md §4.6: 496 bytes for small numbers


def test_usage_is_always_float64() -> None:
    frame = encode_front_publish(FrontPublish((EngineLoad(0, 0, 0),), 0, False))
    assert frame.hex() == "9391930000cb000000000000000000c2"
    assert decode_front_publish(frame).counts == ((0, 0, 0.0),)
    stats = SchedulerStats(kv_cache_usage=1)  # int given -> float64 on the wire
    wire = msgpack.unpackb(encode_engine_core_outputs(EngineCoreOutputs(scheduler_stats=stats)))
    assert type(wire[2]["kv_cache_usage"]) is float


def test_max_tokens_round_trip_and_placement() -> None:
    req = EngineCoreRequest("r", (1,), 1.5, max_tokens=7)
    frames = encode_add_request(req)
    assert msgpack.unpackb(frames[1])[3] == {"max_tokens": 7}
    assert decode_engine_request(frames) == req
    # a vLLM SamplingParams map omits max_tokens when it equals the default 16
    wire = msgpack.unpackb(frames[1])
    wire[3] = {"temperature": 0.5}
    assert decode_engine_request([b"\x00", pack(wire)]).max_tokens == 16
    wire[3] = {"max_tokens": None}
    assert decode_engine_request([b"\x00", pack(wire)]).max_tokens is None


def test_subscription_frames() -> None:
    assert decode_subscription(b"\x01abc") == Subscription(True, b"abc")
    assert decode_subscription(b"\x00abc") == Subscription(False, b"abc")
    assert decode_subscription(bytearray(b"\x01")) == Subscription(True, b"")  # type: ignore[arg-type]
    assert decode_subscription(memoryview(b"\x00")) == Subscription(False, b"")  # type: ignore[arg-type]
    assert decode_subscription(b"") is None
    assert decode_subscription(b"\x92\x01\x05") is None
    with pytest.raises(ProtocolError):
        decode_subscription("\x01")  # type: ignore[arg-type]


def test_memoryview_frames_accepted() -> None:
    frame = encode_scale_elastic_ep(3)
    assert decode_front_message(memoryview(frame)) == ScaleElasticEP(3)  # type: ignore[arg-type]
    assert decode_engine_broadcast([bytearray(b"READY")]) == "READY"  # type: ignore[list-item]


def test_zmq_frames_accepted() -> None:
    zmq = pytest.importorskip("zmq")
    frames = encode_start_dp_wave(4, 2)
    assert decode_engine_broadcast([zmq.Frame(f) for f in frames]) == StartDPWave(4, 2)
    assert decode_front_publish(zmq.Frame(encode_front_publish(FrontPublish(None, 1, True)))) == (
        FrontPublish(None, 1, True)
    )


@pytest.mark.parametrize("bad", [None, 5, 1.5, "READY", object(), [1], {"a": b"b"}], ids=repr)
def test_non_frame_inputs_rejected(bad: Any) -> None:
    for dec in (
        decode_engine_core_outputs,
        decode_front_publish,
        decode_front_message,
        decode_subscription,
        decode_request_type,
    ):
        with pytest.raises(ProtocolError):
            dec(bad)
    for mdec in (decode_engine_broadcast, decode_start_dp_wave, decode_engine_request):
        with pytest.raises(ProtocolError):
            mdec(bad)
        with pytest.raises(ProtocolError):
            mdec([bad, bad])
    with pytest.raises(ProtocolError):
        decode_engine_broadcast(b"READY")  # type: ignore[arg-type]  # a bare frame


def test_frames_as_tuple_or_iterable() -> None:
    frames = encode_add_request(EngineCoreRequest("r", (1,), 2.0))
    req = EngineCoreRequest("r", (1,), 2.0)
    assert decode_engine_request(tuple(frames)) == req
    assert decode_engine_request(iter(frames)) == req  # type: ignore[arg-type]


# ------------------------------------------------------------------ classify_output

S = SchedulerStats()
O1 = (EngineCoreOutput("a"),)


@pytest.mark.parametrize(
    ("out", "kind"),
    [
        (EngineCoreOutputs(), OutputKind.EMPTY),
        (EngineCoreOutputs(weight_version="default", engine_index=3), OutputKind.EMPTY),
        (EngineCoreOutputs(scheduler_stats=S), OutputKind.STATS),
        (EngineCoreOutputs(wave_complete=0), OutputKind.WAVE_COMPLETE),
        (EngineCoreOutputs(start_wave=0), OutputKind.START_WAVE),
        (EngineCoreOutputs(outputs=O1), OutputKind.REQUEST_BATCH),
        (EngineCoreOutputs(finished_requests=()), OutputKind.REQUEST_BATCH),
        (EngineCoreOutputs(outputs=O1, scheduler_stats=S), OutputKind.REQUEST_BATCH),
        (EngineCoreOutputs(utility_output=[1, None, None]), OutputKind.UTILITY_REPLY),
        (EngineCoreOutputs(wave_complete=1, start_wave=2), OutputKind.MIXED),
        (EngineCoreOutputs(wave_complete=1, scheduler_stats=S), OutputKind.MIXED),
        (EngineCoreOutputs(start_wave=1, scheduler_stats=S), OutputKind.MIXED),
        (EngineCoreOutputs(start_wave=1, outputs=O1), OutputKind.MIXED),
        (EngineCoreOutputs(wave_complete=1, finished_requests=("x",)), OutputKind.MIXED),
        (EngineCoreOutputs(start_wave=1, utility_output=[]), OutputKind.MIXED),
        (EngineCoreOutputs(utility_output=[], scheduler_stats=S), OutputKind.MIXED),
        (EngineCoreOutputs(utility_output=[], outputs=O1), OutputKind.MIXED),
    ],
)
def test_classify_output(out: EngineCoreOutputs, kind: OutputKind) -> None:
    assert classify_output(out) is kind
    assert classify_output(decode_engine_core_outputs(encode_engine_core_outputs(out))) is kind


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

u64 = st.integers(min_value=0, max_value=U64)
finite = st.floats(allow_nan=False, allow_infinity=False)
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=U64)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=6)
    ),
    max_leaves=30,
)

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


# ------------------------------------------------------------------ hypothesis: round trips


def canonical(frame: bytes) -> None:
    """Our bytes are what msgpack/msgspec would produce for the same value."""
    assert pack(msgpack.unpackb(frame, raw=False)) == frame


engine_ref = st.none() | u64 | st.binary(max_size=4)


@given(u64, engine_ref)
def test_start_dp_wave_round_trip(wave: int, exclude: int | bytes | None) -> None:
    frames = encode_start_dp_wave(wave, exclude)
    assert frames[0] == b"\x02"
    canonical(frames[1])
    assert decode_start_dp_wave(frames) == StartDPWave(wave, exclude)
    assert decode_engine_broadcast(frames) == StartDPWave(wave, exclude)


publishes = st.builds(
    FrontPublish,
    counts=st.none() | st.lists(st.tuples(u64, u64, finite), max_size=8).map(tuple),
    current_wave=u64,
    engines_running=st.booleans(),
)


@given(publishes)
def test_front_publish_round_trip(p: FrontPublish) -> None:
    frame = encode_front_publish(p)
    canonical(frame)
    assert decode_subscription(frame) is None
    assert decode_front_publish(frame) == p


loads = st.builds(P.EngineLoad, waiting=u64, running=u64, kv_cache_usage=finite)


@given(st.none() | st.lists(loads, max_size=8).map(tuple), u64, st.booleans())
def test_trusted_front_publish_is_byte_identical(
    counts: tuple[P.EngineLoad, ...] | None, wave: int, running: bool
) -> None:
    """The coordinator's unchecked encoder (msgspec's when installed, else msgpack's)
    gives exactly the checked encoder's bytes for values the decoder produces."""
    expected = encode_front_publish(FrontPublish(counts, wave, running))
    assert P.encode_front_publish_trusted(counts, wave, running) == expected
    fallback = msgpack.packb((counts, wave, running), use_bin_type=True, use_single_float=False)
    assert fallback == expected


@given(u64)
def test_scale_round_trip(n: int) -> None:
    frame = encode_scale_elastic_ep(n)
    canonical(frame)
    assert decode_subscription(frame) is None
    assert decode_front_message(frame) == ScaleElasticEP(n)


@given(engine_ref, u64)
def test_legacy_first_request_round_trip(engine: int | bytes | None, wave: int) -> None:
    frame = encode_legacy_first_request(engine, wave)
    canonical(frame)
    assert decode_subscription(frame) is None
    assert decode_front_message(frame) == LegacyFirstRequest(engine, wave)


token_ids = st.lists(u64, max_size=8).map(tuple)
stats_strategy = st.builds(
    SchedulerStats,
    num_running_reqs=u64,
    num_waiting_reqs=u64,
    step_counter=u64,
    current_wave=u64,
    kv_cache_usage=finite,
)
# decoded msgpack values: arrays come back as lists, so no tuples; floats not NaN
plain_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=U64)
    | finite
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=4),
    max_leaves=12,
)
eco_strategy = st.builds(
    EngineCoreOutputs,
    engine_index=u64,
    outputs=st.lists(
        st.builds(EngineCoreOutput, st.text(max_size=12), token_ids, st.none() | u64),
        max_size=4,
    ).map(tuple),
    scheduler_stats=st.none() | stats_strategy,
    timestamp=finite,
    utility_output=st.none() | st.lists(plain_values, max_size=4),
    finished_requests=st.none() | st.lists(st.text(max_size=12), max_size=4).map(tuple),
    wave_complete=st.none() | u64,
    start_wave=st.none() | u64,
    weight_version=st.none() | st.text(max_size=12),
)


@given(eco_strategy)
def test_engine_core_outputs_round_trip(out: EngineCoreOutputs) -> None:
    frame = encode_engine_core_outputs(out)
    canonical(frame)
    wire = msgpack.unpackb(frame)
    assert len(wire) == 9
    assert all(len(o) == 19 for o in wire[1])
    assert wire[2] is None or len(wire[2]) == 18
    assert decode_engine_core_outputs(frame) == out


requests = st.builds(
    EngineCoreRequest,
    request_id=st.text(max_size=20),
    prompt_token_ids=token_ids,
    arrival_time=finite,
    client_index=u64,
    current_wave=u64,
    data_parallel_rank=st.none() | u64,
    max_tokens=st.none() | u64,
)


@given(requests)
def test_add_request_round_trip(req: EngineCoreRequest) -> None:
    frames = encode_add_request(req)
    assert frames[0] == b"\x00"
    canonical(frames[1])
    assert len(msgpack.unpackb(frames[1])) == 22
    assert decode_engine_request(frames) == req


# ------------------------------------------------------------------ the coordinator's hot path


def general_decode(frame: bytes) -> tuple[P.OutputKind, int, object] | str:
    """The reference: full decode then classify, reduced to what the hot path returns."""
    try:
        out = decode_engine_core_outputs(frame)
    except ProtocolError:
        return "ProtocolError"
    kind = P.classify_output(out)
    value: object = None
    if kind is P.OutputKind.STATS:
        s = out.scheduler_stats
        assert s is not None
        value = P.StatsReport(
            P.EngineLoad(
                waiting=s.num_waiting_reqs,
                running=s.num_running_reqs,
                kv_cache_usage=s.kv_cache_usage,
            ),
            wave=s.current_wave,
            step=s.step_counter,
        )
    elif kind is P.OutputKind.WAVE_COMPLETE:
        value = out.wave_complete
    elif kind is P.OutputKind.START_WAVE:
        value = out.start_wave
    return kind, out.engine_index, value


def hot_decode(frame: bytes) -> tuple[P.OutputKind, int, object] | str:
    try:
        return P.decode_coordinator_output(frame)
    except ProtocolError:
        return "ProtocolError"


@given(eco_strategy)
def test_coordinator_hot_path_agrees_with_the_general_decoder(out: EngineCoreOutputs) -> None:
    frame = encode_engine_core_outputs(out)
    assert hot_decode(frame) == general_decode(frame)


@given(msgpack_values)
def test_coordinator_hot_path_agrees_on_arbitrary_msgpack(value: Any) -> None:
    frame = pack(value)
    assert hot_decode(frame) == general_decode(frame)


@given(st.data())
def test_coordinator_hot_path_agrees_on_mutated_control_frames(
    vectors: Vectors, data: st.DataObject
) -> None:
    name = data.draw(
        st.sampled_from(
            [
                "eco_scheduler_stats_moe",
                "eco_scheduler_stats_dense",
                "eco_wave_complete",
                "eco_start_wave",
                "eco_utility_output",
                "eco_normal_output_batch",
            ]
        )
    )
    wire = msgpack.unpackb(frames_of(vectors[name])[0], raw=False)
    i = data.draw(st.integers(0, len(wire) - 1))
    wire[i] = data.draw(msgpack_values)
    frame = pack(
        wire[: data.draw(st.integers(0, len(wire) + 1))] if data.draw(st.booleans()) else wire
    )
    assert hot_decode(frame) == general_decode(frame)


def test_coordinator_hot_path_on_the_vectors(vectors: Vectors) -> None:
    expected = {
        "eco_scheduler_stats_moe": (
            P.OutputKind.STATS,
            2,
            P.StatsReport(P.EngineLoad(waiting=3, running=12, kv_cache_usage=0.4375), 5, 17),
        ),
        "eco_wave_complete": (P.OutputKind.WAVE_COMPLETE, 0, 5),
        "eco_start_wave": (P.OutputKind.START_WAVE, 2, 6),
        "eco_utility_output": (P.OutputKind.UTILITY_REPLY, 0, None),
    }
    for name, result in expected.items():
        assert P.decode_coordinator_output(frames_of(vectors[name])[0]) == result
    batch = P.decode_coordinator_output(frames_of(vectors["eco_normal_output_batch"])[0])
    assert batch[0] is P.OutputKind.REQUEST_BATCH


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
