"""The simulated front-end's sockets (:mod:`.frontend`), as vLLM's DP client binds them.

The request ROUTER every engine's DEALER connects to (identity = rank; a restarted engine
reconnects with the same identity and takes its place), the completion PULL every engine
pushes its outputs and status events to, and, for the exact feed, a SUB to each engine's
KV-event publisher.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import zmq

from .. import PrivateIpcDirectory
from ..trio_zmq import AsyncSocket, open_context, open_socket

__all__ = ["FrontendSockets", "open_frontend_sockets"]


@dataclass(frozen=True, slots=True)
class FrontendSockets:
    """The front-end's bound sockets and where engines connect to them."""

    router: AsyncSocket
    completions: AsyncSocket
    request_address: str
    completion_address: str
    kv_event_addresses: list[str]
    """Per rank, where its engine binds its KV-event publisher (empty: no KV events)."""
    kv_events: list[AsyncSocket]
    """Per rank, the SUB connected to it."""


@asynccontextmanager
async def open_frontend_sockets(
    engine_count: int,
    request_address: str | None,
    completion_address: str | None,
    *,
    kv_events: bool,
) -> AsyncIterator[FrontendSockets]:
    """Bind the request ROUTER and the completion PULL (``ipc://`` paths in a private
    temporary directory, removed on exit, where an address is None) and, with
    ``kv_events``, connect a SUB to a private ``ipc://`` path per rank, for the duration
    of the block."""
    private = PrivateIpcDirectory()  # created only if an address is needed
    try:
        async with AsyncExitStack() as stack:
            context = await stack.enter_async_context(open_context())
            router = await stack.enter_async_context(
                open_socket(
                    context,
                    zmq.ROUTER,
                    options={
                        zmq.ROUTER_MANDATORY: 1,
                        # A restarted engine reconnects with the same identity.
                        zmq.ROUTER_HANDOVER: 1,
                        zmq.SNDHWM: 0,
                        zmq.RCVHWM: 0,
                    },
                )
            )
            pull = await stack.enter_async_context(
                open_socket(context, zmq.PULL, options={zmq.RCVHWM: 0})
            )
            bound_requests = router.bind(request_address or private.address("requests"))
            bound_completions = pull.bind(completion_address or private.address("completions"))
            kv_addresses = [
                private.address(f"kv-events-{rank}") for rank in range(engine_count) if kv_events
            ]
            subs = []
            for address in kv_addresses:
                sub = await stack.enter_async_context(
                    open_socket(context, zmq.SUB, connect=address, options={zmq.SUBSCRIBE: b""})
                )
                subs.append(sub)
            yield FrontendSockets(
                router, pull, bound_requests, bound_completions, kv_addresses, subs
            )
    finally:
        private.cleanup()
