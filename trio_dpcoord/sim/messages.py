"""Sim-only messages between the simulated front-end and engines (not coordinator traffic).

Requests use vLLM's real frames (``00 | EngineCoreRequest`` from
:func:`trio_dpcoord.protocol.encode_add_request`) and completions vLLM's real
``EngineCoreOutputs`` (``outputs`` with ``finish_reason``, ``finished_requests``). Three
small additions of this simulation ride on the same sockets:

* **Commands** (front-end → engine, request socket): ``03 | msgpack [client_index, call_id,
  method, args]``, shaped like vLLM's UTILITY calls. Methods: ``"pause_scheduler"``
  (two-phase pause, docs/protocol.md §6.8) and ``"resume_scheduler"``; ``args`` is ``[]``.
* **Status events** (engine → front-end, completion socket): an ``EngineCoreOutputs`` whose
  ``utility_output`` is vLLM's ``UtilityOutput`` shape ``[call_id, None, result]`` with
  ``result`` a map ``{"event": EVENT, "wave": W}``. ``call_id`` is 0 for unsolicited
  events and the command's id for replies. Events: ``"running"`` (the engine takes its
  first step of wave W), ``"idle"`` (wave W ended on this rank), ``"paused"`` (pause
  consensus reached; reply to pause_scheduler), ``"resumed"`` (reply to
  resume_scheduler).
* **Hello** (engine → front-end, request socket): once READY arrived, each engine's DEALER
  sends one frame ``msgpack ["hello", rank]`` so that the front-end's ROUTER learns the
  route to it before the first request (the role of vLLM's start-up handshake).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import msgpack

from .. import protocol

__all__ = [
    "EVENT_IDLE",
    "EVENT_PAUSED",
    "EVENT_RESUMED",
    "EVENT_RUNNING",
    "PAUSE_SCHEDULER",
    "RESUME_SCHEDULER",
    "EngineStatus",
    "UtilityCall",
    "decode_hello",
    "decode_utility_call",
    "encode_abort",
    "encode_hello",
    "encode_utility_call",
    "parse_status",
    "status_output",
]

PAUSE_SCHEDULER: Final = "pause_scheduler"
RESUME_SCHEDULER: Final = "resume_scheduler"
EVENT_RUNNING: Final = "running"
EVENT_IDLE: Final = "idle"
EVENT_PAUSED: Final = "paused"
EVENT_RESUMED: Final = "resumed"

_UTILITY_FRAME: Final = protocol.RequestType.UTILITY.frame


@dataclass(frozen=True, slots=True)
class UtilityCall:
    """A command to one engine."""

    client_index: int
    call_id: int
    method: str
    args: tuple[object, ...] = ()
    """The call's arguments (the simulation's own commands take none)."""


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """A status event from an engine (see the module docstring)."""

    engine_index: int
    call_id: int
    event: str
    wave: int


def encode_utility_call(call: UtilityCall) -> list[bytes]:
    payload = [call.client_index, call.call_id, call.method, list(call.args)]
    return [_UTILITY_FRAME, msgpack.packb(payload)]


def decode_utility_call(frames: Sequence[bytes]) -> UtilityCall:
    """Decode ``03 | [client_index, call_id, method, args]``; ProtocolError if malformed."""
    if len(frames) != 2 or bytes(frames[0]) != _UTILITY_FRAME:
        raise protocol.ProtocolError("UTILITY call must be 2 frames starting with 03")
    try:
        items = msgpack.unpackb(bytes(frames[1]))
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise protocol.ProtocolError(f"UTILITY call: not msgpack ({exc})") from None
    if (
        not isinstance(items, list)
        or len(items) != 4
        or type(items[0]) is not int
        or type(items[1]) is not int
        or type(items[2]) is not str
    ):
        raise protocol.ProtocolError(f"UTILITY call: expected [int, int, str, args], got {items!r}")
    args = tuple(items[3]) if isinstance(items[3], list) else ()
    return UtilityCall(items[0], items[1], items[2], args)


def status_output(engine_index: int, event: str, wave: int, call_id: int = 0) -> bytes:
    """An encoded ``EngineCoreOutputs`` carrying one status event."""
    return protocol.encode_engine_core_outputs(
        protocol.EngineCoreOutputs(
            engine_index=engine_index,
            utility_output=[call_id, None, {"event": event, "wave": wave}],
        )
    )


def parse_status(out: protocol.EngineCoreOutputs) -> EngineStatus | None:
    """The status event in ``out.utility_output``, or None if it carries none."""
    util = out.utility_output
    if not isinstance(util, list) or len(util) != 3 or not isinstance(util[2], dict):
        return None
    call_id, _failure, result = util
    event = result.get("event")
    wave = result.get("wave")
    if type(call_id) is not int or type(event) is not str or type(wave) is not int:
        return None
    return EngineStatus(out.engine_index, call_id, event, wave)


def encode_abort(request_ids: Sequence[str]) -> list[bytes]:
    """vLLM's ``ABORT`` request: ``01 | msgpack [request_id, ...]``."""
    return [protocol.RequestType.ABORT.frame, msgpack.packb(list(request_ids))]


def encode_hello(rank: int) -> bytes:
    frame: bytes = msgpack.packb(["hello", rank])
    return frame


def decode_hello(frame: bytes) -> int | None:
    """The rank in a hello frame, or None if ``frame`` is not one."""
    try:
        items = msgpack.unpackb(frame)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if isinstance(items, list) and len(items) == 2 and items[0] == "hello":
        rank = items[1]
        if type(rank) is int and rank >= 0:
            return rank
    return None
