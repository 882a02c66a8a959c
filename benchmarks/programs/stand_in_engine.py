"""``python -m benchmarks.programs.stand_in_engine ARGS``: the simulated engine core of ``python -m
trio_dpcoord.sim engine ARGS``, costing far less per request than the client it feeds.

The client-ceiling benchmark (:mod:`benchmarks.sections.client_ceiling`) needs engines that cost
far less per request than the client, on the same two cores, so that the client's process
is what limits. The simulated engine core (:class:`trio_dpcoord.sim.engine_core.SimEngineCore`:
vLLM's handshake, requests, lock-step waves through the client's coordinator, steps that
never go backwards) decodes each ADD with the checked decoder (~5 us), hands it to its
busy loop through a channel, and builds and encodes an ``EngineCoreOutput`` per request
per step (~4 us per output): as much as the client spends on it. Here the same engine

* decodes each ADD with one msgspec call that skips what it does not read (the request id,
  ``max_tokens``, the wave stamp; ~0.6 us), a whole batch of queued ADDs per channel item;
* pre-encodes each request's two possible outputs once, when it arrives (vLLM's 19-slot
  ``EngineCoreOutput`` with one token, and the last one with finish reason ``length``);
* writes each step as one multi-output ``EngineCoreOutputs`` frame (vLLM's 9 slots) by
  joining the pre-encoded outputs: per output token one counter and one list append.

The bytes are those :func:`outputs_frame` (and so the protocol's encoder) writes for the
same items, every token id :data:`TOKEN` (tests/test_client_ceiling.py). Everything else
(handshake, waves, the lock-step collective once per step, stats to the coordinator,
utility calls, aborts) is the simulated engine's.
"""

from __future__ import annotations

import logging
import struct
import sys
from dataclasses import dataclass
from typing import Any, cast

import msgpack
import msgspec
import trio

import trio_dpcoord.sim.__main__ as sim_main
from trio_dpcoord import protocol
from trio_dpcoord.sim.engine_core import SimEngineCore
from trio_dpcoord.sim.engine_state import FINISH_LENGTH, RequestState

logger = logging.getLogger(__name__)

_ABORT = 2
"""vLLM's ``FinishReason.ABORT``: an aborted request's output carries no token."""
_UNSET_SLOTS = (None, None, None, None, None, None, None, 0, None, None, None, None, None)
"""An ``EngineCoreOutput``'s slots 6-18 (``stop_reason`` to ``error``) at their defaults."""
TOKEN = 7
"""The token id of every output the stand-in writes (the clients count tokens only)."""
_ADD = bytes((protocol.RequestType.ADD,))
"""The first frame of an ADD."""


def outputs_frame(
    rank: int,
    items: list[tuple[str, int, int | None]],
    timestamp: float,
    stats: dict[str, Any] | None = None,
) -> bytes:
    """vLLM's ``EngineCoreOutputs`` for ``(request_id, token, finish_reason)`` items, as
    the simulated engine sends them (no token for an aborted request, the finished ones
    listed, weight version ``"default"``), in one ``msgpack.packb``."""
    outputs = [
        [rid, [token] if reason != _ABORT else [], None, None, None, reason, *_UNSET_SLOTS]
        for rid, token, reason in items
    ]
    finished = [rid for rid, _, reason in items if reason is not None] or None
    packed: bytes = msgpack.packb(
        [rank, outputs, stats, float(timestamp), None, finished, None, None, "default"]
    )
    return packed


# --- pre-encoded outputs ----------------------------------------------------------------

_OUTPUT_HEAD = b"\xdc\x00\x13"
"""msgpack's header of a 19-slot array (an ``EngineCoreOutput``)."""
_MID_TAIL = msgpack.packb([[TOKEN], None, None, None, None, *_UNSET_SLOTS])[
    3:
]  # after the 18-item header
_LAST_TAIL = msgpack.packb([[TOKEN], None, None, None, FINISH_LENGTH, *_UNSET_SLOTS])[
    3:
]  # after the 18-item header
_FRAME_TAIL = b"\xc0\xc0" + msgpack.packb("default")
"""Slots 6-8 after ``finished_requests``: ``utility_output``, ``start_wave``, weight version."""


