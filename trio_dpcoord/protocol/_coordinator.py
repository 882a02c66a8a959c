"""The coordinator's own messages: engines' subscriptions, READY and START_DP_WAVE to
engines, the publish to front-ends and the front-ends' notices to it (docs/protocol.md §4)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgpack

from ._codec import (
    MAX_CONTROL_FRAME_BYTES,
    READY,
    SCALE_ELASTIC_EP,
    START_DP_WAVE_FRAME,
    SUBSCRIBE,
    UNSUBSCRIBE,
    ProtocolError,
    RequestType,
    as_bytes,
    dec_engine_ref,
    dec_finite_float,
    dec_uint,
    enc_engine_ref,
    enc_float,
    enc_uint,
    expect_list,
    frame_list,
    pack,
    preview,
    type_name,
    unpack,
)
from ._outputs import EngineLoad


@dataclass(frozen=True, slots=True)
class Subscription:
    """An XPUB (un)subscription notice: ``01``/``00`` followed by the topic."""

    subscribe: bool
    topic: bytes


def decode_subscription(frame: bytes) -> Subscription | None:
    """Classify a single frame received on an XPUB socket.

    Returns a :class:`Subscription` when the frame starts with ``01`` (subscribe) or ``00``
    (unsubscribe), the rest being the topic; returns ``None`` when the frame is anything
    else, i.e. an upstream payload (including an empty frame, which libzmq also passes
    upstream). Raises ProtocolError only if ``frame`` is not bytes-like.
    """
    data = frame if type(frame) is bytes else as_bytes(frame, "XPUB frame")
    if not data:
        return None
    first = data[0]
    if first == 1:
        return Subscription(True, data[1:])
    if first == 0:
        return Subscription(False, data[1:])
    return None


def decode_request_type(frame: bytes) -> RequestType:
    """Decode the one-byte first frame of a message to an engine (§4.1)."""
    data = frame if type(frame) is bytes else as_bytes(frame, "request type frame")
    if len(data) != 1:
        raise ProtocolError(
            f"request type frame must be 1 byte, got {len(data)} bytes ({preview(data)})"
        )
    try:
        return RequestType(data[0])
    except ValueError:
        raise ProtocolError(f"unknown request type byte 0x{data[0]:02x}") from None


# --------------------------------------------------------------------------- START_DP_WAVE


@dataclass(frozen=True, slots=True)
class StartDPWave:
    """START_DP_WAVE payload: engines not excluded move to ``wave`` and start running.

    ``exclude_engine_index`` is the engine index to exclude, ``None`` for nobody, or
    (legacy front-ends) a 2-byte engine identity which matches no engine index.
    """

    wave: int
    exclude_engine_index: int | bytes | None


def encode_start_dp_wave(wave: int, exclude_engine_index: int | bytes | None) -> list[bytes]:
    """Frames ``[b"\\x02", msgpack [wave, exclude]]`` broadcast to engines (§4.4).

    ``wave`` must be an int in 0..2**64-1; ``exclude_engine_index`` an int in the same
    range, bytes, or None. Anything else raises ProtocolError.
    """
    w = enc_uint(wave, "START_DP_WAVE wave")
    x = enc_engine_ref(exclude_engine_index, "START_DP_WAVE exclude_engine_index")
    return [START_DP_WAVE_FRAME, pack([w, x], "START_DP_WAVE")]


def _decode_start_dp_wave_payload(payload: object) -> StartDPWave:
    obj = unpack(payload, "START_DP_WAVE payload", MAX_CONTROL_FRAME_BYTES)
    items = expect_list(obj, "START_DP_WAVE payload", exact=2)
    wave = dec_uint(items[0], "START_DP_WAVE wave")
    exclude = dec_engine_ref(items[1], "START_DP_WAVE exclude_engine_index")
    return StartDPWave(wave, exclude)


def decode_start_dp_wave(frames: Sequence[bytes]) -> StartDPWave:
    """Decode the two frames ``02 | [wave, exclude]`` (§4.4).

    ``wave`` must be an int >= 0 and ``exclude`` an int >= 0, bin or nil; exactly two
    frames and a 2-element array are required. Anything else raises ProtocolError.
    """
    frames = frame_list(frames, "START_DP_WAVE")
    if len(frames) != 2:
        raise ProtocolError(f"START_DP_WAVE must have 2 frames, got {len(frames)}")
    head = as_bytes(frames[0], "START_DP_WAVE type frame")
    if head != START_DP_WAVE_FRAME:
        raise ProtocolError(f"START_DP_WAVE type frame must be 02, got {preview(head)!r}")
    return _decode_start_dp_wave_payload(frames[1])


def decode_engine_broadcast(frames: Sequence[bytes]) -> Literal["READY"] | StartDPWave:
    """Decode a message an engine's XSUB receives from the coordinator's back-pub.

    Returns ``"READY"`` for the single frame ``READY`` or a :class:`StartDPWave` for
    ``02 | payload``; anything else (which would kill a vLLM engine) raises ProtocolError.
    """
    frames = frame_list(frames, "engine broadcast")
    if not frames:
        raise ProtocolError("engine broadcast: no frames")
    head = as_bytes(frames[0], "engine broadcast first frame")
    if head == READY:
        if len(frames) != 1:
            raise ProtocolError(f"READY must be a single frame, got {len(frames)} frames")
        return "READY"
    if head == START_DP_WAVE_FRAME:
        return decode_start_dp_wave(frames)
    raise ProtocolError(
        f"engine broadcast: first frame is neither READY nor 02 (START_DP_WAVE): {preview(head)!r}"
    )


@dataclass(frozen=True, slots=True)
class FrontPublish:
    """Coordinator -> front-ends publish ``[counts, current_wave, engines_running]`` (§4.7).

    ``counts`` is None (wave-state change) or one ``(waiting, running, kv_cache_usage)``
    entry per engine in rank order.
    """

    counts: tuple[EngineLoad, ...] | None
    current_wave: int
    engines_running: bool


def _msgpack_encoder() -> Any:
    """msgspec's encoder when the optional ``fast`` extra is installed (vLLM's own
    encoder, ~10x msgpack-python on a 1,024-engine count list), else msgpack's. Both give
    the same bytes for the values :func:`encode_front_publish_trusted` takes (tested)."""
    try:
        import msgspec.msgpack
    except ImportError:
        return functools.partial(msgpack.packb, use_bin_type=True, use_single_float=False)
    return msgspec.msgpack.Encoder().encode


_encode_trusted: Final = _msgpack_encoder()


def encode_front_publish_trusted(
    counts: Sequence[EngineLoad] | None, current_wave: int, engines_running: bool
) -> bytes:
    """:func:`encode_front_publish` for values that already passed this codec, without
    checking each engine's entry again.

    For the coordinator's own publishes: its load table holds only :class:`EngineLoad`
    values made by the decoder (ints >= 0, finite float usage) or :data:`IDLE_LOAD`, and
    its wave is a checked uint64; re-validating 1,024 entries every publish cost 2 ms.
    Byte-identical to :func:`encode_front_publish` for such values.
    """
    encoded: bytes = _encode_trusted((counts, current_wave, engines_running))
    return encoded


def encode_start_dp_wave_trusted(
    wave: int, exclude_engine_index: int | bytes | None
) -> list[bytes]:
    """:func:`encode_start_dp_wave` for values that already passed this codec (the
    core's wave, a checked uint64; an exclusion decoded from an engine's report or a
    front-end's FIRST_REQ): one encoder call, not a check and a conversion per field
    on every wave start. Byte-identical to :func:`encode_start_dp_wave` for such values
    (tested)."""
    return [START_DP_WAVE_FRAME, _encode_trusted((wave, exclude_engine_index))]


def encode_front_publish(p: FrontPublish) -> bytes:
    """Encode a front publish exactly as vLLM does (§4.7).

    Counts are ints >= 0, usage is always float64 (an int is converted; must be finite),
    ``engines_running`` must be a real bool. Invalid values raise ProtocolError.
    """
    if not isinstance(p, FrontPublish):
        raise ProtocolError(f"expected FrontPublish, got {type_name(p)}")
    counts: list[list[object]] | None
    if p.counts is None:
        counts = None
    else:
        if not isinstance(p.counts, (tuple, list)):
            raise ProtocolError(f"counts must be a tuple or None, got {type_name(p.counts)}")
        counts = []
        for i, entry in enumerate(p.counts):
            if not isinstance(entry, (tuple, list)) or len(entry) != 3:
                raise ProtocolError(f"counts[{i}] must be a (waiting, running, usage) triple")
            counts.append(
                [
                    enc_uint(entry[0], f"counts[{i}].waiting"),
                    enc_uint(entry[1], f"counts[{i}].running"),
                    enc_float(entry[2], f"counts[{i}].kv_cache_usage", finite=True),
                ]
            )
    if type(p.engines_running) is not bool:
        raise ProtocolError(f"engines_running must be a bool, got {type_name(p.engines_running)}")
    wave = enc_uint(p.current_wave, "current_wave")
    return pack([counts, wave, p.engines_running], "front publish")


def decode_front_publish(frame: bytes) -> FrontPublish:
    """Decode a front publish: a 3-array ``[counts|nil, wave:int>=0, running:bool]``.

    Each counts entry must be ``[waiting:int>=0, running:int>=0, usage:float]`` (an int
    usage is accepted and converted; non-finite usage is rejected). Raises ProtocolError
    on anything else.
    """
    obj = unpack(frame, "front publish", MAX_CONTROL_FRAME_BYTES)
    items = expect_list(obj, "front publish", exact=3)
    raw_counts, wave, running = items
    counts: tuple[EngineLoad, ...] | None
    if raw_counts is None:
        counts = None
    else:
        raw = expect_list(raw_counts, "front publish counts")
        entries = []
        for i, entry in enumerate(raw):
            e = expect_list(entry, f"front publish counts[{i}]", exact=3)
            entries.append(
                EngineLoad(
                    waiting=dec_uint(e[0], f"counts[{i}].waiting"),
                    running=dec_uint(e[1], f"counts[{i}].running"),
                    kv_cache_usage=dec_finite_float(e[2], f"counts[{i}].kv_cache_usage"),
                )
            )
        counts = tuple(entries)
    wave = dec_uint(wave, "front publish current_wave")
    if type(running) is not bool:
        raise ProtocolError(
            f"front publish engines_running must be a bool, got {type_name(running)}"
        )
    return FrontPublish(counts, wave, running)


# --------------------------------------------------------------------------- front -> coordinator


@dataclass(frozen=True, slots=True)
class ScaleElasticEP:
    """``["SCALE_ELASTIC_EP", n]``: resize the engine table to ``new_engine_count`` (§4.8)."""

    new_engine_count: int


@dataclass(frozen=True, slots=True)
class LegacyFirstRequest:
    """Legacy FIRST_REQ ``[engine|bin|nil, wave]`` from pre-0.33 front-ends (§4.9)."""

    engine: int | bytes | None
    wave: int


def encode_scale_elastic_ep(n: int) -> bytes:
    """Encode ``["SCALE_ELASTIC_EP", n]`` (``n`` an int >= 0), as a front-end sends it."""
    return pack([SCALE_ELASTIC_EP, enc_uint(n, "SCALE_ELASTIC_EP engine count")], "scale")


def encode_legacy_first_request(engine: int | bytes | None, wave: int) -> bytes:
    """Encode a legacy FIRST_REQ ``[engine, wave]`` (engine int >= 0, bytes or None)."""
    e = enc_engine_ref(engine, "FIRST_REQ engine")
    return pack([e, enc_uint(wave, "FIRST_REQ wave")], "FIRST_REQ")


def decode_front_message(frame: bytes) -> ScaleElasticEP | LegacyFirstRequest:
    """Decode a non-subscription upstream payload received on the front XPUB (§4.8, §4.9).

    A 2-array whose first element is the string ``SCALE_ELASTIC_EP`` (second an int >= 0)
    is a resize; a 2-array whose first element is an int >= 0, bin or nil (second an int
    >= 0) is a legacy FIRST_REQ. Everything else, including a subscription frame passed
    here by mistake, raises ProtocolError.
    """
    data = frame if type(frame) is bytes else as_bytes(frame, "front message")
    if data[:1] in (SUBSCRIBE, UNSUBSCRIBE):
        raise ProtocolError("front message: frame is a (un)subscription, not a payload")
    obj = unpack(data, "front message", MAX_CONTROL_FRAME_BYTES)
    items = expect_list(obj, "front message", exact=2)
    head, value = items
    if type(head) is str:
        if head != SCALE_ELASTIC_EP:
            raise ProtocolError(f"front message: unknown command {head[:40]!r}")
        return ScaleElasticEP(dec_uint(value, "SCALE_ELASTIC_EP engine count"))
    engine = dec_engine_ref(head, "FIRST_REQ engine")
    return LegacyFirstRequest(engine, dec_uint(value, "FIRST_REQ wave"))
