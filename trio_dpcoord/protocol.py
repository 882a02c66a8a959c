"""Wire codec for vLLM 0.33.0's data-parallel coordinator protocol.

Every function here is pure (no I/O, no logging) and byte-for-byte compatible with the
frames vLLM itself produces (see ``docs/protocol.md`` §3-§4, and ``tests/data/vectors.json``,
regenerated from vLLM's own encoders).

Wire rules, briefly:

* Payloads are msgpack as produced by msgspec, which equals msgpack-python's
  ``packb(value, use_bin_type=True)``: smallest integer encoding, every Python ``float``
  as float64 (``cb`` + 8 bytes, even ``0.0``), ``str`` as str, ``bytes`` as bin.
* msgspec ``array_like`` structs (``EngineCoreOutputs`` 9 slots, ``EngineCoreOutput``
  19 slots, ``EngineCoreRequest`` 22 slots) are arrays of **all** fields in declaration
  order; decoding is lenient like msgspec (a shorter array leaves trailing fields at
  their defaults, extra trailing elements are ignored, a wrong type is an error).
* Dataclasses (``SchedulerStats``) are maps of all fields in declaration order; decoding
  ignores unknown keys and fills missing keys with defaults.
* ZMQ framing: subscriptions are ``01``/``00`` + topic; ``READY`` is a bare 5-byte
  frame; messages to engines are ``<request type byte> | <msgpack payload>``; everything
  else is one msgpack frame.

Error contract: every malformed input (bytes that are not exactly one msgpack object,
wrong shapes, arity or element types, a bool where an int belongs or vice versa,
negative counters/indices, out-of-range integers, ...) raises :class:`ProtocolError`
(a ``ValueError``) with a message saying what was wrong. No other exception escapes an
``encode_*``/``decode_*`` function. Unpacking is bounded: frames above a size cap are
rejected before decoding, and msgpack-python caps every container/string length by the
frame length and the nesting depth by its internal stack.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple

import msgpack

__all__ = [
    "MAX_CONTROL_FRAME_BYTES",
    "MAX_DATA_FRAME_BYTES",
    "NO_PREFIX_CACHE_STATS",
    "READY",
    "SCALE_ELASTIC_EP",
    "SUBSCRIBE",
    "UNSUBSCRIBE",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineLoad",
    "FrontPublish",
    "LegacyFirstRequest",
    "OutputKind",
    "PrefixCacheStats",
    "ProtocolError",
    "RequestType",
    "ScaleElasticEP",
    "SchedulerStats",
    "StartDPWave",
    "StatsReport",
    "Subscription",
    "classify_output",
    "decode_coordinator_output",
    "decode_engine_broadcast",
    "decode_engine_core_outputs",
    "decode_engine_request",
    "decode_front_message",
    "decode_front_publish",
    "decode_request_type",
    "decode_start_dp_wave",
    "decode_subscription",
    "encode_add_request",
    "encode_engine_core_outputs",
    "encode_front_publish",
    "encode_front_publish_trusted",
    "encode_legacy_first_request",
    "encode_scale_elastic_ep",
    "encode_start_dp_wave",
    "request_slots_after_sampling",
]


class ProtocolError(ValueError):
    """The one exception every malformed input raises; message says what was wrong."""


SUBSCRIBE: Final[bytes] = b"\x01"
UNSUBSCRIBE: Final[bytes] = b"\x00"
READY: Final[bytes] = b"READY"
SCALE_ELASTIC_EP: Final[str] = "SCALE_ELASTIC_EP"

#: Largest frame accepted by the control-message decoders (START_DP_WAVE payloads,
#: front publishes, front-end notices). Real frames are a few bytes to a few KiB.
MAX_CONTROL_FRAME_BYTES: Final[int] = 1 << 20
#: Largest frame accepted for ``EngineCoreOutputs`` / ``EngineCoreRequest`` (request
#: batches and prompts can be large). Decoded size is bounded by a small multiple of it.
MAX_DATA_FRAME_BYTES: Final[int] = 64 << 20

_UINT64_MAX: Final[int] = (1 << 64) - 1


class RequestType(enum.IntEnum):
    """``EngineCoreRequestType``: first frame (one byte) of every message to an engine."""

    ADD = 0
    ABORT = 1
    START_DP_WAVE = 2
    UTILITY = 3
    EXECUTOR_FAILED = 4
    WAKEUP = 5

    @property
    def frame(self) -> bytes:
        """The one-byte ZMQ frame for this request type."""
        return bytes((self.value,))


_ADD_FRAME: Final[bytes] = b"\x00"
_START_DP_WAVE_FRAME: Final[bytes] = b"\x02"


# --------------------------------------------------------------------------- helpers


def _preview(data: bytes, limit: int = 16) -> str:
    head = data[:limit].hex()
    return head + ("..." if len(data) > limit else "")


def _as_bytes(frame: object, what: str) -> bytes:
    """``frame`` as bytes; any buffer-protocol object (bytearray, memoryview, zmq.Frame)."""
    if type(frame) is bytes:
        return frame
    if isinstance(frame, (str, int)):  # int: bytes(5) would make 5 zero bytes
        raise ProtocolError(f"{what}: frame must be bytes, got {_tname(frame)}")
    try:
        return bytes(memoryview(frame))  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError) as exc:
        raise ProtocolError(f"{what}: frame must be bytes, got {_tname(frame)} ({exc})") from None


def _frame_list(frames: object, what: str) -> Sequence[Any]:
    """A multipart message as a sequence of frames, or ProtocolError."""
    if type(frames) is list or type(frames) is tuple:
        return frames
    if isinstance(frames, (str, bytes, bytearray, memoryview)) or frames is None:
        raise ProtocolError(f"{what}: expected a sequence of frames, got {_tname(frames)}")
    try:
        result: list[Any] = list(frames)  # type: ignore[call-overload]
    except TypeError:
        raise ProtocolError(
            f"{what}: expected a sequence of frames, got {_tname(frames)}"
        ) from None
    return result


def _unpack(frame: object, what: str, max_bytes: int) -> Any:
    """Exactly one msgpack object from ``frame``, or ProtocolError."""
    data = frame if type(frame) is bytes else _as_bytes(frame, what)
    if len(data) > max_bytes:
        raise ProtocolError(f"{what}: frame of {len(data)} bytes exceeds limit {max_bytes}")
    if not data:
        raise ProtocolError(f"{what}: empty frame")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except msgpack.ExtraData as exc:
        raise ProtocolError(
            f"{what}: trailing bytes after the msgpack object ({len(exc.extra)} extra)"
        ) from None
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as exc:
        detail = str(exc) or type(exc).__name__
        raise ProtocolError(
            f"{what}: not a valid msgpack frame ({detail}; starts {_preview(data)})"
        ) from None


def _pack(value: object, what: str) -> bytes:
    try:
        packed: bytes = msgpack.packb(value, use_bin_type=True, use_single_float=False)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ProtocolError(f"{what}: cannot encode ({exc})") from None
    return packed


def _tname(value: object) -> str:
    return type(value).__name__


def _uint(value: object, what: str) -> int:
    """Decoder check: a non-negative msgpack int (bools rejected)."""
    if type(value) is not int:
        raise ProtocolError(f"{what} must be an int, got {_tname(value)}")
    if value < 0:
        raise ProtocolError(f"{what} must be >= 0, got {value}")
    return value


def _opt_uint(value: object, what: str) -> int | None:
    if value is None:
        return None
    return _uint(value, what)


def _float(value: object, what: str) -> float:
    """Decoder check: float64 or int (msgspec accepts ints for float fields), not bool."""
    t = type(value)
    if t is float:
        return value  # type: ignore[return-value]
    if t is int:
        return float(value)  # type: ignore[arg-type]
    raise ProtocolError(f"{what} must be a float, got {_tname(value)}")


def _finite_float(value: object, what: str) -> float:
    f = _float(value, what)
    if not math.isfinite(f):
        raise ProtocolError(f"{what} must be finite, got {f}")
    return f


def _enc_uint(value: object, what: str) -> int:
    """Encoder check: int subclass (IntEnum ok, bool not) in 0..2**64-1, returned as int."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{what} must be an int, got {_tname(value)}")
    v = int(value)
    if v < 0:
        raise ProtocolError(f"{what} must be >= 0, got {v}")
    if v > _UINT64_MAX:
        raise ProtocolError(f"{what} too large to encode: {v} > 2**64-1")
    return v


