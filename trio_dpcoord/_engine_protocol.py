"""Sans-IO pieces of the trio engine-core client: handshake state and request table.

These are plain objects in the style of the core: they take decoded messages and
return what must go out or who must be told. The trio client (not written yet)
only moves bytes between sockets and these objects.

The shapes follow vLLM's ``vllm/v1/engine/utils.py`` (the front-end side of
``wait_for_engine_startup``: an engine's HELLO is answered only in state NEW, its READY
accepted only after that, anything else refused) and ``vllm/v1/engine/core_client.py``
(``MPClient``), as read in the CPU build, 0.32.0; 0.33.0 is still to be compared:

- an engine's identity on the handshake and input ROUTER sockets is its DP rank as
  two little-endian bytes (``rank.to_bytes(2, "little")``);
- an engine says ``{"status": "HELLO", ...}`` first and is answered with the
  handshake metadata (the addresses it must use); it then says
  ``{"status": "READY", ...}``;
- utility calls carry a call id that the engine echoes in its output's
  ``utility_output``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EngineHandshakeError",
    "HandshakeState",
    "RequestState",
    "RequestTable",
    "engine_identity",
    "rank_of_identity",
]


class EngineHandshakeError(ValueError):
    """An engine's handshake message is not one the protocol allows now."""


def engine_identity(rank: int) -> bytes:
    """The ZMQ identity vLLM gives DP rank ``rank``: two little-endian bytes."""
    return rank.to_bytes(2, "little")


def rank_of_identity(identity: bytes) -> int:
    """The DP rank an engine's two-byte identity names."""
    if len(identity) != 2:
        raise EngineHandshakeError(f"engine identity must be 2 bytes, got {identity!r}")
    return int.from_bytes(identity, "little")


class HandshakeState:
    """Which ranks said HELLO and READY, and what each HELLO must be answered with.

    ``metadata`` is the handshake answer (vLLM's ``EngineHandshakeMetadata`` as a
    mapping); it is the same for every rank, as in vLLM.
    """

    def __init__(self, ranks: Iterable[int], metadata: Mapping[str, Any]) -> None:
        self.expected: frozenset[int] = frozenset(ranks)
        if not self.expected:
            raise ValueError("at least one engine rank is expected")
        self.metadata: Mapping[str, Any] = metadata
        self.hello: set[int] = set()
        self.ready: dict[int, Mapping[str, Any]] = {}

    def receive(self, identity: bytes, message: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Take one handshake message; return the answer to send back, if any.

        A HELLO is answered with the metadata; a READY is recorded and answered with
        nothing. Anything else (unknown rank, READY before HELLO, a second HELLO or
        READY, an unknown status) raises :class:`EngineHandshakeError`.
        """
        rank = rank_of_identity(identity)
        if rank not in self.expected:
            raise EngineHandshakeError(f"rank {rank} is not one of {sorted(self.expected)}")
        status = message.get("status")
        if status == "HELLO":
            if rank in self.hello:
                raise EngineHandshakeError(f"rank {rank} said HELLO twice")
            self.hello.add(rank)
            return self.metadata
        if status == "READY":
            if rank not in self.hello:
                raise EngineHandshakeError(f"rank {rank} said READY before HELLO")
            if rank in self.ready:
                raise EngineHandshakeError(f"rank {rank} said READY twice")
            self.ready[rank] = dict(message)
            return None
        raise EngineHandshakeError(f"rank {rank} sent unknown handshake status {status!r}")

    @property
    def done(self) -> bool:
        """Every expected rank said READY."""
        return len(self.ready) == len(self.expected)

    def missing(self) -> list[int]:
        """The ranks that have not said READY, in order (for a timeout's message)."""
        return sorted(self.expected - self.ready.keys())


class RequestState(enum.Enum):
    """Where a request is in its life on the client."""

    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class RequestTable:
    """Request id → rank, and utility call id → rank, for routing and failure.

    The table decides nothing about sockets: it says which rank a request lives on,
    which requests an engine's death fails, and whether an output belongs to a live
    request (outputs for finished or unknown requests are dropped by the caller).
    """

    _requests: dict[str, int] = field(default_factory=dict)
    _calls: dict[int, int] = field(default_factory=dict)
    _next_call_id: int = 0

    def add(self, request_id: str, rank: int) -> None:
        """Record a new request sent to ``rank``; ids must be unique while live."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self._requests[request_id] = rank

    def rank_of(self, request_id: str) -> int | None:
        """The rank a live request is on, or None if it is not live."""
        return self._requests.get(request_id)

    def finish(self, request_id: str, state: RequestState = RequestState.FINISHED) -> bool:
        """End a live request; True if it was live (so its channel must be closed)."""
        if state is RequestState.RUNNING:
            raise ValueError("finish needs a final state")
        return self._requests.pop(request_id, None) is not None

    def in_flight(self, rank: int | None = None) -> list[str]:
        """Live request ids, on ``rank`` only if given, in the order they were added."""
        return [rid for rid, r in self._requests.items() if rank is None or r == rank]

    def new_call(self, rank: int) -> int:
        """A fresh utility call id for a call sent to ``rank``."""
        call_id = self._next_call_id
        self._next_call_id += 1
        self._calls[call_id] = rank
        return call_id

    def complete_call(self, call_id: int) -> bool:
        """A call's result arrived; True if the call was pending."""
        return self._calls.pop(call_id, None) is not None

    def pending_calls(self, rank: int | None = None) -> list[int]:
        """Pending utility call ids, on ``rank`` only if given."""
        return [c for c, r in self._calls.items() if rank is None or r == rank]

    def fail_rank(self, rank: int) -> tuple[list[str], list[int]]:
        """An engine died: remove and return its live requests and pending calls."""
        requests = self.in_flight(rank)
        for rid in requests:
            del self._requests[rid]
        calls = self.pending_calls(rank)
        for c in calls:
            del self._calls[c]
        return requests, calls
