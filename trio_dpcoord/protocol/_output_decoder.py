"""The coordinator's decoder of engine outputs: only what it reads, as fast as it can be.

A coordinator reads little of an ``EngineCoreOutputs`` frame (§4.5): the engine index, the
counts, KV usage, wave and step of ``scheduler_stats``, ``wave_complete`` and
``start_wave``. :func:`decode_coordinator_output` returns just that, as
``(kind, engine_index, value)``; it accepts and rejects exactly the frames that
:func:`~._outputs.decode_engine_core_outputs` followed by :func:`classify_output`
accept and reject, with the same :class:`ProtocolError` messages (so bad input is
logged and counted as before), and returns what they would say (tested on the fuzz corpus,
the vLLM vectors and generated frames).

Two paths, one contract:

* :func:`decode_with_msgspec`, chosen when msgspec (the ``fast`` extra) is installed: a
  typed msgspec decode of the shapes engines send the coordinator (a stats report, a
  ``wave_complete``, a ``start_wave``), about 3x faster than msgpack-python on vLLM's
  496-byte stats report. Its types are *stricter* than the full decoder's, never looser:
  every map key a string, every string valid UTF-8, no ext or bin values in the stats
  map, at most three nested containers in a stats value, at most nine slots, no
  ``utility_output``, ``finished_requests`` or ``outputs``. msgspec skips nothing it could
  not vouch for (the one thing it would skip, array slots past the ninth, is ruled out by
  the frame's first byte). Whatever it refuses (bad input, or a rare but valid shape such
  as a request batch) goes to the msgpack path, which gives the verdict; so msgspec
  only ever says yes where the full decoder says yes, with the same fields.
* :func:`decode_with_msgpack`: msgpack-python, then the common shapes checked field by
  field without building objects; anything else through the full decoder.
"""

import functools
import math
from collections.abc import Callable
from typing import Annotated, Any, Final

from ._codec import MAX_DATA_FRAME_BYTES, ProtocolError, unpack
from ._outputs import (
    EngineCoreOutputs,
    EngineLoad,
    OutputKind,
    StatsReport,
    classify_output,
    engine_core_outputs_from_object,
    stats_report,
)

__all__ = [
    "DECODER",
    "Decoded",
    "decode_coordinator_output",
    "decode_with_msgpack",
    "decode_with_msgspec",
]

Decoded = tuple[OutputKind, int, StatsReport | int | None]
"""``(kind, engine_index, value)``: ``value`` is the :class:`StatsReport` of a STATS
message, the wave of a WAVE_COMPLETE or START_WAVE one, None for any other kind."""

_STATS: Final = OutputKind.STATS
_WAVE_COMPLETE: Final = OutputKind.WAVE_COMPLETE
_START_WAVE: Final = OutputKind.START_WAVE


def decode_with_msgpack(frame: bytes) -> Decoded:
    """Decode and classify one frame of the coordinator's output socket with msgpack-python.

    The shapes engines send the coordinator (a full 9-slot array with no outputs, utility
    reply or finished requests) are checked field by field without building objects;
    anything else takes the full decoder, so both accept and reject the same frames.
    """
    obj = unpack(frame, "EngineCoreOutputs", MAX_DATA_FRAME_BYTES)
    if (
        type(obj) is list
        and len(obj) == 9
        and obj[1] == []
        and obj[4] is None
        and obj[5] is None
        and obj[8] is None
        and type(obj[3]) is float
        and type(obj[0]) is int
        and obj[0] >= 0
    ):
        stats, wc, sw = obj[2], obj[6], obj[7]
        if wc is None and sw is None:
            if stats is not None:
                return _STATS, obj[0], stats_report(stats)
        elif stats is None and (wc is None or sw is None):
            wave = sw if wc is None else wc
            if type(wave) is int and wave >= 0:
                return (_START_WAVE if wc is None else _WAVE_COMPLETE), obj[0], wave
    return _classified(engine_core_outputs_from_object(obj))


def _classified(out: EngineCoreOutputs) -> Decoded:
    """What the coordinator reads of a fully decoded message."""
    kind = classify_output(out)
    if kind is _STATS:
        st = out.scheduler_stats
        assert st is not None
        report = StatsReport(
            EngineLoad(
                waiting=st.num_waiting_reqs,
                running=st.num_running_reqs,
                kv_cache_usage=st.kv_cache_usage,
            ),
            wave=st.current_wave,
            step=st.step_counter,
        )
        return kind, out.engine_index, report
    if kind is _WAVE_COMPLETE:
        return kind, out.engine_index, out.wave_complete
    if kind is _START_WAVE:
        return kind, out.engine_index, out.start_wave
    return kind, out.engine_index, None


#: The ``SchedulerStats`` keys of vLLM 0.32.0 and 0.33.0 that a coordinator does not read.
_UNREAD_STATS_KEYS: Final = (
    "num_skipped_waiting_reqs",
    "num_kv_fetch_reqs_by_stage",
    "iteration_details",
    "prefix_cache_stats",
    "connector_prefix_cache_stats",
    "kv_cache_eviction_events",
    "spec_decoding_stats",
    "kv_connector_stats",
    "ec_connector_stats",
    "waiting_lora_adapters",
    "running_lora_adapters",
    "cudagraph_stats",
    "perf_stats",
)

_new_tuple: Final = tuple.__new__


