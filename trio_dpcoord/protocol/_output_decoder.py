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
  ``wave_complete``, a ``start_wave``) through the views of :mod:`._msgspec_views`
  (narrow, known, open; no ``utility_output``, ``finished_requests`` or ``outputs``),
  several times faster than msgpack-python on vLLM's 496-byte stats report. Their types
  are *stricter* than the full decoder's, never looser, and msgspec skips nothing it could
  not vouch for. Whatever they refuse (bad input, or a rare but valid shape such as a
  request batch) goes to the msgpack path, which gives the verdict; so msgspec only ever
  says yes where the full decoder says yes, with the same fields.
* :func:`decode_with_msgpack`: msgpack-python, then the common shapes checked field by
  field without building objects; anything else through the full decoder.

The coordinator's ingest loop reads stats reports through :data:`decode_ingest_stats`
first: the same paths, stopped at the common stats shape, returning the six fields as one
flat tuple (no named tuples per message); any other frame goes through
:func:`decode_coordinator_output`.
"""

import math
import struct
from collections.abc import Callable
from operator import itemgetter
from typing import Annotated, Any, Final

from msgpack import Unpacker as _Unpacker
from msgpack import unpackb as _unpackb

from .._compiled import accelerate
from ._codec import MAX_DATA_FRAME_BYTES, ProtocolError, unpack
from ._msgspec_views import fits_view, load_msgspec, outputs_views, view_readers
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
    "IngestStats",
    "decode_coordinator_output",
    "decode_ingest_stats",
    "decode_with_msgpack",
    "decode_with_msgspec",
    "ingest_with_layouts",
    "ingest_with_msgpack",
    "ingest_with_msgspec",
]

Decoded = tuple[OutputKind, int, StatsReport | int | None]
"""``(kind, engine_index, value)``: ``value`` is the :class:`StatsReport` of a STATS
message, the wave of a WAVE_COMPLETE or START_WAVE one, None for any other kind."""

IngestStats = tuple[int, int, int, float, int, int]
"""``(engine_index, waiting, running, kv_cache_usage, wave, step)`` of a stats-only
message (:data:`decode_ingest_stats`)."""

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
    if _common_shape(obj):
        stats, wc, sw = obj[2], obj[6], obj[7]
        if wc is None and sw is None:
            if stats is not None:
                return _STATS, obj[0], stats_report(stats)
        elif stats is None and (wc is None or sw is None):
            wave = sw if wc is None else wc
            if type(wave) is int and wave >= 0:
                return (_START_WAVE if wc is None else _WAVE_COMPLETE), obj[0], wave
    return _classified(engine_core_outputs_from_object(obj))


def _common_shape(obj: Any) -> bool:
    """A full 9-slot array with no outputs, utility reply, finished requests or weight
    version, a float timestamp and an engine index: what engines send a coordinator."""
    return (
        type(obj) is list
        and len(obj) == 9
        and obj[1] == []
        and obj[4] is None
        and obj[5] is None
        and obj[8] is None
        and type(obj[3]) is float
        and type(obj[0]) is int
        and obj[0] >= 0
    )


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


_new_tuple: Final = tuple.__new__


_Paths = tuple[Callable[[bytes], Decoded], Callable[[bytes], "IngestStats | None"]]


def _build_msgspec_decoders() -> _Paths | None:
    """The msgspec paths (the contract's decoder and the ingest one), or None when msgspec
    is not installed. The views and their order: :mod:`._msgspec_views`."""
    msgspec = load_msgspec()
    if msgspec is None:
        return None
    from msgspec import Meta

    empty = Annotated[list[Any], Meta(max_length=0)]
    narrow, refused, read = view_readers(msgspec, outputs_views(empty, None, None))
    isfinite = math.isfinite
    report_of = stats_report  # a local name, looked up faster in the closure

    def decode_with_msgspec(frame: bytes) -> Decoded:
        if fits_view(frame) and (view := read(frame)) is not None:
            stats, wc, sw = view.scheduler_stats, view.wave_complete, view.start_wave
            if wc is None and sw is None:
                if type(stats) is dict:  # the open view: the full checks
                    try:
                        return _STATS, view.engine_index, report_of(stats)
                    except ProtocolError:
                        return decode_with_msgpack(frame)
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

    def ingest_with_msgspec(frame: bytes) -> IngestStats | None:
        # fits_view(frame), inline: this runs once per engine report
        if (
            type(frame) is bytes
            and 0 < len(frame) <= MAX_DATA_FRAME_BYTES
            and 0x90 <= frame[0] <= 0x99
        ):
            try:
                view = narrow(frame)
            except refused:
                return None
            stats = view.scheduler_stats
            if stats is not None and view.wave_complete is None and view.start_wave is None:
                kv = stats.kv_cache_usage
                if isfinite(kv):
                    return (
                        view.engine_index,
                        stats.num_waiting_reqs,
                        stats.num_running_reqs,
                        kv,
                        stats.current_wave,
                        stats.step_counter,
                    )
        return None

    return decode_with_msgspec, ingest_with_msgspec


def ingest_with_msgpack(frame: bytes) -> IngestStats | None:
    """:data:`decode_ingest_stats`'s msgpack path: :func:`decode_with_msgpack`'s checks of
    the common stats shape, inline (a third of this path's own time was calls), and
    None for anything else, which that function then judges."""
    if type(frame) is not bytes or not 0 < len(frame) <= MAX_DATA_FRAME_BYTES:
        return None
    try:
        obj = _unpackb(frame)  # raw=False, strict_map_key=True: msgpack's defaults, as unpack's
    except Exception:  # whatever msgpack-python refuses: decode_with_msgpack says why
        return None
    if type(obj) is not list or len(obj) != 9:
        return None
    engine, outputs, stats, timestamp, utility, finished, wc, sw, weights = obj
    if (
        type(stats) is not dict
        or type(engine) is not int
        or engine < 0
        or outputs != []
        or type(timestamp) is not float
        or utility is not None
        or finished is not None
        or wc is not None
        or sw is not None
        or weights is not None
    ):
        return None
    get = stats.get
    running = get("num_running_reqs", 0)
    waiting = get("num_waiting_reqs", 0)
    step = get("step_counter", 0)
    wave = get("current_wave", 0)
    kv = get("kv_cache_usage", 0.0)
    if (
        type(running) is int
        and type(waiting) is int
        and type(step) is int
        and type(wave) is int
        and running >= 0
        and waiting >= 0
        and step >= 0
        and wave >= 0
        and type(kv) is float
        and kv - kv == 0.0  # finite
    ):
        return engine, waiting, running, kv, wave, step
    return None


# ------------------------------------------------------------------ the layouts path
# An engine's stats reports differ from one another in a few bytes: the values of the
# engine index, the four counts, the KV usage and the timestamp; the rest (18 keys, the
# nested maps, the tags and widths of those values) repeats byte for byte. A *layout* is
# one report's bytes with those values cut out: a frame equal to it everywhere else is
# the same msgpack document with other values in the same encodings, so it decodes to
# what the layout's frame decoded to, with its own values (each checked as the msgpack
# path checks it). One struct call reads a frame against a layout.


class _Layout:
    """A stats report's bytes with its values' bytes cut out. ``unpack`` reads a frame of
    ``length`` bytes as the layout's constant pieces and its values; the frame fits when
    ``pick_pieces`` of that are ``pieces``, and ``pick`` gives its record (engine index,
    waiting, running, KV usage, wave, step). A fixint is read as a signed byte: a byte
    that is no longer a fixint reads negative, refused as the negative counts are."""

    __slots__ = ("length", "pick", "pick_pieces", "pieces", "unpack")

    def __init__(self, frame: bytes, fields: list[tuple[int, int, str]]) -> None:
        """``fields``: ``(start, end, struct code)`` of each value in the record's order,
        then the timestamp's (code ``"x"``: any bytes, never read)."""
        fmt, at, item = [">"], 0, 0
        pieces: list[tuple[int, bytes]] = []
        items: dict[int, int] = {}
        for start, end, code, role in sorted((*f, role) for role, f in enumerate(fields)):
            if start > at:
                fmt.append(f"{start - at}s")
                pieces.append((item, frame[at:start]))
                item += 1
            if code == "x":
                fmt.append(f"{end - start}x")
            else:
                fmt.append(code)
                items[role] = item
                item += 1
            at = end
        if at < len(frame):
            fmt.append(f"{len(frame) - at}s")
            pieces.append((item, frame[at:]))
        self.length = len(frame)
        self.unpack = struct.Struct("".join(fmt)).unpack
        self.pick = itemgetter(*(items[role] for role in range(6)))
        self.pick_pieces = itemgetter(*(index for index, _ in pieces))
        self.pieces = tuple(piece for _, piece in pieces)


_INT_CODES: Final = {0xCC: "B", 0xCD: "H", 0xCE: "I", 0xCF: "Q"}
_RECORD_KEYS: Final = (
    "num_waiting_reqs",
    "num_running_reqs",
    "kv_cache_usage",
    "current_wave",
    "step_counter",
)
"""The stats keys of a record, in its order (after the engine index)."""

MAX_LAYOUTS: Final = 64
"""Layouts kept (a fleet's reports take a few: the counts' widths change as they grow);
past it no new one is learnt, and other reports take the msgpack path."""


def _learn_layout(frame: bytes) -> _Layout | None:
    """The layout of a frame the msgpack path read as a stats report, or None where one of
    its values is not in a plain encoding (a signed int width) or a read key is left out
    or repeated."""
    unpacker = _Unpacker(raw=False)
    unpacker.feed(frame)
    spans: dict[str, tuple[int, int, str]] = {}

    def value_span(name: str, is_float: bool) -> None:
        start = unpacker.tell()
        unpacker.skip()
        end, tag = unpacker.tell(), frame[start]
        if is_float and tag in (0xCA, 0xCB):
            spans[name] = (start + 1, end, "f" if tag == 0xCA else "d")
        elif not is_float and tag < 0x80:
            spans[name] = (start, end, "b")
        elif not is_float and tag in _INT_CODES:
            spans[name] = (start + 1, end, _INT_CODES[tag])

    try:
        unpacker.read_array_header()
        value_span("engine", False)
        unpacker.skip()  # outputs: []
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in _RECORD_KEYS:
                if key in spans:
                    return None
                value_span(key, key == "kv_cache_usage")
            else:
                unpacker.skip()
        value_span("timestamp", True)
    except Exception:  # the msgpack path read it; never here
        return None
    if len(spans) != 7:
        return None
    ts_start, ts_end, _ = spans["timestamp"]
    fields = [spans[key] for key in ("engine", *_RECORD_KEYS)]
    return _Layout(frame, [*fields, (ts_start, ts_end, "x")])


_layouts: dict[int, list[_Layout]] = {}
"""Frame length -> the layouts learnt of that length (newest first)."""
_layout_count = 0


def ingest_with_layouts(frame: bytes) -> IngestStats | None:
    """:data:`decode_ingest_stats`'s pure-Python path without msgspec: a frame that fits
    a layout learnt from an earlier report is read by one struct call; any other frame
    takes :func:`ingest_with_msgpack`, and a report that it reads gives its layout for
    the next ones. The same answer as :func:`ingest_with_msgpack`, for every frame."""
    global _layout_count
    fitted = False
    if type(frame) is bytes:
        for layout in _layouts.get(len(frame), ()):
            values = layout.unpack(frame)
            if layout.pick_pieces(values) == layout.pieces:
                record: IngestStats = layout.pick(values)
                if min(record) >= 0 and record[3] - record[3] == 0.0:
                    return record
                fitted = True  # odd values (a byte no longer a fixint, a negative KV
                break  # usage): the msgpack path says what the frame is
    judged = ingest_with_msgpack(frame)
    if judged is not None and not fitted and _layout_count < MAX_LAYOUTS:
        learnt = _learn_layout(frame)
        if learnt is not None:
            _layouts.setdefault(len(frame), []).insert(0, learnt)
            _layout_count += 1
    return judged


_msgspec_decoders: Final = _build_msgspec_decoders()
_msgspec_decoder: Final = None if _msgspec_decoders is None else _msgspec_decoders[0]


def decode_with_msgspec(frame: bytes) -> Decoded:
    """Decode and classify one frame with msgspec (the ``fast`` extra); the msgpack path
    judges whatever msgspec refuses. RuntimeError if msgspec is not installed."""
    if _msgspec_decoder is None:
        raise RuntimeError("msgspec is not installed (pip install 'trio-dpcoord[fast]')")
    return _msgspec_decoder(frame)


def ingest_with_msgspec(frame: bytes) -> IngestStats | None:
    """:data:`decode_ingest_stats`'s msgspec path. RuntimeError if msgspec is not
    installed."""
    if _msgspec_decoders is None:
        raise RuntimeError("msgspec is not installed (pip install 'trio-dpcoord[fast]')")
    return _msgspec_decoders[1](frame)


DECODER: Final[str] = "msgpack" if _msgspec_decoder is None else "msgspec"
"""Which path :func:`decode_coordinator_output` takes in this process."""

decode_coordinator_output: Final[Callable[[bytes], Decoded]] = (
    decode_with_msgpack if _msgspec_decoder is None else _msgspec_decoder
)
"""Decode and classify one frame of the coordinator's engine-output socket: the msgspec
path when msgspec is installed, else the msgpack path; ProtocolError for bad input."""

decode_ingest_stats: Final[Callable[[bytes], IngestStats | None]] = (
    ingest_with_layouts if _msgspec_decoders is None else _msgspec_decoders[1]
)
"""The coordinator's hot path: a stats-only message's fields as one flat tuple,
:data:`IngestStats`, when :func:`decode_coordinator_output` would return
``(STATS, engine_index, StatsReport(EngineLoad(waiting, running, kv), wave, step))`` for
the frame and the frame is in the shape engines send (the narrow view, or the msgpack
path's field-by-field check); None for every other frame, valid or not, which
:func:`decode_coordinator_output` then judges. Never raises. No named tuples are built
(the load table builds an :class:`EngineLoad` only for each engine's newest report)."""

accelerate(globals(), "trio_dpcoord.protocol._output_decoder_kernel")  # the compiled twin, if built
