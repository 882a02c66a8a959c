"""Sans-IO pieces of the trio engine-core client: handshake state and request table.

These are plain objects in the style of the core: they take decoded messages and
return what must go out or who must be told. The trio client (``_engine_client.py``)
only moves bytes between sockets and these objects.

The shapes follow vLLM's ``vllm/v1/engine/utils.py`` (the front-end side of
``wait_for_engine_startup``: an engine's HELLO is answered only in state NEW, its READY
accepted only after that, anything else refused) and ``vllm/v1/engine/core_client.py``
(``MPClient``), as read in the CPU build, 0.32.0, and in 0.33.0 (docs/protocol.md §14):

- an engine's identity on the handshake and input ROUTER sockets is its DP rank as
  two little-endian bytes (``rank.to_bytes(2, "little")``);
- an engine says ``{"status": "HELLO", ...}`` first and is answered with the
  handshake metadata (the addresses it must use); it then says
  ``{"status": "READY", ...}``;
- utility calls carry a call id that the engine echoes in its output's
  ``utility_output``;
- every engine also sends its ``EngineCoreReadyResponse`` (a map) first thing on each
  request-input socket it connects, which the front-end reads before it sends anything;
- with DP > 1 the READY carries ``parallel_config_hash``, which must be the same on
  every rank (vLLM compares it with its own config's; a client without a vLLM config
  compares the ranks with one another).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..protocol import EngineHandshakeError, rank_of_identity


class HandshakeState:
    """Which engines said HELLO and READY, and what each HELLO must be answered with.

    ``metadata`` is the handshake answer (vLLM's ``EngineHandshakeMetadata`` as a
    mapping): the same for every engine, as in vLLM, or a function of the engine index (the trio
    client gives each engine its own output address, so that a connection lost names
    the engine). :meth:`receive_ready_response` takes the ``EngineCoreReadyResponse`` an
    engine sends on the request-input socket; :attr:`done` needs both.
    """

    def __init__(
        self,
        engine_indexes: Iterable[int],
        metadata: Mapping[str, Any] | Callable[[int], Mapping[str, Any]],
    ) -> None:
        self.expected: frozenset[int] = frozenset(engine_indexes)
        if not self.expected:
            raise ValueError("at least one engine is expected")
        self._metadata = metadata
        self.hello: set[int] = set()
        self.ready: dict[int, Mapping[str, Any]] = {}
        self.ready_responses: dict[int, Mapping[str, Any]] = {}
        self._config_hash: tuple[int, object] | None = None

    def metadata_for(self, engine_index: int) -> Mapping[str, Any]:
        """The handshake answer for ``engine_index``."""
        return self._metadata(engine_index) if callable(self._metadata) else self._metadata

    def receive_ready_response(self, identity: bytes, response: object) -> None:
        """An engine's ``EngineCoreReadyResponse`` from the request-input socket."""
        engine_index = rank_of_identity(identity)
        if engine_index not in self.expected:
            raise EngineHandshakeError(f"rank {engine_index} is not one of {sorted(self.expected)}")
        if not isinstance(response, Mapping):
            raise EngineHandshakeError(
                f"rank {engine_index}'s ready response must be a map, got {type(response).__name__}"
            )
        if engine_index in self.ready_responses:
            raise EngineHandshakeError(f"rank {engine_index} sent its ready response twice")
        self.ready_responses[engine_index] = dict(response)

    def receive(self, identity: bytes, message: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Take one handshake message; return the answer to send back, if any.

        A HELLO is answered with the metadata; a READY is recorded and answered with
        nothing. Anything else (unknown engine, READY before HELLO, a second HELLO or
        READY, an unknown status) raises :class:`EngineHandshakeError`.
        """
        engine_index = rank_of_identity(identity)
        if engine_index not in self.expected:
            raise EngineHandshakeError(f"rank {engine_index} is not one of {sorted(self.expected)}")
        status = message.get("status")
        if status == "HELLO":
            if engine_index in self.hello:
                raise EngineHandshakeError(f"rank {engine_index} said HELLO twice")
            self.hello.add(engine_index)
            return self.metadata_for(engine_index)
        if status == "READY":
            if engine_index not in self.hello:
                raise EngineHandshakeError(f"rank {engine_index} said READY before HELLO")
            if engine_index in self.ready:
                raise EngineHandshakeError(f"rank {engine_index} said READY twice")
            if "parallel_config_hash" in message:
                config_hash = message["parallel_config_hash"]
                if self._config_hash is None:
                    self._config_hash = (engine_index, config_hash)
                elif self._config_hash[1] != config_hash:
                    first_index, first_hash = self._config_hash
                    raise EngineHandshakeError(
                        f"rank {engine_index}'s parallel config hash {config_hash!r} differs from "
                        f"rank {first_index}'s {first_hash!r}: every DP rank must be started "
                        "with the same arguments"
                    )
            self.ready[engine_index] = dict(message)
            return None
        raise EngineHandshakeError(f"rank {engine_index} sent unknown handshake status {status!r}")

    @property
    def done(self) -> bool:
        """Every expected engine said READY and sent its ready response."""
        return len(self.ready) == len(self.ready_responses) == len(self.expected)

    def missing(self) -> list[int]:
        """The engines that have not said READY, in order (for a timeout's message)."""
        return sorted(self.expected - self.ready.keys())

    def describe_missing(self) -> str:
        """Who is missing what, for a start-up timeout's message."""
        no_hello = sorted(self.expected - self.hello)
        no_ready = sorted(self.hello - self.ready.keys())
        no_response = sorted(self.ready.keys() - self.ready_responses.keys())
        parts = []
        if no_hello:
            parts.append(f"never said HELLO: ranks {no_hello}")
        if no_ready:
            parts.append(f"said HELLO but not READY: ranks {no_ready}")
        if no_response:
            parts.append(f"no ready response on the input socket: ranks {no_response}")
        return "; ".join(parts) or "none missing"


class RequestState(enum.Enum):
    """Where a request is in its life on the client."""

    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class RequestTable:
    """Request id → engine index, and utility call id → engine index, for routing and failure.

    The table decides nothing about sockets: it says which engine a request lives on,
    which requests an engine's death fails, and whether an output belongs to a live
    request (outputs for finished or unknown requests are dropped by the caller).
    """

    _requests: dict[str, int] = field(default_factory=dict)
    _per_engine: dict[int, int] = field(default_factory=dict)
    """Live requests per engine (engines with none left out)."""
    _calls: dict[int, int] = field(default_factory=dict)
    _next_call_id: int = 0
    dead: set[int] = field(default_factory=set)
    """Engines taken as dead (:meth:`mark_dead`): nothing more is sent to them."""

    def add(self, request_id: str, engine_index: int) -> None:
        """Record a new request sent to ``engine_index``; ids must be unique while live."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self._requests[request_id] = engine_index
        self._per_engine[engine_index] = self._per_engine.get(engine_index, 0) + 1

    def engine_index_of(self, request_id: str) -> int | None:
        """The engine a live request is on, or None if it is not live."""
        return self._requests.get(request_id)

    def finish(self, request_id: str, state: RequestState = RequestState.FINISHED) -> bool:
        """End a live request; True if it was live (so its channel must be closed)."""
        if state is RequestState.RUNNING:
            raise ValueError("finish needs a final state")
        engine_index = self._requests.pop(request_id, None)
        if engine_index is None:
            return False
        self._forget(engine_index, 1)
        return True

    def _forget(self, engine_index: int, count: int) -> None:
        left = self._per_engine[engine_index] - count
        if left:
            self._per_engine[engine_index] = left
        else:
            del self._per_engine[engine_index]

    def in_flight(self, engine_index: int | None = None) -> list[str]:
        """Live request ids, on ``engine_index`` only if given, in the order they were added."""
        return [
            rid for rid, r in self._requests.items() if engine_index is None or r == engine_index
        ]

    def busy_engines(self) -> set[int]:
        """Engines with live requests."""
        return set(self._per_engine)

    def is_busy(self, engine_index: int) -> bool:
        """Whether ``engine_index`` has live requests (in constant time: asked per request)."""
        return engine_index in self._per_engine

    def new_call(self, engine_index: int) -> int:
        """A fresh utility call id for a call sent to ``engine_index``."""
        call_id = self._next_call_id
        self._next_call_id += 1
        self._calls[call_id] = engine_index
        return call_id

    def complete_call(self, call_id: int) -> bool:
        """A call's result arrived; True if the call was pending."""
        return self._calls.pop(call_id, None) is not None

    def pending_calls(self, engine_index: int | None = None) -> list[int]:
        """Pending utility call ids, on ``engine_index`` only if given."""
        return [c for c, r in self._calls.items() if engine_index is None or r == engine_index]

    def fail_engine(self, engine_index: int) -> tuple[list[str], list[int]]:
        """An engine died: remove and return its live requests and pending calls."""
        requests = self.in_flight(engine_index)
        for rid in requests:
            del self._requests[rid]
        if requests:
            self._forget(engine_index, len(requests))
        calls = self.pending_calls(engine_index)
        for c in calls:
            del self._calls[c]
        return requests, calls

    def mark_dead(self, engine_index: int) -> tuple[list[str], list[int]]:
        """An engine died or went silent: remember it and fail what it held."""
        self.dead.add(engine_index)
        return self.fail_engine(engine_index)


# --- the wire: what the client sends and reads (vLLM's msgspec encoding) ---------------


class SilenceWatch:
    """Which engines have been silent too long while work waits on them (sans-IO).

    An engine that is alive but stuck (a lock-step peer died under a collective, a hung
    kernel) keeps its connections and answers ZMTP heartbeats, so only its silence
    shows: an engine with requests or calls in flight that sent nothing for ``timeout``
    seconds is overdue. An engine with nothing in flight is never overdue (an idle engine
    says nothing), and its clock starts again when work is sent to it.
    """

    def __init__(self, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.timeout = timeout
        self._heard: dict[int, float] = {}

    def heard(self, engine_index: int, now: float) -> None:
        """Something arrived from ``engine_index``."""
        self._heard[engine_index] = now

    def sent(self, engine_index: int, now: float, idle_before: bool) -> None:
        """Work was sent to ``engine_index``; if it had nothing in flight, its clock starts now."""
        if idle_before or engine_index not in self._heard:
            self._heard[engine_index] = now

    def overdue(self, now: float, busy: Iterable[int]) -> list[int]:
        """The busy engines silent for longer than the timeout."""
        return sorted(r for r in busy if now - self._heard.get(r, now) > self.timeout)

    def next_check(self, now: float, busy: Iterable[int]) -> float:
        """When the next busy engine could become overdue (``inf`` when none is busy)."""
        deadlines = [self._heard.get(r, now) + self.timeout for r in busy]
        return min(deadlines, default=float("inf"))
