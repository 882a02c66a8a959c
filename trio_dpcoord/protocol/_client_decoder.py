"""The engine client's decoder of engine outputs: what a front-end reads, as fast as it
can be read.

A front-end reads little of an ``EngineCoreOutputs`` frame (§4.5): per request output its
id, new token ids and finish reason, and a utility call's answer.
:func:`decode_client_output` returns just that, as ``(outputs, utility_output)``; it
accepts and rejects exactly the frames :func:`~._outputs.decode_engine_core_outputs`
accepts and rejects, with the same :class:`ProtocolError` messages, and returns what it
would say (tested on the fuzz corpus, the vLLM vectors and generated frames, as the
coordinator's decoder is). Each output has ``request_id``, ``new_token_ids`` (a tuple)
and ``finish_reason`` (vLLM's integer, or None) as attributes (:class:`RequestTokens`).

Two paths, one contract, as :mod:`._output_decoder`'s:

* :func:`decode_with_msgspec`, chosen when msgspec (the ``fast`` extra) is installed: a
  typed decode with the layout of vLLM's own msgspec structs (``EngineCoreOutputs`` and
  ``EngineCoreOutput`` are ``array_like`` structs on the wire), every output decoded in C
  straight into a small struct. Its types are *stricter* than the full decoder's, never
  looser: the slots the client does not read take only what msgpack-python reads the
  same way (scalars, and lists and string-keyed maps of them, three levels deep), the
  scheduler stats are checked as the coordinator's decoder checks them. Whatever it
  refuses (bad input, or a rare but valid shape: logprobs tensors, a deeper utility
  result) goes to the msgpack path, which gives the verdict.
* :func:`decode_with_msgpack`: msgpack-python, then the full decoder's checks.
"""

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Final, Protocol

from ._codec import MAX_DATA_FRAME_BYTES, ProtocolError, unpack
from ._engine_core import ENGINE_CORE_DEAD, EngineDead
from ._output_decoder import msgspec_stats_types
from ._outputs import _decode_stats, engine_core_outputs_from_object

__all__ = [
    "DECODER",
    "ClientOutput",
    "RequestTokens",
    "decode_client_frames",
    "decode_client_output",
    "decode_with_msgpack",
    "decode_with_msgspec",
]


class RequestTokens(Protocol):
    """One request's output in a step, as the client reads it."""

    @property
    def request_id(self) -> str: ...

    @property
    def new_token_ids(self) -> tuple[int, ...]: ...

    @property
    def finish_reason(self) -> int | None: ...


ClientOutput = tuple[Sequence[RequestTokens], object | None]
"""``(outputs, utility_output)``: the request outputs of one ``EngineCoreOutputs``
message, and its ``utility_output`` (the raw decoded array, or None)."""


def decode_with_msgpack(frame: bytes) -> ClientOutput:
    """Decode one frame of an engine's output socket with msgpack-python and the full
    decoder's checks."""
    out = engine_core_outputs_from_object(unpack(frame, "EngineCoreOutputs", MAX_DATA_FRAME_BYTES))
    return out.outputs, out.utility_output


#: vLLM 0.33.0's ``EngineCoreOutput`` slots after ``finish_reason`` (0.32.0 has a prefix
#: of them); the client reads none of them.
_UNREAD_OUTPUT_SLOTS: Final = (
    "stop_reason",
    "events",
    "kv_transfer_params",
    "ec_transfer_params",
    "trace_headers",
    "prefill_stats",
    "routed_experts",
    "num_nans_in_logits",
    "mm_cache_miss_hashes",
    "new_sampling_mask",
    "spec_decode_metrics",
    "prompt_token_id_logprobs",
    "error",
)