def array_header(n: int) -> bytes:
    """msgpack's header of an ``n``-item array."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


@dataclass(slots=True)
class WireRequest(RequestState):
    """A request with its two outputs pre-encoded (and its id)."""

    packed_id: bytes = b""
    mid: bytes = b""
    last: bytes = b""


def wire_request(request_id: str, max_tokens: int) -> WireRequest:
    packed_id: bytes = msgpack.packb(request_id)
    return WireRequest(
        request_id,
        max(1, max_tokens),
        packed_id=packed_id,
        mid=_OUTPUT_HEAD + packed_id + _MID_TAIL,
        last=_OUTPUT_HEAD + packed_id + _LAST_TAIL,
    )


def step_frame(rank: int, requests: list[WireRequest], timestamp: float) -> tuple[bytes, list[Any]]:
    """One step of ``requests`` (each one token closer to its end): the frame, and the
    requests still running after it. The same bytes as :func:`outputs_frame` for items
    ``(request_id, TOKEN, None or FINISH_LENGTH)``."""
    parts: list[bytes] = []
    finished: list[bytes] = []
    running: list[Any] = []
    add, done, keep = parts.append, finished.append, running.append
    for r in requests:
        r.remaining -= 1
        if r.remaining > 0:
            add(r.mid)
            keep(r)
        else:
            add(r.last)
            done(r.packed_id)
    frame = b"".join(
        (
            b"\x99",
            msgpack.packb(rank),
            array_header(len(parts)),
            *parts,
            b"\xc0\xcb",  # no stats; the timestamp, a float64
            struct.pack(">d", timestamp),
            b"\xc0",
            array_header(len(finished)) + b"".join(finished) if finished else b"\xc0",
            _FRAME_TAIL,
        )
    )
    return frame, running


# --- decoding ADDs ----------------------------------------------------------------------


class _Sampling(msgspec.Struct):
    max_tokens: int | None = 16  # vLLM's default, omitted from the map when unchanged


class _Add(msgspec.Struct, array_like=True):
    """The slots of vLLM's ``EngineCoreRequest`` the stand-in reads (0, 3 and 12, as
    :func:`trio_dpcoord.protocol.decode_engine_request` does), the rest skipped."""

    request_id: str
    slot1: msgspec.Raw
    slot2: msgspec.Raw
    sampling_params: _Sampling | None
    slot4: msgspec.Raw
    slot5: msgspec.Raw
    slot6: msgspec.Raw = msgspec.Raw()
    slot7: msgspec.Raw = msgspec.Raw()
    slot8: msgspec.Raw = msgspec.Raw()
    slot9: msgspec.Raw = msgspec.Raw()
    slot10: msgspec.Raw = msgspec.Raw()
    slot11: msgspec.Raw = msgspec.Raw()
    current_wave: int = 0


_decode_add = msgspec.msgpack.Decoder(_Add).decode


def decode_add(payload: bytes) -> tuple[str, int | None, int]:
    """An ADD's ``(request_id, max_tokens, current_wave)`` (its second frame), in one
    msgspec call; ``msgspec.DecodeError`` for a payload it cannot read."""
    add = _decode_add(payload)
    sp = add.sampling_params
    return add.request_id, (sp.max_tokens if sp is not None else None), add.current_wave


@dataclass(slots=True)
class _AddBatch:
    """The ADDs of one receive, in order, and their wave stamps."""

    requests: list[WireRequest]
    waves: list[int]


class WireSpeedEngineCore(SimEngineCore):
    """:class:`SimEngineCore` with cheap ADDs and pre-encoded outputs (module docstring)."""

    async def _request_receiver(
        self, dealer: Any, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        send: Any = self._input_send.send_nowait  # takes an _AddBatch too (_handle)
        while True:
            batch = _AddBatch([], [])
            for frames in await dealer.recv_multipart_batch():
                if len(frames) == 2 and frames[0] == _ADD:
                    try:
                        request_id, tokens, wave = decode_add(frames[1])
                    except msgspec.DecodeError:
                        pass  # the checked decoder below says what is wrong
                    else:
                        tokens = tokens or self.config.tokens_per_request
                        batch.requests.append(wire_request(request_id, tokens))
                        batch.waves.append(wave)
                        continue
                if batch.requests:
                    send(batch)
                    batch = _AddBatch([], [])
                self._queue_request(frames)  # anything else, as the simulated engine takes it
            if batch.requests:
                send(batch)

    async def _handle(self, item: Any) -> None:
        if type(item) is not _AddBatch:
            await super()._handle(item)
            return
        self.waiting.extend(item.requests)
        for stamped in item.waves:  # the simulated engine's wave rules, request by request
            await self._on_stamped_wave(stamped)

    async def _real_step(self) -> None:
        if self._prefix is not None:
            await super()._real_step()
            return
        running, waiting = self.running, self.waiting
        room = self.config.max_running - len(running)
        while waiting and room > 0:
            running.append(waiting.popleft())
            room -= 1
        await trio.sleep(self.config.step_time)
        before = len(self.running)
        requests = cast("list[WireRequest]", self.running)  # every request came as one
        frame, running = step_frame(self.rank, requests, trio.current_time())
        self.running = running
        self.counters.requests_finished += before - len(self.running)
        await self._to_frontend(frame)

    async def _send_outputs(
        self,
        items: list[tuple[Any, int | None]],
        stats: protocol.SchedulerStats | None = None,
    ) -> None:
        """Aborts and the prefix-cache engine's steps: one ``msgpack.packb``, or the
        checked encoder with stats."""
        if stats is not None:
            await super()._send_outputs(items, stats)
            return
        rows = [(r.request_id, TOKEN, reason) for r, reason in items]
        await self._to_frontend(outputs_frame(self.rank, rows, trio.current_time()))


def main() -> int:
    sim_main.SimEngineCore = WireSpeedEngineCore  # type: ignore[attr-defined]
    return sim_main.main(["engine", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
