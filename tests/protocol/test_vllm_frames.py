"""The wire codec against vLLM 0.33.0's own frames (tests/data/vectors.json): every vector
decodes to its meaning and what we send re-encodes byte for byte; the shapes and inputs the
decoders accept; ``classify_output``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from tests.protocol.wire import (
    ECO_KIND,
    Vector,
    Vectors,
    frames_of,
    pack,
    unhex,
)
from trio_dpcoord.protocol import (
    READY,
    SUBSCRIBE,
    UNSUBSCRIBE,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineLoad,
    FrontPublish,
    LegacyFirstRequest,
    OutputKind,
    ProtocolError,
    RequestType,
    ScaleElasticEP,
    SchedulerStats,
    StartDPWave,
    Subscription,
    classify_output,
    decode_engine_broadcast,
    decode_engine_core_outputs,
    decode_engine_request,
    decode_front_message,
    decode_front_publish,
    decode_request_type,
    decode_start_dp_wave,
    decode_subscription,
    encode_add_request,
    encode_engine_core_outputs,
    encode_front_publish,
    encode_legacy_first_request,
    encode_scale_elastic_ep,
    encode_start_dp_wave,
)

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
