"""A small trio shim over pyzmq: every pyzmq call of the package goes through it.

:func:`open_context` and :func:`open_socket` (``_open.py``) give :class:`AsyncSocket`, a
zmq socket whose sends and receives are trio checkpoints (``_socket.py`` says how it
waits on libzmq's edge-triggered FD, shared by several tasks; its compiled twin
``_socket_kernel.pyx``, where built, takes a batch of queued messages, reads EVENTS
and sends through libzmq itself);
:func:`open_monitor` runs libzmq's socket monitor for a block (``_monitor.py``);
:func:`curve_client_options` makes a socket a CURVE client.
"""

from __future__ import annotations

from ._monitor import MonitorEvent, accepted_peer_address, open_monitor, parse_monitor_event
from ._open import curve_client_options, open_context, open_socket
from ._socket import AsyncSocket

__all__ = [
    "AsyncSocket",
    "MonitorEvent",
    "accepted_peer_address",
    "curve_client_options",
    "open_context",
    "open_monitor",
    "open_socket",
    "parse_monitor_event",
]
