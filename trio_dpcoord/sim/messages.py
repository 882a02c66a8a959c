"""The simulation's own messages between its front-end and engines (not coordinator traffic).

Requests, aborts and commands are vLLM's real frames, from :mod:`trio_dpcoord.protocol`
(``00 | EngineCoreRequest``, ``01 | [request_id, ...]``, ``03 | [client_index, call_id,
method, args]``), and completions vLLM's real ``EngineCoreOutputs`` (``outputs`` with
``finish_reason``, ``finished_requests``). The commands the simulated engines know are
``"pause_scheduler"`` (two-phase pause, docs/protocol.md §6.8) and
``"resume_scheduler"``, with no arguments. Two small additions of this simulation ride on
the same sockets, and live here:

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
    "decode_hello",
    "encode_hello",
    "parse_status",
    "status_output",
]

PAUSE_SCHEDULER: Final = "pause_scheduler"
RESUME_SCHEDULER: Final = "resume_scheduler"
EVENT_RUNNING: Final = "running"
EVENT_IDLE: Final = "idle"
EVENT_PAUSED: Final = "paused"
EVENT_RESUMED: Final = "resumed"


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """A status event from an engine (see the module docstring)."""

    engine_index: int
    call_id: int
    event: str
    wave: int


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


def encode_hello(rank: int) -> bytes:
    """The hello frame of engine ``rank``."""
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