@functools.cache
def msgspec_stats_types() -> "tuple[Any, type[Any], Any]":
    """msgspec's types for what engines send, shared by this decoder and the engine
    client's (:mod:`._client_decoder`): ``(level3, known_stats, open_stats)``.

    ``level3``: any value a stats map may carry that msgpack-python reads the same way
    and the full decoder accepts: scalars, and lists and string-keyed maps of them, three
    levels deep (vLLM's deepest, ``prefix_cache_stats.hits_by_source``, is two). Anything
    else (bin, ext, non-string keys, deeper nesting) is refused, and judged by the
    msgpack path. ``known_stats``: vLLM's stats map, the five fields read checked as the
    full decoder checks them (ints >= 0, no bools; a float or an int for the usage,
    finiteness checked by the caller), an unknown key (a newer vLLM) refused;
    ``open_stats``: any string-keyed stats map, its fields checked in Python."""
    from msgspec import Meta, defstruct

    uint = Annotated[int, Meta(ge=0)]
    scalar = None | bool | int | float | str
    level1 = scalar | list[scalar] | dict[str, scalar]
    level2 = scalar | list[level1] | dict[str, level1]
    level3 = scalar | list[level2] | dict[str, level2]
    known_stats = defstruct(
        "_KnownStats",
        [
            ("num_running_reqs", uint, 0),
            ("num_waiting_reqs", uint, 0),
            ("step_counter", uint, 0),
            ("current_wave", uint, 0),
            ("kv_cache_usage", float, 0.0),
            *((key, level3, None) for key in _UNREAD_STATS_KEYS),
        ],
        forbid_unknown_fields=True,
    )
    return level3, known_stats, dict[str, level3]


def _msgspec_view_types() -> "tuple[type[Any], type[Any]]":
    """msgspec's views of EngineCoreOutputs: the strict one (vLLM's known stats keys,
    checked as the full decoder checks them) and the open one (any string-keyed stats
    map, checked in Python)."""
    from msgspec import Meta, Struct

    uint = Annotated[int, Meta(ge=0)]
    _, known_stats, open_stats = msgspec_stats_types()

    # (this module does not postpone annotations: msgspec evaluates these at class creation,
    # where the local aliases above are in scope)
    class _View(Struct, array_like=True):
        """EngineCoreOutputs as engines send it to a coordinator (§4.5)."""

        engine_index: uint = 0
        outputs: Annotated[list[Any], Meta(max_length=0)] = []
        scheduler_stats: known_stats | None = None  # type: ignore[valid-type]
        timestamp: float = 0.0
        utility_output: None = None
        finished_requests: None = None
        wave_complete: uint | None = None
        start_wave: uint | None = None
        weight_version: str | None = None

    class _OpenView(_View, array_like=True):
        """The same with any string-keyed stats map, its fields checked in Python."""

        scheduler_stats: open_stats | None = None  # type: ignore[valid-type]

    return _View, _OpenView


def _build_msgspec_decoder() -> "Callable[[bytes], Decoded] | None":
    """The msgspec path, or None when msgspec is not installed."""
    try:
        import msgspec
    except ImportError:
        return None
    view_type, open_view_type = _msgspec_view_types()
    decode_view = msgspec.msgpack.Decoder(view_type).decode
    decode_open_view = msgspec.msgpack.Decoder(open_view_type).decode
    isfinite = math.isfinite
    report_of = stats_report  # a local name, looked up faster in the closure
    refused = msgspec.DecodeError  # ValidationError is one

    def decode_with_msgspec(frame: bytes) -> Decoded:
        # 0x90-0x99: a fixarray of at most 9 elements (msgspec would skip a 10th unread)
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
            stats, wc, sw = view.scheduler_stats, view.wave_complete, view.start_wave
            if wc is None and sw is None:
                if stats is not None and isfinite(stats.kv_cache_usage):
                    load = _new_tuple(
                        EngineLoad,
                        (stats.num_waiting_reqs, stats.num_running_reqs, stats.kv_cache_usage),
                    )
                    report = _new_tuple(StatsReport, (load, stats.current_wave, stats.step_counter))
                    return _STATS, view.engine_index, report
            elif stats is None:
                if wc is None:
                    return _START_WAVE, view.engine_index, sw
                if sw is None:
                    return _WAVE_COMPLETE, view.engine_index, wc
        return decode_with_msgpack(frame)

    def decode_open(frame: bytes) -> Decoded:
        try:
            view = decode_open_view(frame)
            stats = view.scheduler_stats
            if stats is not None and view.wave_complete is None and view.start_wave is None:
                return _STATS, view.engine_index, report_of(stats)  # the full checks
        except (refused, ProtocolError):
            pass
        return decode_with_msgpack(frame)

    return decode_with_msgspec


_msgspec_decoder: Final = _build_msgspec_decoder()


def decode_with_msgspec(frame: bytes) -> Decoded:
    """Decode and classify one frame with msgspec (the ``fast`` extra); the msgpack path
    judges whatever msgspec refuses. RuntimeError if msgspec is not installed."""
    if _msgspec_decoder is None:
        raise RuntimeError("msgspec is not installed (pip install 'trio-dpcoord[fast]')")
    return _msgspec_decoder(frame)


DECODER: Final[str] = "msgpack" if _msgspec_decoder is None else "msgspec"
"""Which path :func:`decode_coordinator_output` takes in this process."""

decode_coordinator_output: Final[Callable[[bytes], Decoded]] = (
    decode_with_msgpack if _msgspec_decoder is None else _msgspec_decoder
)
"""Decode and classify one frame of the coordinator's engine-output socket: the msgspec
path when msgspec is installed, else the msgpack path; ProtocolError for bad input."""
