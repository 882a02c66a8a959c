"""Test helpers: bare engine peers that speak vLLM's engine side of the protocol.

For tests of a front-end or of the coordinator itself: each :class:`EnginePeer` is what
a vLLM engine's coordinator-facing sockets are (an XSUB with its rank as identity, a
PUSH of ``EngineCoreOutputs``), with no scheduler behind them. For engines that run
waves in lock-step, see :mod:`trio_dpcoord.sim`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import zmq

from . import protocol
from .trio_zmq import AsyncSocket, curve_client_options, open_context, open_socket

__all__ = ["EnginePeer", "connect_engines"]


class EnginePeer:
    """One engine's coordinator-facing sockets, driven by hand."""

    def __init__(self, index: int, sub: AsyncSocket, push: AsyncSocket) -> None:
        self.index = index
        self.sub = sub
        self.push = push

    async def subscribe(self) -> None:
        await self.sub.send(protocol.SUBSCRIBE)

    async def unsubscribe(self) -> None:
        await self.sub.send(protocol.UNSUBSCRIBE)

    async def next_broadcast_frames(self) -> list[bytes]:
        """The raw frames of the next broadcast (READY or START_DP_WAVE)."""
        return await self.sub.recv_multipart()

    async def next_broadcast(self) -> str | protocol.StartDPWave:
        return protocol.decode_engine_broadcast(await self.sub.recv_multipart())

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.push.send_multipart(frames)

    async def send_output(self, out: protocol.EngineCoreOutputs) -> None:
        await self.push.send(protocol.encode_engine_core_outputs(out))

    async def start_wave(self, wave: int) -> None:
        await self.send_output(protocol.EngineCoreOutputs(engine_index=self.index, start_wave=wave))

    async def wave_complete(self, wave: int) -> None:
        await self.send_output(
            protocol.EngineCoreOutputs(engine_index=self.index, wave_complete=wave)
        )

    async def stats(
        self, waiting: int, running: int, usage: float = 0.0, *, wave: int = 0, step: int = 0
    ) -> None:
        stats = protocol.SchedulerStats(
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            step_counter=step,
            current_wave=wave,
            kv_cache_usage=usage,
        )
        await self.send_output(
            protocol.EngineCoreOutputs(engine_index=self.index, scheduler_stats=stats)
        )


@asynccontextmanager
async def connect_engines(
    input_address: str,
    output_address: str,
    count: int,
    *,
    first_index: int = 0,
    subscribe: bool = True,
    curve_server_key: bytes | None = None,
) -> AsyncIterator[list[EnginePeer]]:
    """``count`` engine peers connected to a coordinator's broadcast and output sockets.

    With ``curve_server_key`` (a coordinator's ``curve_public_key``) each peer is a
    CURVE client with a fresh key pair.
    """
    async with AsyncExitStack() as stack:
        context = await stack.enter_async_context(open_context())
        security = curve_client_options(curve_server_key)
        peers = []
        for index in range(first_index, first_index + count):
            sub = await stack.enter_async_context(
                open_socket(
                    context,
                    zmq.XSUB,
                    connect=input_address,
                    options={
                        zmq.IDENTITY: index.to_bytes(2, "little"),
                        zmq.LINGER: 0,
                        **security,
                    },
                )
            )
            push = await stack.enter_async_context(
                open_socket(
                    context,
                    zmq.PUSH,
                    connect=output_address,
                    options={zmq.LINGER: 0, **security},
                )
            )
            peer = EnginePeer(index, sub, push)
            if subscribe:
                await peer.subscribe()
            peers.append(peer)
        yield peers
