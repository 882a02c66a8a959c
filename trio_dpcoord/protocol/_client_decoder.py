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
from typing import Annotated, Final, Protocol

from ._codec import MAX_DATA_FRAME_BYTES, ProtocolError, unpack
from ._engine_core import ENGINE_CORE_DEAD, EngineDead
from ._msgspec_views import fits_view, load_msgspec, outputs_views, stats_types, view_readers
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


def _build_msgspec_decoder() -> "Callable[[bytes], ClientOutput] | None":
    """The msgspec path, or None when msgspec is not installed. The views and their
    order: :mod:`._msgspec_views`; the outputs decoded straight into a small struct."""
    msgspec = load_msgspec()
    if msgspec is None:
        return None
    from msgspec import Meta, defstruct

    uint = Annotated[int, Meta(ge=0)]
    level3 = stats_types().level3
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
    views = outputs_views(list[output], list[level3] | None, list[str] | None)  # type: ignore[valid-type]
    read = view_readers(msgspec, views).read
    isfinite = math.isfinite

    def decode_with_msgspec(frame: bytes) -> ClientOutput:
        if fits_view(frame) and (view := read(frame)) is not None:
            stats = view.scheduler_stats
            if stats is None or (type(stats) is not dict and isfinite(stats.kv_cache_usage)):
                return view.outputs, view.utility_output
            if type(stats) is dict:  # the open view: the full checks
                try:
                    _decode_stats(stats)
                except ProtocolError:
                    return decode_with_msgpack(frame)
                return view.outputs, view.utility_output
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