def _enc_opt_uint(value: object, what: str) -> int | None:
    return None if value is None else _enc_uint(value, what)


def _enc_float(value: object, what: str, *, finite: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ProtocolError(f"{what} must be a float, got {_tname(value)}")
    try:
        f = float(value)
    except OverflowError:
        raise ProtocolError(f"{what} out of float64 range") from None
    if finite and not math.isfinite(f):
        raise ProtocolError(f"{what} must be finite, got {f}")
    return f


def _enc_str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a str, got {_tname(value)}")
    return str(value)


def _enc_opt_str(value: object, what: str) -> str | None:
    return None if value is None else _enc_str(value, what)


def _enc_uint_list(values: object, what: str) -> list[int]:
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Sequence):
        raise ProtocolError(f"{what} must be a sequence of ints, got {_tname(values)}")
    return [_enc_uint(v, f"{what}[{i}]") for i, v in enumerate(values)]


def _dec_uint_tuple(value: object, what: str) -> tuple[int, ...]:
    if type(value) is not list:
        raise ProtocolError(f"{what} must be an array of ints, got {_tname(value)}")
    for i, v in enumerate(value):
        if type(v) is not int or v < 0:
            raise ProtocolError(f"{what}[{i}] must be an int >= 0, got {v!r}")
    return tuple(value)


def _expect_list(value: object, what: str, *, exact: int | None = None) -> list[Any]:
    if type(value) is not list:
        raise ProtocolError(f"{what} must be a msgpack array, got {_tname(value)}")
    if exact is not None and len(value) != exact:
        raise ProtocolError(f"{what} must have {exact} elements, got {len(value)}")
    return value


def _engine_ref(value: object, what: str) -> int | bytes | None:
    """Decoder check for an engine reference: int >= 0, bin (an identity) or nil."""
    if value is None or type(value) is bytes:
        return value
    if type(value) is int:
        if value < 0:
            raise ProtocolError(f"{what} must be >= 0, got {value}")
        return value
    raise ProtocolError(f"{what} must be an int, bytes or nil, got {_tname(value)}")


