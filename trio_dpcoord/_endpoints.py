"""Endpoint policy: private ``ipc://`` defaults, loopback-only TCP unless opted in.

ZeroMQ traffic between the coordinator and vLLM engines is unauthenticated, so the
safe default is an ``ipc://`` socket in a directory only this user can enter, and a
TCP bind to anything but loopback needs an explicit ``allow_remote``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ._errors import CoordinatorError

__all__ = ["PrivateIpcDirectory", "check_bind_address"]

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
