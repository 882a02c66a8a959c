"""The coordinator's sockets: how each is opened, monitored and bound (``open_coordinator``).

Three sockets by their key (vLLM's names, used in counters and the handle's addresses):
``back_publish`` (XPUB, READY and START_DP_WAVE to engines), ``back_output`` (PULL, the
engines' reports) and, standalone, ``front`` (XPUB, publishes to front-ends and their
commands). Each gets a peer monitor before its bind, so that no connection goes unseen.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Final

import zmq

from .._errors import CoordinatorError
from ..trio_zmq import AsyncSocket, open_context, open_socket
from .endpoints import Liveness, PrivateIpcDirectory, bind_socket
from .monitor import PeerMonitor, open_peer_monitor

__all__ = ["Bound", "curve_server", "open_bound_sockets", "requested_sockets"]

_XPUB_OPTIONS: Final[dict[int, int | bytes]] = {
    # Verbose: every engine's subscription reaches the gate (vLLM's setting); verboser:
    # every unsubscription too, so a vanished peer shows.
    zmq.XPUB_VERBOSE: 1,
    zmq.XPUB_VERBOSER: 1,
    zmq.LINGER: 0,
}


@dataclass(frozen=True, slots=True)
class _SocketSpec:
    """How one of the coordinator's sockets is opened, and what the logs call it."""

    socket_type: int
    options: dict[int, int | bytes]
    exclusive: bool
    """One task alone receives on it (see :class:`~trio_dpcoord.trio_zmq.AsyncSocket`)."""
    ipc_name: str
    """Its file in the private ``ipc://`` directory."""
    role: str
    """What it carries, for the logs and bind errors."""


_SOCKETS: Final[dict[str, _SocketSpec]] = {
    # by key: vLLM's name for the socket, used in counters and the handle's addresses
    "back_publish": _SocketSpec(zmq.XPUB, _XPUB_OPTIONS, False, "back-publish", "engine broadcast"),
    "back_output": _SocketSpec(
        zmq.PULL, {zmq.RCVHWM: 0, zmq.LINGER: 0}, True, "back-output", "engine output"
    ),
    "front": _SocketSpec(zmq.XPUB, _XPUB_OPTIONS, False, "front", "front"),
}


def curve_server(curve_secret_key: bytes | None) -> tuple[bytes | None, dict[int, int | bytes]]:
    """The public key and socket options of a CURVE server, or no security at all."""
    if curve_secret_key is None:
        return None, {}
    if not zmq.has("curve"):
        raise CoordinatorError("this libzmq was built without CURVE support")
    try:
        public_key = zmq.curve_public(curve_secret_key)
    except (zmq.ZMQError, ValueError, TypeError) as exc:
        raise CoordinatorError(f"bad CURVE secret key: {exc}") from exc
    return public_key, {zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: curve_secret_key}


@dataclass(frozen=True, slots=True)
class Bound:
    """The coordinator's sockets, bound, with the addresses peers connect to."""

    back_publish: AsyncSocket
    back_output: AsyncSocket
    front: AsyncSocket | None
    addresses: dict[str, str | None]


def requested_sockets(
    back_publish_address: str | None, back_output_address: str | None, front_address: str | None
) -> dict[str, str | None]:
    """Each socket's bind address by its key: the engine sockets always (None becomes
    ``""``, a private ``ipc://`` path), the front socket only when asked for."""
    return {
        "back_publish": back_publish_address or "",
        "back_output": back_output_address or "",
        "front": front_address,
    }


@asynccontextmanager
async def open_bound_sockets(
    monitors: list[PeerMonitor],
    requested: dict[str, str | None],
    curve_options: dict[int, int | bytes],
    liveness: Liveness,
    allow_remote: bool,
) -> AsyncIterator[Bound]:
    """The sockets bound for the block; the private ``ipc://`` directory goes once every
    socket is closed."""
    async with AsyncExitStack() as sockets:
        private_dir = PrivateIpcDirectory()
        sockets.callback(private_dir.cleanup)
        yield await _bind_sockets(
            sockets, monitors, requested, private_dir, curve_options, liveness, allow_remote
        )


async def _bind_sockets(
    sockets: AsyncExitStack,
    monitors: list[PeerMonitor],
    requested: dict[str, str | None],
    private_dir: PrivateIpcDirectory,
    curve_options: dict[int, int | bytes],
    liveness: Liveness,
    allow_remote: bool,
) -> Bound:
    """Open, monitor and bind each socket ``requested`` names (None: not wanted, ``""``:
    a private ``ipc://`` path); each monitor is entered before its bind, so that no
    connection goes unseen. Heartbeats where they help (``Liveness.for_address``)."""
    context = await sockets.enter_async_context(open_context())
    bound: dict[str, AsyncSocket] = {}
    addresses: dict[str, str | None] = dict.fromkeys(requested)
    for key, address in requested.items():
        if address is None:
            continue
        spec = _SOCKETS[key]
        address = address or private_dir.address(spec.ipc_name)
        socket_liveness = liveness.for_address(address)
        options = {**spec.options, **curve_options, **socket_liveness.socket_options()}
        socket = await sockets.enter_async_context(
            open_socket(context, spec.socket_type, options=options, exclusive=spec.exclusive)
        )
        monitor = await sockets.enter_async_context(
            open_peer_monitor(context, socket, key, spec.role, socket_liveness)
        )
        monitors.append(monitor)
        monitor.address = bind_socket(socket, address, allow_remote=allow_remote, what=spec.role)
        bound[key], addresses[key] = socket, monitor.address
    return Bound(bound["back_publish"], bound["back_output"], bound.get("front"), addresses)
