"""Hypothesis round trips: every message we encode decodes to the same value, in the bytes
msgpack itself would write (canonical)."""

from __future__ import annotations

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from tests.protocol.wire import (
    eco_strategy,
    engine_ref,
    loads,
    pack,
    publishes,
    requests,
    u64,
)
from trio_dpcoord import protocol as P
from trio_dpcoord.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FrontPublish,
    LegacyFirstRequest,
    ScaleElasticEP,
    StartDPWave,
    decode_engine_broadcast,
    decode_engine_core_outputs,
    decode_engine_request,
    decode_front_message,
    decode_front_publish,
    decode_start_dp_wave,
    decode_subscription,
    encode_add_request,
    encode_engine_core_outputs,
    encode_front_publish,
    encode_legacy_first_request,
    encode_scale_elastic_ep,
    encode_start_dp_wave,
)

# ------------------------------------------------------------------ hypothesis: round trips


def canonical(frame: bytes) -> None:
    """Our bytes are what msgpack/msgspec would produce for the same value."""
    assert pack(msgpack.unpackb(frame, raw=False)) == frame


@given(u64, engine_ref)
def test_start_dp_wave_round_trip(wave: int, exclude: int | bytes | None) -> None:
    frames = encode_start_dp_wave(wave, exclude)
    assert frames[0] == b"\x02"
    canonical(frames[1])
    assert decode_start_dp_wave(frames) == StartDPWave(wave, exclude)
    assert decode_engine_broadcast(frames) == StartDPWave(wave, exclude)


@given(u64, engine_ref)
def test_trusted_start_dp_wave_is_byte_identical(wave: int, exclude: int | bytes | None) -> None:
    """The core's unchecked START_DP_WAVE encoder gives the checked encoder's frames."""
    assert P.encode_start_dp_wave_trusted(wave, exclude) == encode_start_dp_wave(wave, exclude)


@given(publishes)
def test_front_publish_round_trip(p: FrontPublish) -> None:
    frame = encode_front_publish(p)
    canonical(frame)
    assert decode_subscription(frame) is None
    assert decode_front_publish(frame) == p


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


@given(eco_strategy)
def test_engine_core_outputs_round_trip(out: EngineCoreOutputs) -> None:
    frame = encode_engine_core_outputs(out)
    canonical(frame)
    wire = msgpack.unpackb(frame)
    assert len(wire) == 9
    assert all(len(o) == 19 for o in wire[1])
    assert wire[2] is None or len(wire[2]) == 18
    assert decode_engine_core_outputs(frame) == out


@given(requests)
def test_add_request_round_trip(req: EngineCoreRequest) -> None:
    frames = encode_add_request(req)
    assert frames[0] == b"\x00"
    canonical(frames[1])
    assert len(msgpack.unpackb(frames[1])) == 22
    assert decode_engine_request(frames) == req