def _msgspec_view_types() -> "tuple[type[Any], type[Any]]":
    """msgspec's views of EngineCoreOutputs as engines send it to a front-end: with
    vLLM's known stats keys, and with any string-keyed stats map."""
    from msgspec import Meta, Struct, defstruct

    uint = Annotated[int, Meta(ge=0)]
    level3, known_stats, open_stats = msgspec_stats_types()
    output = defstruct(
        "_Output",
        [
            ("request_id", str),
            ("new_token_ids", tuple[uint, ...]),
            ("new_logprobs", level3, None),
            ("new_prompt_logprobs_tensors", level3, None),
            ("pooling_output", level3, None),
            ("finish_reason", uint | None, None),
            *((slot, level3, None) for slot in _UNREAD_OUTPUT_SLOTS),
        ],
        array_like=True,
        frozen=True,
        gc=False,  # strs, tuples of ints and scalars: no cycles to collect
    )

    # (this module does not postpone annotations: msgspec evaluates these at class creation,
    # where the local aliases above are in scope)
    class _View(Struct, array_like=True):
        """EngineCoreOutputs (§4.5), every slot checked as the full decoder checks it."""

        engine_index: uint = 0
        outputs: list[output] = []  # type: ignore[valid-type]
        scheduler_stats: known_stats | None = None  # type: ignore[valid-type]
        timestamp: float = 0.0
        utility_output: list[level3] | None = None  # type: ignore[valid-type]
        finished_requests: list[str] | None = None
        wave_complete: uint | None = None
        start_wave: uint | None = None
        weight_version: str | None = None

    class _OpenView(_View, array_like=True):
        """The same with any string-keyed stats map, its fields checked in Python."""

        scheduler_stats: open_stats | None = None  # type: ignore[valid-type]

    return _View, _OpenView


def _build_msgspec_decoder() -> "Callable[[bytes], ClientOutput] | None":
    """The msgspec path, or None when msgspec is not installed."""
    try:
        import msgspec
    except ImportError:
        return None
    view_type, open_view_type = _msgspec_view_types()
    decode_view = msgspec.msgpack.Decoder(view_type).decode
    decode_open_view = msgspec.msgpack.Decoder(open_view_type).decode
    isfinite = math.isfinite
    refused = msgspec.DecodeError  # ValidationError is one

    def decode_with_msgspec(frame: bytes) -> ClientOutput:
        # 0x90-0x99: a fixarray of at most 9 elements (msgspec would skip a 10th unread,
        # where the full decoder would find it malformed)
        if (
            type(frame) is bytes
            and 0 < len(frame) <= MAX_DATA_FRAME_BYTES
            and 0x90 <= frame[0] <= 0x99
        ):
            try:
                view = decode_view(frame)
            except refused as exc:
                if "unknown field" in str(exc):  # a stats key we do not know
                    return decode_open(frame)
                return decode_with_msgpack(frame)
            stats = view.scheduler_stats
            if stats is None or isfinite(stats.kv_cache_usage):
                return view.outputs, view.utility_output
        return decode_with_msgpack(frame)

    def decode_open(frame: bytes) -> ClientOutput:
        try:
            view = decode_open_view(frame)
            if view.scheduler_stats is not None:
                _decode_stats(view.scheduler_stats)  # the full checks
            return view.outputs, view.utility_output
        except (refused, ProtocolError):
            return decode_with_msgpack(frame)

    return decode_with_msgspec


_msgspec_decoder: Final = _build_msgspec_decoder()


def decode_with_msgspec(frame: bytes) -> ClientOutput:
    """Decode one frame with msgspec (the ``fast`` extra); the msgpack path judges
    whatever msgspec refuses. RuntimeError if msgspec is not installed."""
    if _msgspec_decoder is None:
        raise RuntimeError("msgspec is not installed (pip install 'trio-dpcoord[fast]')")
    return _msgspec_decoder(frame)


DECODER: Final[str] = "msgpack" if _msgspec_decoder is None else "msgspec"
"""Which path :func:`decode_client_output` takes in this process."""

decode_client_output: Final[Callable[[bytes], ClientOutput]] = (
    decode_with_msgpack if _msgspec_decoder is None else _msgspec_decoder
)
"""Decode one ``EngineCoreOutputs`` frame of an engine's output socket for a front-end:
the msgspec path when msgspec is installed, else the msgpack path; ProtocolError for
bad input."""


def decode_client_frames(frames: Sequence[bytes]) -> ClientOutput | EngineDead:
    """One message of an engine's output socket, as :func:`decode_engine_frames` reads
    it (the dead marker, or ``EngineCoreOutputs`` in the first frame; further frames
    carry tensors the client does not ask for), decoded by :func:`decode_client_output`."""
    if not frames:
        raise ProtocolError("empty message on the engine output socket")
    if len(frames) == 1 and frames[0] == ENGINE_CORE_DEAD:
        return EngineDead()
    return decode_client_output(frames[0])
