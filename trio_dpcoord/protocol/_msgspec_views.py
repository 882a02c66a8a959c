"""msgspec's typed views of ``EngineCoreOutputs``, shared by the two fast decoders.

The coordinator's decoder (:mod:`._output_decoder`) and the engine client's
(:mod:`._client_decoder`) read the same frames (§4.5) with msgspec when it is installed
(the ``fast`` extra) and with msgpack-python otherwise. Their msgspec paths share one rule:
a view's types are *stricter* than the full decoder (:func:`~._outputs.
decode_engine_core_outputs`), never looser, and whatever a view refuses goes to the next
view, and finally to the decoder's msgpack path, which gives the verdict. So msgspec only
ever says yes where the full decoder says yes, with the same fields. This module holds
what they share: importing msgspec or not, the types of a stats map and of any value
msgpack-python reads the same way, the nine-slot views, and their readers.

**The views of a frame, tried in turn** (:func:`view_readers`):

1. *narrow*: vLLM's stats map in the shape engines send it, the values a decoder does not
   read typed as they come (``prefix_cache_stats`` a struct of counts, the per-stage and
   LoRA maps of string to count, the rest as in 2). The cheapest: fewer Python objects
   to build (and to free). Refused: the next view.
2. *known*: vLLM's stats keys, each unread value any :data:`level3` value. Refused for an
   unknown key (a newer vLLM): the next view; otherwise the msgpack path.
3. *open*: any string-keyed stats map, its read fields checked in Python by the caller.

A view never skips anything unread: msgspec would skip an unknown key's value or an array
slot past the ninth without checking it (msgpack-python checks every string's UTF-8 and
every map key), so the stats structs forbid unknown keys and the caller only hands a view
a frame that is a fixarray of at most nine slots (:func:`fits_view`).

No struct here is tracked by the garbage collector (``gc=False``): their fields are
decoded values (scalars, strings, lists and maps of them), which cannot refer back to a
struct, so no cycle can go through one; tracking them cost the coordinator's decoder a
third of its time in collections of the young generation.
"""

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Annotated, Any, Final, NamedTuple

from ._codec import MAX_DATA_FRAME_BYTES
from ._outputs import _PREFIX_COUNT_KEYS

__all__ = [
    "UNREAD_STATS_KEYS",
    "StatsTypes",
    "ViewReaders",
    "fits_view",
    "load_msgspec",
    "outputs_views",
    "stats_types",
    "view_readers",
]

