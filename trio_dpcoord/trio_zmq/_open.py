"""Opening the shim's sockets: the context, :class:`AsyncSocket` made from options and
endpoints, and a CURVE client's options (``_socket.py`` is the socket itself)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import zmq

from ._socket import AsyncSocket

__all__ = ["curve_client_options", "open_context", "open_socket"]

logger = logging.getLogger(__name__)


@asynccontextmanager
async def open_context() -> AsyncIterator[zmq.Context[zmq.Socket[bytes]]]:
    """A fresh ``zmq.Context`` (LINGER 0 by default for its sockets), terminated on exit.

    Sockets should be closed first by their own managers; any still open are closed with
    LINGER 0 (and logged) so that terminating the context can never hang.
    """
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    try:
        yield context
    finally:
        leftover = [s for s in list(getattr(context, "_sockets", None) or ()) if not s.closed]
        if leftover:
            logger.warning("zmq context exiting with %d socket(s) still open", len(leftover))
        context.destroy(linger=0)


@asynccontextmanager
async def open_socket(
    context: zmq.Context[zmq.Socket[bytes]],
    socket_type: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    options: Mapping[int, int | bytes] | None = None,
    exclusive: bool = False,
) -> AsyncIterator[AsyncSocket]:
    """Create a socket, apply ``options``, then bind and/or connect; ``aclose()`` it on exit.

    After ``bind``, the resolved endpoint (e.g. the real TCP port for ``tcp://host:0``) is
    available as ``sock.last_endpoint``. ``exclusive``: see :class:`AsyncSocket`.
    """
    raw: zmq.Socket[bytes] = context.socket(socket_type)
    try:
        raw.setsockopt(zmq.LINGER, 0)
        for option, value in (options or {}).items():
            raw.setsockopt(option, value)
        sock = AsyncSocket(raw, exclusive=exclusive)
        if bind is not None:
            sock.bind(bind)
        if connect is not None:
            sock.connect(connect)
    except BaseException:
        raw.close(linger=0)
        raise
    try:
        yield sock
    finally:
        await sock.aclose()


def curve_client_options(server_key: bytes | None) -> dict[int, int | bytes]:
    """Socket options that make a socket a CURVE client of ``server_key``, with a fresh
    key pair; no options when ``server_key`` is None."""
    if server_key is None:
        return {}
    public, secret = zmq.curve_keypair()
    return {
        zmq.CURVE_SERVERKEY: server_key,
        zmq.CURVE_PUBLICKEY: public,
        zmq.CURVE_SECRETKEY: secret,
    }