def _enc_engine_ref(value: object, what: str) -> int | bytes | None:
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return _enc_uint(value, what)


# --------------------------------------------------------------------------- subscriptions


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
    data = frame if type(frame) is bytes else _as_bytes(frame, "XPUB frame")
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
    data = frame if type(frame) is bytes else _as_bytes(frame, "request type frame")
    if len(data) != 1:
        raise ProtocolError(
            f"request type frame must be 1 byte, got {len(data)} bytes ({_preview(data)})"
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
    w = _enc_uint(wave, "START_DP_WAVE wave")
    x = _enc_engine_ref(exclude_engine_index, "START_DP_WAVE exclude_engine_index")
    return [_START_DP_WAVE_FRAME, _pack([w, x], "START_DP_WAVE")]


def _decode_start_dp_wave_payload(payload: object) -> StartDPWave:
    obj = _unpack(payload, "START_DP_WAVE payload", MAX_CONTROL_FRAME_BYTES)
    items = _expect_list(obj, "START_DP_WAVE payload", exact=2)
    wave = _uint(items[0], "START_DP_WAVE wave")
    exclude = _engine_ref(items[1], "START_DP_WAVE exclude_engine_index")
    return StartDPWave(wave, exclude)


def decode_start_dp_wave(frames: Sequence[bytes]) -> StartDPWave:
    """Decode the two frames ``02 | [wave, exclude]`` (§4.4).

    ``wave`` must be an int >= 0 and ``exclude`` an int >= 0, bin or nil; exactly two
    frames and a 2-element array are required. Anything else raises ProtocolError.
    """
    frames = _frame_list(frames, "START_DP_WAVE")
    if len(frames) != 2:
        raise ProtocolError(f"START_DP_WAVE must have 2 frames, got {len(frames)}")
    head = _as_bytes(frames[0], "START_DP_WAVE type frame")
    if head != _START_DP_WAVE_FRAME:
        raise ProtocolError(f"START_DP_WAVE type frame must be 02, got {_preview(head)!r}")
    return _decode_start_dp_wave_payload(frames[1])


def decode_engine_broadcast(frames: Sequence[bytes]) -> Literal["READY"] | StartDPWave:
    """Decode a message an engine's XSUB receives from the coordinator's back-pub.

    Returns ``"READY"`` for the single frame ``READY`` or a :class:`StartDPWave` for
    ``02 | payload``; anything else (which would kill a vLLM engine) raises ProtocolError.
    """
    frames = _frame_list(frames, "engine broadcast")
    if not frames:
        raise ProtocolError("engine broadcast: no frames")
    head = _as_bytes(frames[0], "engine broadcast first frame")
    if head == READY:
        if len(frames) != 1:
            raise ProtocolError(f"READY must be a single frame, got {len(frames)} frames")
        return "READY"
    if head == _START_DP_WAVE_FRAME:
        return decode_start_dp_wave(frames)
    raise ProtocolError(
        f"engine broadcast: first frame is neither READY nor 02 (START_DP_WAVE): {_preview(head)!r}"
    )


# --------------------------------------------------------------------------- EngineCoreOutputs


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """vLLM 0.33.0's ``PrefixCacheStats`` (``vllm/v1/metrics/stats.py``): the prefix-cache
    lookups since the engine's previous report (each report starts from zero, as vLLM's
    ``make_prefix_cache_stats`` resets them), counted in tokens.

    ``requests``: new requests looked up; ``queries``: their prompt tokens; ``hits``: the
    tokens found cached. ``preempted_*``: the same for re-scheduled preempted requests.
    ``reset``: the cache was reset before these. ``hits_by_source`` (connector tiers) is
    always written empty and not read.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


NO_PREFIX_CACHE_STATS: Final = PrefixCacheStats()
"""What an engine that looked nothing up reports (vLLM's defaults)."""

_PREFIX_COUNT_KEYS: Final = (
    "requests",
    "queries",
    "hits",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The ``SchedulerStats`` fields a DP coordinator reads (§4.6), and the prefix-cache
    counters a front-end reads.

    The encoder writes vLLM's full 18-key map (other keys at their defaults), so the
    bytes equal vLLM's; the decoder reads only these six keys.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = NO_PREFIX_CACHE_STATS


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """One per-request output (19-slot array); only the slots a simulation needs.

    ``finish_reason``: ``None`` while running, else 0 stop, 1 length, 2 abort, 3 error,
    4 repetition. Other slots are written at their defaults and ignored when decoding.
    """

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    finish_reason: int | None = None


@dataclass(frozen=True, slots=True)
class EngineCoreOutputs:
    """The 9-slot ``EngineCoreOutputs`` array (§4.5).

    ``utility_output`` is kept as the raw decoded msgpack value (an array) and not
    interpreted; ``timestamp`` is the sender's monotonic clock and meaningless elsewhere.
    """

    engine_index: int = 0
    outputs: tuple[EngineCoreOutput, ...] = ()
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: object | None = None
    finished_requests: tuple[str, ...] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None


def _prefix_cache_map(prefix: PrefixCacheStats) -> dict[str, object]:
    if not isinstance(prefix, PrefixCacheStats):
        raise ProtocolError(f"prefix_cache_stats must be PrefixCacheStats, got {_tname(prefix)}")
    if not isinstance(prefix.reset, bool):
        raise ProtocolError(f"prefix_cache_stats.reset must be a bool, got {_tname(prefix.reset)}")
    counts = {
        k: _enc_uint(getattr(prefix, k), f"prefix_cache_stats.{k}") for k in _PREFIX_COUNT_KEYS
    }
    # vLLM's field order: BaseCacheStats's, then PrefixCacheStats's own.
    return {"reset": prefix.reset, **counts, "hits_by_source": {}}


def _stats_map(stats: SchedulerStats) -> dict[str, object]:
    # vLLM's field order (vllm/v1/metrics/stats.py, 0.33.0); defaults for all but 6 keys.
    return {
        "num_running_reqs": _enc_uint(stats.num_running_reqs, "num_running_reqs"),
        "num_waiting_reqs": _enc_uint(stats.num_waiting_reqs, "num_waiting_reqs"),
        "num_skipped_waiting_reqs": 0,
        "num_kv_fetch_reqs_by_stage": {},
        "step_counter": _enc_uint(stats.step_counter, "step_counter"),
        "current_wave": _enc_uint(stats.current_wave, "current_wave"),
        "kv_cache_usage": _enc_float(stats.kv_cache_usage, "kv_cache_usage", finite=True),
        "iteration_details": None,
        "prefix_cache_stats": _prefix_cache_map(stats.prefix_cache_stats),
        "connector_prefix_cache_stats": None,
        "kv_cache_eviction_events": [],
        "spec_decoding_stats": None,
        "kv_connector_stats": None,
        "ec_connector_stats": None,
        "waiting_lora_adapters": {},
        "running_lora_adapters": {},
        "cudagraph_stats": None,
        "perf_stats": None,
    }


def _output_array(o: object, i: int) -> list[object]:
    if not isinstance(o, EngineCoreOutput):
        raise ProtocolError(f"outputs[{i}] must be an EngineCoreOutput, got {_tname(o)}")
    return [
        _enc_str(o.request_id, f"outputs[{i}].request_id"),
        _enc_uint_list(o.new_token_ids, f"outputs[{i}].new_token_ids"),
        None,  # new_logprobs
        None,  # new_prompt_logprobs_tensors
        None,  # pooling_output
        _enc_opt_uint(o.finish_reason, f"outputs[{i}].finish_reason"),
        None,  # stop_reason
        None,  # events
        None,  # kv_transfer_params
        None,  # ec_transfer_params
        None,  # trace_headers
        None,  # prefill_stats
        None,  # routed_experts
        0,  # num_nans_in_logits
        None,  # mm_cache_miss_hashes
        None,  # new_sampling_mask
        None,  # spec_decode_metrics
        None,  # prompt_token_id_logprobs
        None,  # error
    ]


def encode_engine_core_outputs(out: EngineCoreOutputs) -> bytes:
    """Encode ``out`` as vLLM's 9-element array, all slots present (§4.5).

    Stats are written as the full 18-key ``SchedulerStats`` map; each output as the
    19-slot array with unknown slots at their defaults; ``timestamp`` and
    ``kv_cache_usage`` as float64. ``utility_output`` is packed as given (must be
    msgpack-serialisable). Invalid field values raise ProtocolError.
    """
    if not isinstance(out, EngineCoreOutputs):
        raise ProtocolError(f"expected EngineCoreOutputs, got {_tname(out)}")
    stats = out.scheduler_stats
    if stats is not None and not isinstance(stats, SchedulerStats):
        raise ProtocolError(f"scheduler_stats must be SchedulerStats or None, got {_tname(stats)}")
    outputs = out.outputs
    if not isinstance(outputs, (tuple, list)):
        raise ProtocolError(f"outputs must be a tuple, got {_tname(outputs)}")
    finished = out.finished_requests
    if finished is not None:
        if isinstance(finished, str) or not isinstance(finished, (tuple, list)):
            raise ProtocolError(f"finished_requests must be a tuple of str, got {_tname(finished)}")
        finished_list: list[str] | None = [
            _enc_str(r, f"finished_requests[{i}]") for i, r in enumerate(finished)
        ]
    else:
        finished_list = None
    wire = [
        _enc_uint(out.engine_index, "engine_index"),
        [_output_array(o, i) for i, o in enumerate(outputs)],
        None if stats is None else _stats_map(stats),
        _enc_float(out.timestamp, "timestamp"),
        out.utility_output,
        finished_list,
        _enc_opt_uint(out.wave_complete, "wave_complete"),
        _enc_opt_uint(out.start_wave, "start_wave"),
        _enc_opt_str(out.weight_version, "weight_version"),
    ]
    return _pack(wire, "EngineCoreOutputs")


_ECO_DEFAULTS: Final[list[object]] = [0, [], None, 0.0, None, None, None, None, None]

# Hot-path constructors. A frozen dataclass's __init__ goes through object.__setattr__
# once per field; setting the slots through their member descriptors is ~2x faster.
# Equivalent to calling the class (these classes have no __post_init__).
_new = object.__new__
_eco_set = tuple(getattr(EngineCoreOutputs, f).__set__ for f in EngineCoreOutputs.__slots__)
_st_set = tuple(getattr(SchedulerStats, f).__set__ for f in SchedulerStats.__slots__)


def _new_outputs(
    a: int,
    b: tuple[EngineCoreOutput, ...],
    c: SchedulerStats | None,
    d: float,
    e: object | None,
    f: tuple[str, ...] | None,
    g: int | None,
    h: int | None,
    i: str | None,
    _s: tuple[Any, ...] = _eco_set,
) -> EngineCoreOutputs:
    o = _new(EngineCoreOutputs)
    _s[0](o, a)
    _s[1](o, b)
    _s[2](o, c)
    _s[3](o, d)
    _s[4](o, e)
    _s[5](o, f)
    _s[6](o, g)
    _s[7](o, h)
    _s[8](o, i)
    return o


def _new_stats(
    a: int,
    b: int,
    c: int,
    d: int,
    e: float,
    f: PrefixCacheStats = NO_PREFIX_CACHE_STATS,
    _s: tuple[Any, ...] = _st_set,
) -> SchedulerStats:
    o = _new(SchedulerStats)
    _s[0](o, a)
    _s[1](o, b)
    _s[2](o, c)
    _s[3](o, d)
    _s[4](o, e)
    _s[5](o, f)
    return o


class EngineLoad(NamedTuple):
    """One engine's load, in the one field order used from the codec to the public API.

    The order is that of a front publish entry (§4.7) and of vLLM's own
    ``[waiting, running, usage]`` lists; build it by keyword where order could be confused.
    """

    waiting: int
    running: int
    kv_cache_usage: float


IDLE_LOAD: Final = EngineLoad(waiting=0, running=0, kv_cache_usage=0.0)
"""The load of an engine that has not reported yet."""


class StatsReport(NamedTuple):
    """What one engine's stats-only message tells the coordinator (§4.6, §5.4)."""

    load: EngineLoad
    wave: int
    """The engine's ``current_wave`` when it stepped."""
    step: int
    """The engine's ``step_counter`` within that wave."""


_new_tuple: Final = tuple.__new__


def _decode_stats(d: object) -> SchedulerStats:
    running, waiting, step, wave, kv = _decode_stats_fields(d)
    assert type(d) is dict  # checked by _decode_stats_fields
    prefix = d.get("prefix_cache_stats")
    if prefix is None:
        return _new_stats(running, waiting, step, wave, kv)
    return _new_stats(running, waiting, step, wave, kv, _decode_prefix_cache_stats(prefix))


def _decode_prefix_cache_stats(d: object) -> PrefixCacheStats:
    """vLLM's ``PrefixCacheStats`` map (missing keys default, unknown ones ignored).

    Read only when well formed (a map, ``reset`` a bool, the counts ints >= 0);
    otherwise vLLM's defaults, and no error: a coordinator does not read the key and
    accepts any value there (:mod:`._coordinator_decoder` agrees with this decoder on
    every frame), so one engine's odd counters must not make the two disagree."""
    if type(d) is not dict:
        return NO_PREFIX_CACHE_STATS
    reset = d.get("reset", False)
    counts = [d.get(key, 0) for key in _PREFIX_COUNT_KEYS]
    if type(reset) is not bool or not all(type(c) is int and c >= 0 for c in counts):
        return NO_PREFIX_CACHE_STATS
    if not reset and not any(counts):
        return NO_PREFIX_CACHE_STATS
    return PrefixCacheStats(reset, *counts)


def _decode_stats_fields(d: object) -> tuple[int, int, int, int, float]:
    if type(d) is not dict:
        raise ProtocolError(f"scheduler_stats must be a map or nil, got {_tname(d)}")
    get = d.get
    running = get("num_running_reqs", 0)
    waiting = get("num_waiting_reqs", 0)
    step = get("step_counter", 0)
    wave = get("current_wave", 0)
    kv = get("kv_cache_usage", 0.0)
    if (
        type(running) is not int
        or type(waiting) is not int
        or type(step) is not int
        or type(wave) is not int
        or running < 0
        or waiting < 0
        or step < 0
        or wave < 0
    ):
        _uint(running, "scheduler_stats.num_running_reqs")
        _uint(waiting, "scheduler_stats.num_waiting_reqs")
        _uint(step, "scheduler_stats.step_counter")
        _uint(wave, "scheduler_stats.current_wave")
    if type(kv) is not float or not math.isfinite(kv):
        kv = _finite_float(kv, "scheduler_stats.kv_cache_usage")
    return running, waiting, step, wave, kv


def _stats_report(d: object) -> StatsReport:
    running, waiting, step, wave, kv = _decode_stats_fields(d)
    # StatsReport(EngineLoad(waiting, running, kv), wave, step), without the named tuples'
    # argument parsing (half the cost of this function on the coordinator's hot path)
    return _new_tuple(StatsReport, (_new_tuple(EngineLoad, (waiting, running, kv)), wave, step))


def _decode_outputs(items: list[Any]) -> tuple[EngineCoreOutput, ...]:
    result = []
    for i, o in enumerate(items):
        if type(o) is not list or len(o) < 2:
            raise ProtocolError(
                f"outputs[{i}] must be an EngineCoreOutput array of >= 2 elements, got {_tname(o)}"
            )
        rid = o[0]
        if type(rid) is not str:
            raise ProtocolError(f"outputs[{i}].request_id must be a str, got {_tname(rid)}")
        tokens = _dec_uint_tuple(o[1], f"outputs[{i}].new_token_ids")
        finish = _opt_uint(o[5], f"outputs[{i}].finish_reason") if len(o) > 5 else None
        result.append(EngineCoreOutput(rid, tokens, finish))
    return tuple(result)


def decode_engine_core_outputs(frame: bytes) -> EngineCoreOutputs:
    """Decode one ``EngineCoreOutputs`` frame (§4.5), leniently like msgspec.

    The frame must be exactly one msgpack array; a shorter array leaves trailing fields
    at their defaults and extra trailing elements are ignored. Types are checked:
    ``engine_index`` int >= 0; ``outputs`` array of EngineCoreOutput arrays (only
    request_id, new_token_ids and finish_reason are read); ``scheduler_stats`` map or nil
    (only the five coordinator keys and ``prefix_cache_stats`` are read; missing keys
    default, unknown keys are ignored, a malformed ``prefix_cache_stats`` reads as
    vLLM's defaults); ``timestamp`` float (an int is accepted); ``utility_output`` array or nil
    (kept raw); ``finished_requests`` array of str or nil; ``wave_complete`` /
    ``start_wave`` int >= 0 or nil; ``weight_version`` str or nil. Anything else raises
    ProtocolError.
    """
    return _decode_engine_core_outputs(_unpack(frame, "EngineCoreOutputs", MAX_DATA_FRAME_BYTES))


def _decode_engine_core_outputs(obj: Any) -> EngineCoreOutputs:
    if type(obj) is not list:
        raise ProtocolError(f"EngineCoreOutputs must be a msgpack array, got {_tname(obj)}")
    if len(obj) < 9:
        obj = obj + _ECO_DEFAULTS[len(obj) :]
    engine_index, outputs, stats, ts, util, finished, wc, sw, wv = obj[:9]

    if type(engine_index) is not int or engine_index < 0:
        _uint(engine_index, "EngineCoreOutputs.engine_index")
    if type(outputs) is not list:
        raise ProtocolError(f"EngineCoreOutputs.outputs must be an array, got {_tname(outputs)}")
    outs = _decode_outputs(outputs) if outputs else ()
    if stats is not None:
        stats = _decode_stats(stats)
    if type(ts) is not float:
        ts = _float(ts, "EngineCoreOutputs.timestamp")
    if util is not None and type(util) is not list:
        raise ProtocolError(
            f"EngineCoreOutputs.utility_output must be an array or nil, got {_tname(util)}"
        )
    if finished is not None:
        if type(finished) is not list:
            raise ProtocolError(
                f"EngineCoreOutputs.finished_requests must be an array or nil, "
                f"got {_tname(finished)}"
            )
        for i, r in enumerate(finished):
            if type(r) is not str:
                raise ProtocolError(
                    f"EngineCoreOutputs.finished_requests[{i}] must be a str, got {_tname(r)}"
                )
        finished = tuple(finished)
    if wc is not None and (type(wc) is not int or wc < 0):
        _uint(wc, "EngineCoreOutputs.wave_complete")
    if sw is not None and (type(sw) is not int or sw < 0):
        _uint(sw, "EngineCoreOutputs.start_wave")
    if wv is not None and type(wv) is not str:
        raise ProtocolError(
            f"EngineCoreOutputs.weight_version must be a str or nil, got {_tname(wv)}"
        )
    return _new_outputs(engine_index, outs, stats, ts, util, finished, wc, sw, wv)


class OutputKind(enum.Enum):
    """Shape of an ``EngineCoreOutputs`` message (see :func:`classify_output`)."""

    STATS = "stats"
    WAVE_COMPLETE = "wave_complete"
    START_WAVE = "start_wave"
    REQUEST_BATCH = "request_batch"
    UTILITY_REPLY = "utility_reply"
    MIXED = "mixed"
    EMPTY = "empty"


def classify_output(out: EngineCoreOutputs) -> OutputKind:
    """Classify ``out`` into mutually exclusive shapes (like vLLM's Rust decoder).

    * WAVE_COMPLETE / START_WAVE: exactly that control field and nothing else meaningful
      (no stats, outputs, finished_requests or utility_output).
    * UTILITY_REPLY: ``utility_output`` set, no stats/outputs/finished_requests.
    * REQUEST_BATCH: non-empty ``outputs`` or ``finished_requests`` not None (stats may
      ride along, as on vLLM's normal output stream).
    * STATS: ``scheduler_stats`` only.
    * MIXED: both wave fields, a wave field with anything else, or a utility reply with
      anything else (vLLM never sends these; the Rust decoder rejects them).
    * EMPTY: none of the above is set. ``engine_index``, ``timestamp`` and
      ``weight_version`` never affect the result.
    """
    wc = out.wave_complete is not None
    sw = out.start_wave is not None
    stats = out.scheduler_stats is not None
    request = bool(out.outputs) or out.finished_requests is not None
    utility = out.utility_output is not None
    if wc or sw:
        if (wc and sw) or stats or request or utility:
            return OutputKind.MIXED
        return OutputKind.WAVE_COMPLETE if wc else OutputKind.START_WAVE
    if utility:
        return OutputKind.MIXED if (stats or request) else OutputKind.UTILITY_REPLY
    if request:
        return OutputKind.REQUEST_BATCH
    if stats:
        return OutputKind.STATS
    return OutputKind.EMPTY


def decode_coordinator_output(frame: bytes) -> tuple[OutputKind, int, StatsReport | int | None]:
    """Decode and classify one frame of the coordinator's output socket in one pass.

    Equivalent to :func:`decode_engine_core_outputs` then :func:`classify_output`,
    returning ``(kind, engine_index, value)`` where ``value`` is the :class:`StatsReport`
    for STATS, the wave for WAVE_COMPLETE / START_WAVE, and None otherwise; it accepts and
    rejects exactly the same frames. The coordinator's decoder (msgspec when the ``fast``
    extra is installed, else msgpack-python) lives in ``trio_dpcoord._coordinator_decoder``.
    """
    from ._coordinator_decoder import decode_coordinator_output as decode

    return decode(frame)


# --------------------------------------------------------------------------- front publish


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


def encode_front_publish(p: FrontPublish) -> bytes:
    """Encode a front publish exactly as vLLM does (§4.7).

    Counts are ints >= 0, usage is always float64 (an int is converted; must be finite),
    ``engines_running`` must be a real bool. Invalid values raise ProtocolError.
    """
    if not isinstance(p, FrontPublish):
        raise ProtocolError(f"expected FrontPublish, got {_tname(p)}")
    counts: list[list[object]] | None
    if p.counts is None:
        counts = None
    else:
        if not isinstance(p.counts, (tuple, list)):
            raise ProtocolError(f"counts must be a tuple or None, got {_tname(p.counts)}")
        counts = []
        for i, entry in enumerate(p.counts):
            if not isinstance(entry, (tuple, list)) or len(entry) != 3:
                raise ProtocolError(f"counts[{i}] must be a (waiting, running, usage) triple")
            counts.append(
                [
                    _enc_uint(entry[0], f"counts[{i}].waiting"),
                    _enc_uint(entry[1], f"counts[{i}].running"),
                    _enc_float(entry[2], f"counts[{i}].kv_cache_usage", finite=True),
                ]
            )
    if type(p.engines_running) is not bool:
        raise ProtocolError(f"engines_running must be a bool, got {_tname(p.engines_running)}")
    wave = _enc_uint(p.current_wave, "current_wave")
    return _pack([counts, wave, p.engines_running], "front publish")


def decode_front_publish(frame: bytes) -> FrontPublish:
    """Decode a front publish: a 3-array ``[counts|nil, wave:int>=0, running:bool]``.

    Each counts entry must be ``[waiting:int>=0, running:int>=0, usage:float]`` (an int
    usage is accepted and converted; non-finite usage is rejected). Raises ProtocolError
    on anything else.
    """
    obj = _unpack(frame, "front publish", MAX_CONTROL_FRAME_BYTES)
    items = _expect_list(obj, "front publish", exact=3)
    raw_counts, wave, running = items
    counts: tuple[EngineLoad, ...] | None
    if raw_counts is None:
        counts = None
    else:
        raw = _expect_list(raw_counts, "front publish counts")
        entries = []
        for i, entry in enumerate(raw):
            e = _expect_list(entry, f"front publish counts[{i}]", exact=3)
            entries.append(
                EngineLoad(
                    waiting=_uint(e[0], f"counts[{i}].waiting"),
                    running=_uint(e[1], f"counts[{i}].running"),
                    kv_cache_usage=_finite_float(e[2], f"counts[{i}].kv_cache_usage"),
                )
            )
        counts = tuple(entries)
    wave = _uint(wave, "front publish current_wave")
    if type(running) is not bool:
        raise ProtocolError(f"front publish engines_running must be a bool, got {_tname(running)}")
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
    return _pack([SCALE_ELASTIC_EP, _enc_uint(n, "SCALE_ELASTIC_EP engine count")], "scale")


def encode_legacy_first_request(engine: int | bytes | None, wave: int) -> bytes:
    """Encode a legacy FIRST_REQ ``[engine, wave]`` (engine int >= 0, bytes or None)."""
    e = _enc_engine_ref(engine, "FIRST_REQ engine")
    return _pack([e, _enc_uint(wave, "FIRST_REQ wave")], "FIRST_REQ")


def decode_front_message(frame: bytes) -> ScaleElasticEP | LegacyFirstRequest:
    """Decode a non-subscription upstream payload received on the front XPUB (§4.8, §4.9).

    A 2-array whose first element is the string ``SCALE_ELASTIC_EP`` (second an int >= 0)
    is a resize; a 2-array whose first element is an int >= 0, bin or nil (second an int
    >= 0) is a legacy FIRST_REQ. Everything else, including a subscription frame passed
    here by mistake, raises ProtocolError.
    """
    data = frame if type(frame) is bytes else _as_bytes(frame, "front message")
    if data[:1] in (SUBSCRIBE, UNSUBSCRIBE):
        raise ProtocolError("front message: frame is a (un)subscription, not a payload")
    obj = _unpack(data, "front message", MAX_CONTROL_FRAME_BYTES)
    items = _expect_list(obj, "front message", exact=2)
    head, value = items
    if type(head) is str:
        if head != SCALE_ELASTIC_EP:
            raise ProtocolError(f"front message: unknown command {head[:40]!r}")
        return ScaleElasticEP(_uint(value, "SCALE_ELASTIC_EP engine count"))
    engine = _engine_ref(head, "FIRST_REQ engine")
    return LegacyFirstRequest(engine, _uint(value, "FIRST_REQ wave"))


# --------------------------------------------------------------------------- EngineCoreRequest

#: vLLM's ``SamplingParams.max_tokens`` default; msgspec omits it when equal (omit_defaults).
_DEFAULT_MAX_TOKENS: Final[int] = 16


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """The parts of vLLM's 22-slot ``EngineCoreRequest`` a simulation needs (§4.10).

    ``max_tokens`` travels in the ``sampling_params`` slot as the map
    ``{"max_tokens": n}`` (a ``SamplingParams`` struct encodes as a map of its non-default
    fields), or as nil when ``max_tokens`` is None.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    arrival_time: float
    client_index: int = 0
    current_wave: int = 0
    data_parallel_rank: int | None = None
    max_tokens: int | None = None


def request_slots_after_sampling(
    *,
    arrival_time: float,
    data_parallel_rank: int | None,
    client_index: int,
    current_wave: int,
    priority: int,
) -> list[Any]:
    """Slots 4-21 of vLLM's ``EngineCoreRequest`` array (``pooling_params`` to
    ``kv_hints``), from values already checked: the layout both ADD encoders (this
    module's and :mod:`trio_dpcoord.engine_protocol`'s) write, in one place."""
    return [
        None,  # pooling_params
        arrival_time,
        None,  # lora_request
        None,  # cache_salt
        data_parallel_rank,
        None,  # prompt_embeds
        None,  # prompt_is_token_ids
        client_index,
        current_wave,
        priority,
        None,  # trace_headers
        False,  # resumable
        None,  # external_req_id
        None,  # reasoning_ended
        None,  # reasoning_parser_kwargs
        False,  # abort_immediately
        None,  # session_id
        None,  # kv_hints
    ]


def encode_add_request(req: EngineCoreRequest) -> list[bytes]:
    """Frames ``[b"\\x00", payload]`` of an ADD request, payload the 22-element array.

    Unmodelled slots carry vLLM's defaults, so a request with ``max_tokens=None``
    reproduces the ``front_to_engine_add_request_skeleton`` vector byte for byte.
    Invalid field values raise ProtocolError.
    """
    if not isinstance(req, EngineCoreRequest):
        raise ProtocolError(f"expected EngineCoreRequest, got {_tname(req)}")
    max_tokens = _enc_opt_uint(req.max_tokens, "max_tokens")
    wire = [
        _enc_str(req.request_id, "request_id"),
        _enc_uint_list(req.prompt_token_ids, "prompt_token_ids"),
        None,  # mm_features
        None if max_tokens is None else {"max_tokens": max_tokens},  # sampling_params
        *request_slots_after_sampling(
            arrival_time=_enc_float(req.arrival_time, "arrival_time"),
            data_parallel_rank=_enc_opt_uint(req.data_parallel_rank, "data_parallel_rank"),
            client_index=_enc_uint(req.client_index, "client_index"),
            current_wave=_enc_uint(req.current_wave, "current_wave"),
            priority=0,
        ),
    ]
    return [_ADD_FRAME, _pack(wire, "EngineCoreRequest")]


def decode_engine_request(frames: Sequence[bytes]) -> EngineCoreRequest:
    """Decode an ADD message ``00 | EngineCoreRequest`` as an engine receives it.

    Exactly two frames; the payload must be an array of at least the 6 required slots
    (extra slots ignored, missing trailing ones default). ``prompt_token_ids`` nil decodes
    as ``()``. ``sampling_params`` nil gives ``max_tokens=None``; a map gives its
    ``max_tokens`` key (int >= 0 or nil), or vLLM's default 16 when the key is absent.
    Other request types and malformed payloads raise ProtocolError.
    """
    frames = _frame_list(frames, "ADD request")
    if len(frames) != 2:
        raise ProtocolError(f"ADD request must have 2 frames, got {len(frames)}")
    rtype = decode_request_type(frames[0])
    if rtype is not RequestType.ADD:
        raise ProtocolError(f"expected an ADD request, got {rtype.name}")
    obj = _unpack(frames[1], "EngineCoreRequest", MAX_DATA_FRAME_BYTES)
    items = _expect_list(obj, "EngineCoreRequest")
    if len(items) < 6:
        raise ProtocolError(f"EngineCoreRequest needs at least 6 elements, got {len(items)}")
    rid = items[0]
    if type(rid) is not str:
        raise ProtocolError(f"EngineCoreRequest.request_id must be a str, got {_tname(rid)}")
    prompt = items[1]
    tokens = () if prompt is None else _dec_uint_tuple(prompt, "prompt_token_ids")
    sp = items[3]
    max_tokens: int | None
    if sp is None:
        max_tokens = None
    elif type(sp) is dict:
        max_tokens = _opt_uint(sp.get("max_tokens", _DEFAULT_MAX_TOKENS), "max_tokens")
    else:
        raise ProtocolError(f"sampling_params must be a map or nil, got {_tname(sp)}")
    arrival = _float(items[5], "arrival_time")
    n = len(items)
    dp_rank = _opt_uint(items[8], "data_parallel_rank") if n > 8 else None
    client = _uint(items[11], "client_index") if n > 11 else 0
    wave = _uint(items[12], "current_wave") if n > 12 else 0
    return EngineCoreRequest(rid, tokens, arrival, client, wave, dp_rank, max_tokens)