#: The ``SchedulerStats`` keys of vLLM 0.32.0 and 0.33.0 that neither decoder reads.
UNREAD_STATS_KEYS: Final = (
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


def load_msgspec() -> ModuleType | None:
    """msgspec, or None when it is not installed (the decoders then take their msgpack
    path; ``sys.modules["msgspec"] = None`` makes it so in a process, as on a machine
    without the ``fast`` extra)."""
    try:
        import msgspec
    except ImportError:
        return None
    return msgspec


def fits_view(frame: object) -> bool:
    """Whether a view may read ``frame``: bytes within the data-frame limit that begin
    with a fixarray of at most nine slots (0x90-0x99; msgspec would skip a tenth slot
    unread, where the full decoder finds the array malformed)."""
    return (
        type(frame) is bytes and 0 < len(frame) <= MAX_DATA_FRAME_BYTES and 0x90 <= frame[0] <= 0x99
    )


class StatsTypes(NamedTuple):
    """msgspec's types for what engines send (see :func:`stats_types`)."""

    level3: Any
    """Any value a stats map may carry that msgpack-python reads the same way and the
    full decoder accepts: scalars, and lists and string-keyed maps of them, three levels
    deep (vLLM's deepest, ``prefix_cache_stats.hits_by_source``, is two)."""
    narrow: type[Any]
    """vLLM's stats map as engines send it (view 1)."""
    known: type[Any]
    """vLLM's stats map, every unread value a :attr:`level3` (view 2)."""
    open: Any
    """Any string-keyed stats map (view 3), its fields checked by the caller."""


@functools.cache
def stats_types() -> StatsTypes:
    """The stats maps' types. The five fields a coordinator reads are checked as the full
    decoder checks them (ints >= 0, no bools; a float or an int for the usage, its
    finiteness checked by the caller); an unknown key is refused."""
    from msgspec import Meta, defstruct

    uint = Annotated[int, Meta(ge=0)]
    scalar = None | bool | int | float | str
    level1 = scalar | list[scalar] | dict[str, scalar]
    level2 = scalar | list[level1] | dict[str, level1]
    level3 = scalar | list[level2] | dict[str, level2]
    read = [
        ("num_running_reqs", uint, 0),
        ("num_waiting_reqs", uint, 0),
        ("step_counter", uint, 0),
        ("current_wave", uint, 0),
        ("kv_cache_usage", float, 0.0),
    ]
    prefix = defstruct(
        "_PrefixCacheStats",
        [
            ("reset", bool, False),
            *((key, uint, 0) for key in _PREFIX_COUNT_KEYS),
            ("hits_by_source", dict[str, uint], {}),
        ],
        forbid_unknown_fields=True,
        gc=False,
    )
    narrow_unread: dict[str, Any] = {
        "num_skipped_waiting_reqs": uint | None,
        "num_kv_fetch_reqs_by_stage": dict[str, uint] | None,
        "prefix_cache_stats": prefix | None,
        "waiting_lora_adapters": dict[str, uint] | None,
        "running_lora_adapters": dict[str, uint] | None,
    }
    narrow = defstruct(
        "_NarrowStats",
        [*read, *((key, narrow_unread.get(key, level3), None) for key in UNREAD_STATS_KEYS)],
        forbid_unknown_fields=True,
        gc=False,
    )
    known = defstruct(
        "_KnownStats",
        [*read, *((key, level3, None) for key in UNREAD_STATS_KEYS)],
        forbid_unknown_fields=True,
        gc=False,
    )
    return StatsTypes(level3, narrow, known, dict[str, level3])


def outputs_views(
    outputs: Any, utility_output: Any, finished_requests: Any
) -> tuple[type[Any], type[Any], type[Any]]:
    """The narrow, known and open views of EngineCoreOutputs (vLLM's nine slots, an
    ``array_like`` struct on the wire as vLLM's own), with the given types for the slots
    that differ between the decoders."""
    from msgspec import Meta, defstruct

    uint = Annotated[int, Meta(ge=0)]
    types = stats_types()

    def view(name: str, stats: Any) -> type[Any]:
        return defstruct(
            name,
            [
                ("engine_index", uint, 0),
                ("outputs", outputs, []),
                ("scheduler_stats", stats | None, None),
                ("timestamp", float, 0.0),
                ("utility_output", utility_output, None),
                ("finished_requests", finished_requests, None),
                ("wave_complete", uint | None, None),
                ("start_wave", uint | None, None),
                ("weight_version", str | None, None),
            ],
            array_like=True,
            gc=False,
        )

    narrow, known = view("_NarrowView", types.narrow), view("_View", types.known)
    return narrow, known, view("_OpenView", types.open)


class ViewReaders(NamedTuple):
    """How a decoder reads a frame with its views (:func:`view_readers`)."""

    narrow: Callable[[bytes], Any]
    """The narrow view's decode, which raises :attr:`refused`: a hot path calls it
    directly."""
    refused: type[Exception]
    """What a view raises when it does not take a frame (msgspec's DecodeError)."""
    read: Callable[[bytes], Any]
    """The first view that takes the frame: narrow, known, else open (its stats a dict,
    to be checked by the caller); None when none does (the msgpack path judges it)."""


def view_readers(msgspec: ModuleType, views: tuple[type[Any], type[Any], type[Any]]) -> ViewReaders:
    """The readers of ``views`` (narrow, known, open). The caller checks
    :func:`fits_view` before either reader."""
    narrow, known, open_ = (msgspec.msgpack.Decoder(v).decode for v in views)
    refused = msgspec.DecodeError  # ValidationError is one

    def read(frame: bytes) -> Any:
        try:
            return narrow(frame)
        except refused:
            pass
        try:
            return known(frame)
        except refused as exc:
            if "unknown field" not in str(exc):  # not a newer vLLM's stats key
                return None
        try:
            return open_(frame)
        except refused:
            return None

    return ViewReaders(narrow, refused, read)
