"""The engine client's start-up: its sockets bound, every engine's HELLO answered and its
READY and ready response awaited (vLLM's ``wait_for_engine_startup``, docs/protocol.md §14),
then the handle (:class:`~.engine_client.EngineClient`) and its tasks run:
:func:`open_engine_client`.

The rules (who may say what when) are :class:`~trio_dpcoord.core.HandshakeState`'s; the
bytes are :mod:`trio_dpcoord.protocol`'s; this module only moves them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
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
from ..routing._chooser import EngineChooser, Routing
from ..routing._settings import PrefixRouting
from ..trio_zmq import AsyncSocket, open_context, open_monitor, open_socket
from .coordinator import Coordinator, open_coordinator
from .endpoints import DEFAULT_LIVENESS, Liveness, check_bind_address
from .engine_client import EngineClient
from .engine_io import ClientSockets, Outbox, run_client_tasks

__all__ = [
    "DEFAULT_STARTUP_TIMEOUT",
    "bind_client_sockets",
    "handshake_metadata",
    "open_engine_client",
    "run_handshake",
    "wait_for_engines",
]

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT = 600.0
"""vLLM's own default (``VLLM_ENGINE_READY_TIMEOUT_S``): loading weights takes a while."""


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
        pull = await stack.enter_async_context(  # read by its rank's listener alone
            open_socket(context, zmq.PULL, options={zmq.RCVHWM: 0, **tcp_options}, exclusive=True)
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


@asynccontextmanager
async def open_engine_client(
    engine_count: int,
    handshake_address: str,
    *,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    parallel_config: Mapping[str, Any] | None = None,
    client_index: int = 0,
    allow_remote: bool = False,
    liveness: Liveness = DEFAULT_LIVENESS,
    wave_coordination: bool = True,
    silence_timeout: float | None = 120.0,
    routing: Routing = "vllm",
    prefix_routing: PrefixRouting | None = None,
) -> AsyncIterator[EngineClient]:
    """Serve ``engine_count`` DP engine cores that connect to ``handshake_address``.

    ``handshake_address`` is ``tcp://HOST:PORT``, what the engines were given as
    ``--data-parallel-address HOST --data-parallel-rpc-port PORT``; the request input,
    the per-rank output sockets and the coordinator's engine sockets are bound on the
    same host, on free ports (``allow_remote`` for a host other than loopback: the
    traffic is unauthenticated, as vLLM's). Each HELLO is answered with vLLM's
    ``EngineHandshakeMetadata``: those addresses, no front-end stats address (the
    coordinator is in this process), and ``parallel_config`` (vLLM's DP master keys,
    ``data_parallel_master_ip`` ...; empty by default, so engines launched together keep
    the ports their launcher chose for them).

    Yields the :class:`EngineClient` once every rank said READY and sent its ready
    response; :class:`EngineStartupError` naming the missing ranks after
    ``startup_timeout`` seconds. Leaving the block fails whatever is in flight with
    :class:`RequestAbortedError` and closes every socket and task; the engines
    themselves keep running (they belong to whoever started them). A failure of the
    client's own tasks comes out as :class:`EngineClientError`.

    A rank is taken as dead (its requests and calls fail with :class:`EngineDeadError`
    naming it; it is chosen no more) when it sends ``ENGINE_CORE_DEAD``, when its output
    connection closes or its heartbeats stop (``liveness``), or when it says nothing for
    ``silence_timeout`` seconds while work waits on it (None: never; a paused scheduler
    holding requests is silent too, so keep it well above the longest pause).

    ``routing``: how requests without a pinned rank are placed, ``"vllm"`` (vLLM
    0.33.0's score, the default) or ``"prefix"`` (prefix-cache affinity weighed against
    the busiest rank, settings in ``prefix_routing``; pinned requests are learnt too).
    """
    if engine_count < 1:
        raise ValueError("engine_count must be at least 1")
    chooser = EngineChooser(engine_count, routing=routing, prefix_routing=prefix_routing)
    host = tcp_host(handshake_address)
    check_bind_address(handshake_address, allow_remote=allow_remote)
    free = f"tcp://{host}:0"
    tcp_options = liveness.for_address(free).socket_options()
    async with AsyncExitStack() as stack:
        context = await stack.enter_async_context(open_context())
        sockets = await bind_client_sockets(stack, context, engine_count, free, tcp_options)
        coordinator = await stack.enter_async_context(
            _embedded_coordinator(engine_count, free, allow_remote, liveness, wave_coordination)
        )
        state = HandshakeState(
            range(engine_count), handshake_metadata(sockets, coordinator, parallel_config)
        )
        async with open_socket(
            context, zmq.ROUTER, bind=handshake_address, options=tcp_options
        ) as handshake:
            await wait_for_engines(state, handshake, sockets.input, client_index, startup_timeout)
        client = EngineClient(
            coordinator,
            engine_count,
            dict(state.ready_responses),
            Outbox(sockets.input),
            client_index,
            silence_timeout,
            chooser,
        )
        async with run_client_tasks(client, sockets):
            yield client


def _embedded_coordinator(
    engine_count: int, free: str, allow_remote: bool, liveness: Liveness, waves: bool
) -> AbstractAsyncContextManager[Coordinator]:
    """The client's own coordinator: its two engine sockets on free ports of ``free``'s
    host; no READY timeout of its own (the handshake's ``startup_timeout`` rules)."""
    return open_coordinator(
        engine_count,
        back_publish_address=free,
        back_output_address=free,
        ready_timeout=None,
        allow_remote=allow_remote,
        liveness=liveness,
        wave_coordination=waves,
    )
