"""The engine client's start-up: its sockets bound, every engine's HELLO answered and its
READY and ready response awaited (vLLM's ``wait_for_engine_startup``, docs/protocol.md §14).

The rules (who may say what when) are :class:`~trio_dpcoord.core.HandshakeState`'s; the
bytes are :mod:`trio_dpcoord.protocol`'s; this module only moves them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import trio
import zmq

from .._errors import (
    EngineStartupError,
)
from .._reject_log import RejectLog
from ..core._engine_client import HandshakeState
from ..protocol import (
    EngineHandshakeError,
    ProtocolError,
    decode_handshake,
    decode_ready_response,
    encode_handshake_metadata,
)
from ..trio_zmq import AsyncSocket, open_monitor, open_socket
from .coordinator import Coordinator

__all__ = [
    "ClientSockets",
    "bind_client_sockets",
    "handshake_metadata",
    "run_handshake",
    "wait_for_engines",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClientSockets:
    """The request input (ROUTER) and, per rank, its output (PULL), the PULL's
    disconnection monitor and the address the rank connects to."""

    input: AsyncSocket
    input_address: str
    outputs: list[tuple[AsyncSocket, AsyncSocket, str]]


async def bind_client_sockets(
    stack: AsyncExitStack,
    context: zmq.Context[zmq.Socket[bytes]],
    engine_count: int,
    free: str,
    tcp_options: Mapping[int, int | bytes],
) -> ClientSockets:
    """Bind the input and one output per rank on free ports of ``free``'s host; each
    monitor is open before any engine can connect, so that no disconnection goes unseen."""
    input_socket = await stack.enter_async_context(
        open_socket(context, zmq.ROUTER, options={zmq.SNDHWM: 0, **tcp_options})
    )
    input_address = input_socket.bind(free)
    outputs: list[tuple[AsyncSocket, AsyncSocket, str]] = []
    for _ in range(engine_count):
        pull = await stack.enter_async_context(
            open_socket(context, zmq.PULL, options={zmq.RCVHWM: 0, **tcp_options})
        )
        monitor = await stack.enter_async_context(
            open_monitor(context, pull, zmq.EVENT_DISCONNECTED)
        )
        outputs.append((pull, monitor, pull.bind(free)))
    return ClientSockets(input_socket, input_address, outputs)


def handshake_metadata(
    sockets: ClientSockets,
    coordinator: Coordinator,
    parallel_config: Mapping[str, Any] | None,
) -> Callable[[int], Mapping[str, Any]]:
    """vLLM's ``EngineHandshakeMetadata`` for each rank: its sockets, no front-end stats
    address (the coordinator is in this process), and ``parallel_config``."""

    def metadata(rank: int) -> Mapping[str, Any]:
        return {
            "addresses": {
                "inputs": [sockets.input_address],
                "outputs": [sockets.outputs[rank][2]],
                "coordinator_input": coordinator.back_publish_address,
                "coordinator_output": coordinator.back_output_address,
                "frontend_stats_publish_address": None,
            },
            "parallel_config": dict(parallel_config or {}),
        }

    return metadata


async def wait_for_engines(
    state: HandshakeState,
    handshake: AsyncSocket,
    input_socket: AsyncSocket,
    client_index: int,
    startup_timeout: float,
) -> None:
    """The handshake of every rank, or :class:`EngineStartupError` naming the missing."""
    logger.info(
        "engine client: waiting for %d engine(s) on %s",
        len(state.expected),
        handshake.last_endpoint,
    )
    with trio.move_on_after(startup_timeout) as scope:
        await run_handshake(state, handshake, input_socket, client_index)
    if scope.cancelled_caught:
        missing = state.missing() or sorted(state.expected - state.ready_responses.keys())
        raise EngineStartupError(
            f"engines did not start within {startup_timeout:g} s: {state.describe_missing()}",
            missing,
        )
    logger.info(
        "engine client: %d engine(s) ready (vLLM %s)",
        len(state.expected),
        state.ready_responses[0].get("vllm_version", "?"),
    )


async def run_handshake(
    state: HandshakeState, handshake: AsyncSocket, input_socket: AsyncSocket, client_index: int
) -> None:
    """HELLO/READY on the handshake socket, then every ready response on the input."""
    reject = RejectLog(logger)
    while len(state.ready) < len(state.expected):
        identity, *rest = await handshake.recv_multipart()
        try:
            if len(rest) != 1:
                raise ProtocolError(f"handshake message of {len(rest) + 1} frames")
            message = decode_handshake(rest[0])
            answer = state.receive(identity, message)
        except (EngineHandshakeError, ProtocolError) as exc:
            if "parallel config hash" in str(exc):
                raise EngineStartupError(str(exc)) from exc
            reject("handshake", str(exc))
            continue
        rank = int.from_bytes(identity, "little")
        logger.debug("engine rank %d: %s", rank, message.get("status"))
        if answer is not None:
            await handshake.send_multipart([identity, encode_handshake_metadata(answer)])
    while not state.done:
        identity, *rest = await input_socket.recv_multipart()
        try:
            if len(rest) != 1:
                raise ProtocolError(f"ready response of {len(rest) + 1} frames")
            state.receive_ready_response(identity, decode_ready_response(rest[0]))
        except (EngineHandshakeError, ProtocolError) as exc:
            reject("ready_response", str(exc))


def tcp_host(address: str) -> str:
    """The host of a ``tcp://HOST:PORT`` handshake address; ``ValueError`` otherwise."""
    if not address.startswith("tcp://"):
        raise ValueError(f"the handshake address must be tcp://HOST:PORT, got {address!r}")
    host, _, port = address[len("tcp://") :].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"the handshake address must be tcp://HOST:PORT, got {address!r}")
    return host
