"""Endpoint policy: private ``ipc://`` defaults, loopback-only TCP unless opted in, and
how fast a silent peer is noticed.

ZeroMQ traffic between the coordinator and vLLM engines is unauthenticated, so the
safe default is an ``ipc://`` socket in a directory only this user can enter, and a
TCP bind to anything but loopback needs an explicit ``allow_remote``.

Over a network a peer can go silent without closing anything (a partition, a node that
loses power): TCP notices nothing for many minutes. :class:`Liveness` holds the ZMTP
heartbeat and TCP keepalive settings that make ZeroMQ drop such a connection within a
few seconds.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq

from .._errors import CoordinatorError
from ..trio_zmq import AsyncSocket

__all__ = [
    "DEFAULT_LIVENESS",
    "Liveness",
    "PrivateIpcDirectory",
    "bind_socket",
    "check_bind_address",
]

logger = logging.getLogger(__name__)

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def _tcp_host(address: str) -> str:
    rest = address[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port:
        raise CoordinatorError(f"bad tcp address {address!r}: expected tcp://HOST:PORT")
    return host


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_address(address: str, *, allow_remote: bool) -> None:
    """Refuse what the coordinator must not bind, with a one-line reason.

    Accepts ``ipc://PATH``, ``inproc://NAME`` and ``tcp://HOST:PORT``; a non-loopback
    TCP host (including ``*`` and ``0.0.0.0``) requires ``allow_remote`` and then logs
    a warning that the traffic is unauthenticated.
    """
    if address.startswith(("ipc://", "inproc://")):
        if address.endswith("://"):
            raise CoordinatorError(f"bad address {address!r}: empty path")
        return
    if not address.startswith("tcp://"):
        raise CoordinatorError(
            f"bad address {address!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME"
        )
    host = _tcp_host(address)
    if _is_loopback(host):
        return
    if not allow_remote:
        raise CoordinatorError(
            f"refusing to bind {address!r}: not a loopback address; ZeroMQ traffic is "
            "unauthenticated, pass allow_remote=True (--allow-remote) to bind it anyway"
        )
    logger.warning(
        "binding %s beyond loopback: ZeroMQ traffic is unauthenticated and unencrypted, "
        "anyone who can reach it can drive the engines",
        address,
    )


class PrivateIpcDirectory:
    """A directory only this user may enter (mode 0700), for default ``ipc://`` paths.

    Created lazily on the first :meth:`address` call, removed with its socket files by
    :meth:`cleanup`.
    """

    def __init__(self) -> None:
        self._path: Path | None = None

    def address(self, name: str) -> str:
        if self._path is None:
            # mkdtemp creates the directory with mode 0700
            self._path = Path(tempfile.mkdtemp(prefix="trio-dpcoord-"))
            os.chmod(self._path, 0o700)
        return f"ipc://{self._path / name}"

    def cleanup(self) -> None:
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None


@dataclass(frozen=True, slots=True)
class Liveness:
    """How a socket notices a peer that went silent without closing its connection.

    ZMTP heartbeats (ZeroMQ >= 4.2, answered by libzmq itself whatever the peer's own
    settings, so harmless for vLLM's engines): a PING every ``heartbeat_interval``
    seconds; a connection that carries nothing, not even the PONG, for
    ``heartbeat_timeout`` seconds is dropped, and the PING asks the peer to drop it
    after the same time without news from us (``HEARTBEAT_TTL``), so both sides
    reconnect. A silent peer is dropped within about ``heartbeat_interval +
    heartbeat_timeout`` seconds (:attr:`notice_within`). ``heartbeat_interval=None``
    turns heartbeats off.

    TCP keepalive, the kernel's own probe of an idle connection, backs them up:
    probes after ``tcp_keepalive_idle`` idle seconds, every ``tcp_keepalive_interval``
    seconds, ``tcp_keepalive_count`` of them unanswered drop it;
    ``tcp_keepalive_idle=None`` leaves the system's setting (usually off).

    Heartbeats go only where they help, on ``tcp://`` connections, unless
    ``local_heartbeats``: over ``ipc://`` and ``inproc://`` the kernel (or libzmq) already
    reports a peer that died or closed, and no partition can happen, while 2,048 engines'
    PINGs cost libzmq's I/O thread about a third of a core. Without them a *frozen* local
    peer (SIGSTOP) stays connected. :meth:`for_address` applies the rule per socket.
    """

    heartbeat_interval: float | None = 1.0
    heartbeat_timeout: float = 3.0
    tcp_keepalive_idle: int | None = 10
    tcp_keepalive_interval: int = 2
    tcp_keepalive_count: int = 3
    local_heartbeats: bool = False

    def __post_init__(self) -> None:
        if self.heartbeat_interval is not None:
            if not 0.001 <= self.heartbeat_interval <= self.heartbeat_timeout:
                raise ValueError(
                    "heartbeat_interval must be at least 1 ms and at most heartbeat_timeout, "
                    f"got {self.heartbeat_interval!r} (timeout {self.heartbeat_timeout!r})"
                )
            if self.heartbeat_timeout > 6553.5:  # HEARTBEAT_TTL is 16 bits of 100 ms
                raise ValueError(f"heartbeat_timeout too large: {self.heartbeat_timeout!r}")
        if (
            self.tcp_keepalive_idle is not None
            and min(self.tcp_keepalive_idle, self.tcp_keepalive_interval, self.tcp_keepalive_count)
            < 1
        ):
            raise ValueError("TCP keepalive idle time, interval and count must be >= 1")

    @property
    def notice_within(self) -> float | None:
        """Seconds after which a silent peer is dropped at the latest, by heartbeats
        (None without them)."""
        if self.heartbeat_interval is None:
            return None
        return self.heartbeat_interval + self.heartbeat_timeout

    def for_address(self, address: str) -> Liveness:
        """The settings a socket bound or connected to ``address`` uses: without
        heartbeats on a local transport (``ipc://``, ``inproc://``) unless
        ``local_heartbeats``."""
        local = address.startswith(("ipc://", "inproc://"))
        if not local or self.local_heartbeats or self.heartbeat_interval is None:
            return self
        return dataclasses.replace(self, heartbeat_interval=None)

    def socket_options(self) -> dict[int, int]:
        """The ZeroMQ socket options that apply these settings."""
        options: dict[int, int] = {}
        if self.heartbeat_interval is not None:
            timeout_ms = round(self.heartbeat_timeout * 1000)
            options[zmq.HEARTBEAT_IVL] = round(self.heartbeat_interval * 1000)
            options[zmq.HEARTBEAT_TIMEOUT] = timeout_ms
            options[zmq.HEARTBEAT_TTL] = timeout_ms
        if self.tcp_keepalive_idle is not None:
            options[zmq.TCP_KEEPALIVE] = 1
            options[zmq.TCP_KEEPALIVE_IDLE] = self.tcp_keepalive_idle
            options[zmq.TCP_KEEPALIVE_INTVL] = self.tcp_keepalive_interval
            options[zmq.TCP_KEEPALIVE_CNT] = self.tcp_keepalive_count
        return options


DEFAULT_LIVENESS = Liveness()
"""What the coordinator's sockets and our own engines and front-ends use by default."""


def bind_socket(socket: AsyncSocket, address: str, *, allow_remote: bool, what: str) -> str:
    """Bind ``socket`` (the ``what`` socket, for the error) to ``address`` once
    :func:`check_bind_address` allows it, with IPv6 enabled for a bracketed host (as
    vLLM's ``make_zmq_socket`` does). Returns the address bound (a TCP port 0
    resolved); :class:`CoordinatorError` if ZeroMQ refuses it."""
    check_bind_address(address, allow_remote=allow_remote)
    try:
        if address.startswith("tcp://["):
            socket.setsockopt(zmq.IPV6, 1)
        return socket.bind(address)
    except zmq.ZMQError as exc:
        raise CoordinatorError(f"cannot bind the {what} socket to {address!r}: {exc}") from exc
