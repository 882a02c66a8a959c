"""The API servers of one ``vllm serve`` tell each other their routes (approximate feed).

With ``--api-server-count N`` each API server process keeps its own prefix index, fed by
its own choices; the kernel spreads connections over the servers, so a conversation's
turns reach different ones, and a server that did not route the earlier turns does not
know where their history is cached (on a real serve, two servers' hit rate fell from
72.7 % to 64-65 %; ``benchmarks/README.md``). So each server publishes every prompt it
routes, as its block keys and the engine index (:func:`~trio_dpcoord.protocol.encode_peer_route`,
about 8 bytes a block), and stores the others' in its own index as if it had routed them
(:meth:`~trio_dpcoord.routing.PrefixRouter.receive_routed`): every server then keeps the
index one server would. A lost or late announcement only costs a hint, as a lost KV
event does.

Where: one ``ipc://`` endpoint a server in the system's temporary directory, named from
vLLM's ``stats_update_address`` (the coordinator's publish address, the same in every
API server of a deployment and different between deployments) and the server's
``client_index``. Each server binds its own (PUB) and connects a SUB to every other's.
``TRIO_DPCOORD_VLLM_ROUTING_PEERS=0`` turns it off (the servers then fall back to the
rendezvous of :data:`~trio_dpcoord.vllm._routing.MULTI_SERVER_SLACK`).

Sockets: the PUB is written only by the choice itself (vLLM calls it in its asyncio loop),
never blocking (a full queue drops the announcement, counted); the SUB is read by one
asyncio task in the same loop, as :class:`~trio_dpcoord.vllm._routing._KVEventFollower`
reads the engines' events, so the router is never touched from two threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from .._reject_log import RejectLog
from ..protocol import ProtocolError, decode_peer_route, encode_peer_route
from ..routing import PrefixRouter
from ._loop import Tally, asyncio_context, cancel_from_any_thread

__all__ = ["PEERS_VARIABLE", "PeerRoutes", "bind_publisher", "peer_endpoints", "peers_wanted"]

logger = logging.getLogger(__name__)

PEERS_VARIABLE = "TRIO_DPCOORD_VLLM_ROUTING_PEERS"
"""``0`` turns the shared routes off; anything else (or unset) leaves them on."""


def peers_wanted() -> bool:
    """False only when :data:`PEERS_VARIABLE` is ``0``."""
    return os.environ.get(PEERS_VARIABLE, "").strip() != "0"


def peer_endpoints(stats_address: str, client_count: int) -> list[str]:
    """The ``ipc://`` endpoint of each API server (by ``client_index``) of the deployment
    whose coordinator publishes at ``stats_address``."""
    digest = hashlib.sha256(stats_address.encode()).hexdigest()[:16]
    base = os.path.join(tempfile.gettempdir(), f"trio-dpcoord-routes-{digest}")
    return [f"ipc://{base}-{index}" for index in range(client_count)]


def bind_publisher(context: Any, endpoint: str) -> Any:
    """This server's PUB, bound at ``endpoint`` on a plain view of vLLM's ``context`` (it is
    written by the choice itself, never awaited); a stale file of a dead server is
    replaced. ``zmq.ZMQError`` where the endpoint cannot be bound."""
    import zmq

    sync_context: zmq.Context[Any] = zmq.Context.shadow(context.underlying)
    publisher = sync_context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    try:
        publisher.bind(endpoint)
    except BaseException:
        publisher.close(linger=0)
        raise
    return publisher


class PeerRoutes:
    """This API server's side of the shared routes (see the module docstring).

    ``publish`` is called after each choice with what the router took
    (:meth:`~trio_dpcoord.routing.PrefixRouter.take_routed`); the reading task is started
    on the first choice made in vLLM's loop and stopped by the client's ``shutdown()``.
    Counters: ``sent``, ``dropped`` (the PUB's queue was full), ``received`` (applied),
    ``rejected`` (not a peer route, another block size, or an engine out of range: logged
    at WARNING, rate-limited). ``publisher``: this server's PUB from
    :func:`bind_publisher`, or None to bind it here.
    """

    def __init__(
        self,
        router: PrefixRouter,
        context: Any,
        endpoints: Sequence[str],
        index: int,
        publisher: Any = None,
    ) -> None:
        self._router = router
        self._context = context
        self._index = index
        self._own = endpoints[index]
        self._others = [e for i, e in enumerate(endpoints) if i != index]
        if publisher is None:
            publisher = bind_publisher(context, self._own)
        self._publisher: Any = publisher
        self._task: asyncio.Task[None] | None = None
        self._received = Tally()
        self._heard: set[int] = set()
        self.sent = self.dropped = self.rejected = 0
        self._reject = RejectLog(logger)

    @property
    def received(self) -> int:
        """Routes from the other servers applied so far."""
        return self._received.value

    async def wait_received(self, count: int) -> None:
        """Return once ``count`` routes from the others were applied (for tests)."""
        await self._received.reached(count)

    def publish(self, routed: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Tell the other servers: each (engine index, block keys), never blocking."""
        import zmq

        publisher = self._publisher
        if publisher is None:
            return
        block_size = self._router.block_size
        for rank, keys in routed:
            try:
                publisher.send(encode_peer_route(self._index, block_size, rank, keys), zmq.NOBLOCK)
            except zmq.Again:
                self.dropped += 1
            except zmq.ZMQError as exc:  # vLLM terminated the context at shutdown
                logger.debug("shared routes: not sent (%s)", exc)
                self.dropped += 1
            else:
                self.sent += 1

    def ensure_started(self) -> None:
        if self._task is not None or self._publisher is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not in vLLM's loop (yet): the next choice made there starts it
        self._task = loop.create_task(self._follow())
        logger.info(
            "sharing routes with %d other API server(s): publishing at %s",
            len(self._others),
            self._own,
        )

    def receive(self, frame: bytes) -> bool:
        """Apply one frame from another server; False (logged, counted) if refused."""
        try:
            route = decode_peer_route(frame)
        except ProtocolError as exc:
            self.rejected += 1
            self._reject("shared routes: frame", f"refused: {exc}")
            return False
        router = self._router
        if route.block_size != router.block_size or not router.receive_routed(
            route.engine_index, route.keys, time.monotonic()
        ):
            self.rejected += 1
            self._reject(
                "shared routes: route",
                f"API server {route.sender}'s route to engine {route.engine_index} (block size "
                f"{route.block_size}) refused: this server has {router.engine_count} engines, "
                f"block size {router.block_size}, {router.feed} feed",
            )
            return False
        self._received.add()
        if route.sender not in self._heard:  # the sockets work: say so once a sender
            self._heard.add(route.sender)
            logger.info(
                "shared routes: API server %d's routes arriving at API server %d",
                route.sender,
                self._index,
            )
        return True

    async def _follow(self) -> None:
        import zmq

        subscriber = asyncio_context(self._context).socket(zmq.SUB)
        try:
            subscriber.setsockopt(zmq.SUBSCRIBE, b"")
            for endpoint in self._others:
                subscriber.connect(endpoint)
            while True:
                frames = await subscriber.recv_multipart()
                if len(frames) != 1:
                    self.rejected += 1
                    detail = f"{len(frames)} parts, expected 1; ignored"
                    self._reject("shared routes: frame", detail)
                    continue
                self.receive(frames[0])
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:  # vLLM terminated the context at shutdown
            logger.debug("shared routes: %s; no longer following", exc)
        finally:
            with contextlib.suppress(Exception):
                subscriber.close(linger=0)

    def stop(self) -> None:
        """Stop reading and close the PUB (from vLLM's loop or another thread)."""
        task, self._task = self._task, None
        publisher, self._publisher = self._publisher, None
        if task is not None:
            cancel_from_any_thread(task)
        if publisher is not None:
            with contextlib.suppress(Exception):
                publisher.close(linger=0)
            with contextlib.suppress(OSError):
                os.unlink(self._own.removeprefix("ipc://"))
        logger.info(
            "shared routes: %d sent, %d dropped, %d received, %d refused",
            self.sent,
            self.dropped,
            self.received,
            self.rejected,
        )
