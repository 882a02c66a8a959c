"""The sockets of one simulated DP rank, as a vLLM ``DPEngineCoreProc`` has them.

* XSUB to the coordinator's broadcast socket, identity = rank (2 bytes LE), watched by a
  connection monitor from before it connects (so the first handshake counts);
* PUSH to the coordinator's output socket (stats, ``start_wave``, ``wave_complete``);
* DEALER (identity = rank) to the front-end's request ROUTER;
* PUSH to the front-end's completion PULL;
* the step collective (:mod:`.collective`): a DEALER on every rank, and on rank 0 the
  ROUTER that hosts it;
* with ``kv_events_address``, the PUB on which the rank publishes vLLM's KV-cache events.

:func:`open_engine_sockets` opens them in that order, for the life of a block; what goes
over them is :class:`~.engine.SimEngine`'s business.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Final

import zmq

from .. import ConnectionMonitor, Liveness, open_connection_monitor
from ..protocol import engine_identity
from ..trio_zmq import AsyncSocket, curve_client_options, open_context, open_socket
from .engine_config import EngineConfig

__all__ = ["HEARTBEAT_OPTIONS", "EngineSockets", "open_engine_sockets"]

HEARTBEAT_OPTIONS: Final = Liveness().socket_options()
"""The coordinator's own heartbeat and keepalive options, on the engine's side."""

_KV_EVENTS_SNDHWM: Final = 100_000
"""vLLM's ``KVEventsConfig.hwm`` default: a PUB drops messages beyond it."""


@dataclass(frozen=True, slots=True)
class EngineSockets:
    """One rank's open sockets (see the module docstring)."""

    collective_host: AsyncSocket | None
    """Rank 0's collective ROUTER (None on the other ranks)."""
    collective: AsyncSocket
    broadcast: AsyncSocket
    monitor: ConnectionMonitor
    """Watches ``broadcast``: the link to the coordinator."""
    coordinator: AsyncSocket
    completions: AsyncSocket
    requests: AsyncSocket
    kv_events: AsyncSocket | None


@asynccontextmanager
async def open_engine_sockets(config: EngineConfig) -> AsyncIterator[EngineSockets]:
    """Every socket of rank ``config.rank`` (in a context of its own), closed on leaving."""
    async with AsyncExitStack() as stack:
        context = await stack.enter_async_context(open_context())

        async def socket(
            kind: int,
            options: Mapping[int, int | bytes],
            *,
            bind: str | None = None,
            connect: str | None = None,
        ) -> AsyncSocket:
            return await stack.enter_async_context(
                open_socket(context, kind, bind=bind, connect=connect, options=options)
            )

        identity = engine_identity(config.rank)
        host: AsyncSocket | None = None
        if config.rank == 0:
            host = await socket(
                zmq.ROUTER,
                bind=config.collective_address,
                # A restarted rank reconnects with the same identity: route to it.
                options={zmq.RCVHWM: 0, zmq.SNDHWM: 0, zmq.ROUTER_HANDOVER: 1},
            )
        collective = await socket(
            zmq.DEALER,
            connect=config.collective_address,
            options={zmq.IDENTITY: identity, zmq.RCVHWM: 0, zmq.SNDHWM: 0},
        )
        security = curve_client_options(config.curve_server_key)
        broadcast = await socket(
            zmq.XSUB, options={zmq.IDENTITY: identity, **HEARTBEAT_OPTIONS, **security}
        )
        monitor = await stack.enter_async_context(
            open_connection_monitor(context, broadcast, f"rank {config.rank} coordinator link")
        )
        broadcast.connect(config.back_publish_address)
        coordinator = await socket(
            zmq.PUSH,
            connect=config.back_output_address,
            options={zmq.SNDHWM: 0, **HEARTBEAT_OPTIONS, **security},
        )
        completions = await socket(
            zmq.PUSH, connect=config.completion_address, options={zmq.SNDHWM: 0}
        )
        requests = await socket(
            zmq.DEALER,
            connect=config.request_address,
            options={zmq.IDENTITY: identity, zmq.RCVHWM: 0, zmq.SNDHWM: 0},
        )
        kv_events = None
        if config.kv_events_address is not None:
            kv_events = await socket(
                zmq.PUB,
                bind=config.kv_events_address,
                options={zmq.SNDHWM: _KV_EVENTS_SNDHWM},
            )
        yield EngineSockets(
            host, collective, broadcast, monitor, coordinator, completions, requests, kv_events
        )
