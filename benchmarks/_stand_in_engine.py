"""``python -m benchmarks._stand_in_engine ARGS``: the simulated engine core of ``python -m
trio_dpcoord.sim engine ARGS``, writing its outputs at wire speed.

The client-ceiling benchmark (:mod:`benchmarks._client_ceiling`) needs engines that cost
far less per token than the client they feed, on the same two cores. The simulated
engine core (:class:`trio_dpcoord.sim.engine_core.SimEngineCore`: vLLM's handshake,
requests, lock-step waves through the client's coordinator) builds an
``EngineCoreOutput`` per request per step and encodes it with the protocol's checked
encoder, about 4 us per output: as much as the client spends on it. Here the same
engine writes the same bytes (vLLM's 9-slot ``EngineCoreOutputs`` with 19-slot outputs,
byte for byte what :func:`trio_dpcoord.protocol.encode_engine_core_outputs` writes for
them, tests/test_client_ceiling.py) with one ``msgpack.packb`` per step. Everything else
is the simulated engine's.
"""

from __future__ import annotations

import sys
from typing import Any

import msgpack
import trio

import trio_dpcoord.sim.__main__ as sim_main
from trio_dpcoord import protocol
from trio_dpcoord.sim.engine_core import SimEngineCore

_ABORT = 2
"""vLLM's ``FinishReason.ABORT``: an aborted request's output carries no token."""
_UNSET_SLOTS = (None, None, None, None, None, None, None, 0, None, None, None, None, None)
"""An ``EngineCoreOutput``'s slots 6-18 (``stop_reason`` to ``error``) at their defaults."""


def outputs_frame(
    rank: int,
    items: list[tuple[str, int, int | None]],
    timestamp: float,
    stats: dict[str, Any] | None = None,
) -> bytes:
    """vLLM's ``EngineCoreOutputs`` for ``(request_id, token, finish_reason)`` items, as
    the simulated engine sends them (no token for an aborted request, the finished ones
    listed, weight version ``"default"``)."""
    outputs = [
        [rid, [token] if reason != _ABORT else [], None, None, None, reason, *_UNSET_SLOTS]
        for rid, token, reason in items
    ]
    finished = [rid for rid, _, reason in items if reason is not None] or None
    packed: bytes = msgpack.packb(
        [rank, outputs, stats, float(timestamp), None, finished, None, None, "default"]
    )
    return packed


class WireSpeedEngineCore(SimEngineCore):
    """:class:`SimEngineCore` with its step's outputs packed in one call."""

    async def _send_outputs(
        self,
        items: list[tuple[Any, int | None]],
        stats: protocol.SchedulerStats | None = None,
    ) -> None:
        if stats is not None:  # the prefix-cache engine's stats: the checked encoder
            await super()._send_outputs(items, stats)
            return
        rows = [(r.request_id, r.generated, reason) for r, reason in items]
        await self._to_frontend(outputs_frame(self.rank, rows, trio.current_time()))


def main() -> int:
    sim_main.SimEngineCore = WireSpeedEngineCore  # type: ignore[attr-defined]
    return sim_main.main(["engine", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
