"""The codec's ground floor: its error, its limits and frame constants, and the
checked msgpack helpers every message codec of :mod:`trio_dpcoord.protocol` is built on.

Wire codec for vLLM 0.33.0's data-parallel coordinator protocol.

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
import math
from collections.abc import Sequence
from typing import Any, Final

import msgpack


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

UINT64_MAX: Final[int] = (1 << 64) - 1


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


ADD_FRAME: Final[bytes] = b"\x00"
START_DP_WAVE_FRAME: Final[bytes] = b"\x02"


# --------------------------------------------------------------------------- helpers


def preview(data: bytes, limit: int = 16) -> str:
    head = data[:limit].hex()
    return head + ("..." if len(data) > limit else "")


def as_bytes(frame: object, what: str) -> bytes:
    """``frame`` as bytes; any buffer-protocol object (bytearray, memoryview, zmq.Frame)."""
    if type(frame) is bytes:
        return frame
    if isinstance(frame, (str, int)):  # int: bytes(5) would make 5 zero bytes
        raise ProtocolError(f"{what}: frame must be bytes, got {type_name(frame)}")
    try:
        return bytes(memoryview(frame))  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError) as exc:
        raise ProtocolError(
            f"{what}: frame must be bytes, got {type_name(frame)} ({exc})"
        ) from None


def frame_list(frames: object, what: str) -> Sequence[Any]:
    """A multipart message as a sequence of frames, or ProtocolError."""
    if type(frames) is list or type(frames) is tuple:
        return frames
    if isinstance(frames, (str, bytes, bytearray, memoryview)) or frames is None:
        raise ProtocolError(f"{what}: expected a sequence of frames, got {type_name(frames)}")
    try:
        result: list[Any] = list(frames)  # type: ignore[call-overload]
    except TypeError:
        raise ProtocolError(
            f"{what}: expected a sequence of frames, got {type_name(frames)}"
        ) from None
    return result


def unpack(frame: object, what: str, max_bytes: int) -> Any:
    """Exactly one msgpack object from ``frame``, or ProtocolError."""
    data = frame if type(frame) is bytes else as_bytes(frame, what)
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
            f"{what}: not a valid msgpack frame ({detail}; starts {preview(data)})"
        ) from None


def pack(value: object, what: str) -> bytes:
    try:
        packed: bytes = msgpack.packb(value, use_bin_type=True, use_single_float=False)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ProtocolError(f"{what}: cannot encode ({exc})") from None
    return packed


def type_name(value: object) -> str:
    return type(value).__name__


def dec_uint(value: object, what: str) -> int:
    """Decoder check: a non-negative msgpack int (bools rejected)."""
    if type(value) is not int:
        raise ProtocolError(f"{what} must be an int, got {type_name(value)}")
    if value < 0:
        raise ProtocolError(f"{what} must be >= 0, got {value}")
    return value


def dec_opt_uint(value: object, what: str) -> int | None:
    if value is None:
        return None
    return dec_uint(value, what)


def dec_float(value: object, what: str) -> float:
    """Decoder check: float64 or int (msgspec accepts ints for float fields), not bool."""
    t = type(value)
    if t is float:
        return value  # type: ignore[return-value]
    if t is int:
        return float(value)  # type: ignore[arg-type]
    raise ProtocolError(f"{what} must be a float, got {type_name(value)}")


def dec_finite_float(value: object, what: str) -> float:
    f = dec_float(value, what)
    if not math.isfinite(f):
        raise ProtocolError(f"{what} must be finite, got {f}")
    return f


def enc_uint(value: object, what: str) -> int:
    """Encoder check: int subclass (IntEnum ok, bool not) in 0..2**64-1, returned as int."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{what} must be an int, got {type_name(value)}")
    v = int(value)
    if v < 0:
        raise ProtocolError(f"{what} must be >= 0, got {v}")
    if v > UINT64_MAX:
        raise ProtocolError(f"{what} too large to encode: {v} > 2**64-1")
    return v


def enc_opt_uint(value: object, what: str) -> int | None:
    return None if value is None else enc_uint(value, what)


def enc_float(value: object, what: str, *, finite: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ProtocolError(f"{what} must be a float, got {type_name(value)}")
    try:
        f = float(value)
    except OverflowError:
        raise ProtocolError(f"{what} out of float64 range") from None
    if finite and not math.isfinite(f):
        raise ProtocolError(f"{what} must be finite, got {f}")
    return f


def enc_str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a str, got {type_name(value)}")
    return str(value)


def enc_opt_str(value: object, what: str) -> str | None:
    return None if value is None else enc_str(value, what)


def enc_uint_list(values: object, what: str) -> list[int]:
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Sequence):
        raise ProtocolError(f"{what} must be a sequence of ints, got {type_name(values)}")
    return [enc_uint(v, f"{what}[{i}]") for i, v in enumerate(values)]


def dec_uint_tuple(value: object, what: str) -> tuple[int, ...]:
    if type(value) is not list:
        raise ProtocolError(f"{what} must be an array of ints, got {type_name(value)}")
    for i, v in enumerate(value):
        if type(v) is not int or v < 0:
            raise ProtocolError(f"{what}[{i}] must be an int >= 0, got {v!r}")
    return tuple(value)


def expect_list(value: object, what: str, *, exact: int | None = None) -> list[Any]:
    if type(value) is not list:
        raise ProtocolError(f"{what} must be a msgpack array, got {type_name(value)}")
    if exact is not None and len(value) != exact:
        raise ProtocolError(f"{what} must have {exact} elements, got {len(value)}")
    return value


def dec_engine_ref(value: object, what: str) -> int | bytes | None:
    """Decoder check for an engine reference: int >= 0, bin (an identity) or nil."""
    if value is None or type(value) is bytes:
        return value
    if type(value) is int:
        if value < 0:
            raise ProtocolError(f"{what} must be >= 0, got {value}")
        return value
    raise ProtocolError(f"{what} must be an int, bytes or nil, got {type_name(value)}")


def enc_engine_ref(value: object, what: str) -> int | bytes | None:
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return enc_uint(value, what)
