"""What engines send the coordinator and front-ends: ``EngineCoreOutputs`` with their
scheduler stats, the loads read from them, and their classification (docs/protocol.md §4.5)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from ._codec import (
    MAX_DATA_FRAME_BYTES,
    ProtocolError,
    dec_finite_float,
    dec_float,
    dec_uint,
    dec_uint_tuple,
    enc_float,
    enc_opt_str,
    enc_opt_uint,
    enc_str,
    enc_uint,
    enc_uint_list,
    pack,
    type_name,
    unpack,
)


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """vLLM 0.33.0's ``PrefixCacheStats`` (``vllm/v1/metrics/stats.py``): the prefix-cache
    lookups since the engine's previous report (each report starts from zero, as vLLM's
    ``make_prefix_cache_stats`` resets them), counted in tokens.

    ``requests``: new requests looked up; ``queries``: their prompt tokens; ``hits``: the
    tokens found cached. ``preempted_*``: the same for re-scheduled preempted requests.
    ``reset``: the cache was reset before these. ``hits_by_source`` (connector tiers) is
    always written empty and not read.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


NO_PREFIX_CACHE_STATS: Final = PrefixCacheStats()
"""What an engine that looked nothing up reports (vLLM's defaults)."""

_PREFIX_COUNT_KEYS: Final = (
    "requests",
    "queries",
    "hits",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The ``SchedulerStats`` fields a DP coordinator reads (§4.6), and the prefix-cache
    counters a front-end reads.

    The encoder writes vLLM's full 18-key map (other keys at their defaults), so the
    bytes equal vLLM's; the decoder reads only these six keys.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = NO_PREFIX_CACHE_STATS


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """One per-request output (19-slot array); only the slots a simulation needs.

    ``finish_reason``: ``None`` while running, else 0 stop, 1 length, 2 abort, 3 error,
    4 repetition. Other slots are written at their defaults and ignored when decoding.
    """

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    finish_reason: int | None = None


@dataclass(frozen=True, slots=True)
class EngineCoreOutputs:
    """The 9-slot ``EngineCoreOutputs`` array (§4.5).

    ``utility_output`` is kept as the raw decoded msgpack value (an array) and not
    interpreted; ``timestamp`` is the sender's monotonic clock and meaningless elsewhere.
    """

    engine_index: int = 0
    outputs: tuple[EngineCoreOutput, ...] = ()
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: object | None = None
    finished_requests: tuple[str, ...] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None


def _prefix_cache_map(prefix: PrefixCacheStats) -> dict[str, object]:
    if not isinstance(prefix, PrefixCacheStats):
        raise ProtocolError(f"prefix_cache_stats must be PrefixCacheStats, got {type_name(prefix)}")
    if not isinstance(prefix.reset, bool):
        raise ProtocolError(
            f"prefix_cache_stats.reset must be a bool, got {type_name(prefix.reset)}"
        )
    counts = {
        k: enc_uint(getattr(prefix, k), f"prefix_cache_stats.{k}") for k in _PREFIX_COUNT_KEYS
    }
    # vLLM's field order: BaseCacheStats's, then PrefixCacheStats's own.
    return {"reset": prefix.reset, **counts, "hits_by_source": {}}


def _stats_map(stats: SchedulerStats) -> dict[str, object]:
    # vLLM's field order (vllm/v1/metrics/stats.py, 0.33.0); defaults for all but 6 keys.
    return {
        "num_running_reqs": enc_uint(stats.num_running_reqs, "num_running_reqs"),
        "num_waiting_reqs": enc_uint(stats.num_waiting_reqs, "num_waiting_reqs"),
        "num_skipped_waiting_reqs": 0,
        "num_kv_fetch_reqs_by_stage": {},
        "step_counter": enc_uint(stats.step_counter, "step_counter"),
        "current_wave": enc_uint(stats.current_wave, "current_wave"),
        "kv_cache_usage": enc_float(stats.kv_cache_usage, "kv_cache_usage", finite=True),
        "iteration_details": None,
        "prefix_cache_stats": _prefix_cache_map(stats.prefix_cache_stats),
        "connector_prefix_cache_stats": None,
        "kv_cache_eviction_events": [],
        "spec_decoding_stats": None,
        "kv_connector_stats": None,
        "ec_connector_stats": None,
        "waiting_lora_adapters": {},
        "running_lora_adapters": {},
        "cudagraph_stats": None,
        "perf_stats": None,
    }


def _output_array(o: object, i: int) -> list[object]:
    if not isinstance(o, EngineCoreOutput):
        raise ProtocolError(f"outputs[{i}] must be an EngineCoreOutput, got {type_name(o)}")
    return [
        enc_str(o.request_id, f"outputs[{i}].request_id"),
        enc_uint_list(o.new_token_ids, f"outputs[{i}].new_token_ids"),
        None,  # new_logprobs
        None,  # new_prompt_logprobs_tensors
        None,  # pooling_output
        enc_opt_uint(o.finish_reason, f"outputs[{i}].finish_reason"),
        None,  # stop_reason
        None,  # events
        None,  # kv_transfer_params
        None,  # ec_transfer_params
        None,  # trace_headers
        None,  # prefill_stats
        None,  # routed_experts
        0,  # num_nans_in_logits
        None,  # mm_cache_miss_hashes
        None,  # new_sampling_mask
        None,  # spec_decode_metrics
        None,  # prompt_token_id_logprobs
        None,  # error
    ]


def encode_engine_core_outputs(out: EngineCoreOutputs) -> bytes:
    """Encode ``out`` as vLLM's 9-element array, all slots present (§4.5).

    Stats are written as the full 18-key ``SchedulerStats`` map; each output as the
    19-slot array with unknown slots at their defaults; ``timestamp`` and
    ``kv_cache_usage`` as float64. ``utility_output`` is packed as given (must be
    msgpack-serialisable). Invalid field values raise ProtocolError.
    """
    if not isinstance(out, EngineCoreOutputs):
        raise ProtocolError(f"expected EngineCoreOutputs, got {type_name(out)}")
    stats = out.scheduler_stats
    if stats is not None and not isinstance(stats, SchedulerStats):
        raise ProtocolError(
            f"scheduler_stats must be SchedulerStats or None, got {type_name(stats)}"
        )
    outputs = out.outputs
    if not isinstance(outputs, (tuple, list)):
        raise ProtocolError(f"outputs must be a tuple, got {type_name(outputs)}")
    finished = out.finished_requests
    if finished is not None:
        if isinstance(finished, str) or not isinstance(finished, (tuple, list)):
            raise ProtocolError(
                f"finished_requests must be a tuple of str, got {type_name(finished)}"
            )
        finished_list: list[str] | None = [
            enc_str(r, f"finished_requests[{i}]") for i, r in enumerate(finished)
        ]
    else:
        finished_list = None
    wire = [
        enc_uint(out.engine_index, "engine_index"),
        [_output_array(o, i) for i, o in enumerate(outputs)],
        None if stats is None else _stats_map(stats),
        enc_float(out.timestamp, "timestamp"),
        out.utility_output,
        finished_list,
        enc_opt_uint(out.wave_complete, "wave_complete"),
        enc_opt_uint(out.start_wave, "start_wave"),
        enc_opt_str(out.weight_version, "weight_version"),
    ]
    return pack(wire, "EngineCoreOutputs")


_ECO_DEFAULTS: Final[list[object]] = [0, [], None, 0.0, None, None, None, None, None]

# Hot-path constructors. A frozen dataclass's __init__ goes through object.__setattr__
# once per field; setting the slots through their member descriptors is ~2x faster.
# Equivalent to calling the class (these classes have no __post_init__). The two
# constructors below are unrolled on purpose, one line per slot: a loop costs more than
# the setting it would save writing twice.
_new = object.__new__
_eco_set = tuple(getattr(EngineCoreOutputs, f).__set__ for f in EngineCoreOutputs.__slots__)
_st_set = tuple(getattr(SchedulerStats, f).__set__ for f in SchedulerStats.__slots__)
_eo_set = tuple(getattr(EngineCoreOutput, f).__set__ for f in EngineCoreOutput.__slots__)


def _new_output(
    a: str, b: tuple[int, ...], c: int | None, _s: tuple[Any, ...] = _eo_set
) -> EngineCoreOutput:
    o = _new(EngineCoreOutput)
    _s[0](o, a)
    _s[1](o, b)
    _s[2](o, c)
    return o


def _new_outputs(
    a: int,
    b: tuple[EngineCoreOutput, ...],
    c: SchedulerStats | None,
    d: float,
    e: object | None,
    f: tuple[str, ...] | None,
    g: int | None,
    h: int | None,
    i: str | None,
    _s: tuple[Any, ...] = _eco_set,
) -> EngineCoreOutputs:
    o = _new(EngineCoreOutputs)
    _s[0](o, a)
    _s[1](o, b)
    _s[2](o, c)
    _s[3](o, d)
    _s[4](o, e)
    _s[5](o, f)
    _s[6](o, g)
    _s[7](o, h)
    _s[8](o, i)
    return o


def _new_stats(
    a: int,
    b: int,
    c: int,
    d: int,
    e: float,
    f: PrefixCacheStats = NO_PREFIX_CACHE_STATS,
    _s: tuple[Any, ...] = _st_set,
) -> SchedulerStats:
    o = _new(SchedulerStats)
    _s[0](o, a)
    _s[1](o, b)
    _s[2](o, c)
    _s[3](o, d)
    _s[4](o, e)
    _s[5](o, f)
    return o


class EngineLoad(NamedTuple):
    """One engine's load, in the one field order used from the codec to the public API.

    The order is that of a front publish entry (§4.7) and of vLLM's own
    ``[waiting, running, usage]`` lists; build it by keyword where order could be confused.
    """

    waiting: int
    running: int
    kv_cache_usage: float


IDLE_LOAD: Final = EngineLoad(waiting=0, running=0, kv_cache_usage=0.0)
"""The load of an engine that has not reported yet."""


class StatsReport(NamedTuple):
    """What one engine's stats-only message tells the coordinator (§4.6, §5.4)."""

    load: EngineLoad
    wave: int
    """The engine's ``current_wave`` when it stepped."""
    step: int
    """The engine's ``step_counter`` within that wave."""


_new_tuple: Final = tuple.__new__


def _decode_stats(d: object) -> SchedulerStats:
    running, waiting, step, wave, kv = _decode_stats_fields(d)
    assert type(d) is dict  # checked by _decode_stats_fields
    prefix = d.get("prefix_cache_stats")
    if prefix is None:
        return _new_stats(running, waiting, step, wave, kv)
    return _new_stats(running, waiting, step, wave, kv, _decode_prefix_cache_stats(prefix))


def _decode_prefix_cache_stats(d: object) -> PrefixCacheStats:
    """vLLM's ``PrefixCacheStats`` map (missing keys default, unknown ones ignored).

    Read only when well formed (a map, ``reset`` a bool, the counts ints >= 0);
    otherwise vLLM's defaults, and no error: a coordinator does not read the key and
    accepts any value there (:mod:`._output_decoder` agrees with this decoder on
    every frame), so one engine's odd counters must not make the two disagree."""
    if type(d) is not dict:
        return NO_PREFIX_CACHE_STATS
    reset = d.get("reset", False)
    counts = [d.get(key, 0) for key in _PREFIX_COUNT_KEYS]
    if type(reset) is not bool or not all(type(c) is int and c >= 0 for c in counts):
        return NO_PREFIX_CACHE_STATS
    if not reset and not any(counts):
        return NO_PREFIX_CACHE_STATS
    return PrefixCacheStats(reset, *counts)


def _decode_stats_fields(d: object) -> tuple[int, int, int, int, float]:
    if type(d) is not dict:
        raise ProtocolError(f"scheduler_stats must be a map or nil, got {type_name(d)}")
    get = d.get
    running = get("num_running_reqs", 0)
    waiting = get("num_waiting_reqs", 0)
    step = get("step_counter", 0)
    wave = get("current_wave", 0)
    kv = get("kv_cache_usage", 0.0)
    if (
        type(running) is not int
        or type(waiting) is not int
        or type(step) is not int
        or type(wave) is not int
        or running < 0
        or waiting < 0
        or step < 0
        or wave < 0
    ):
        dec_uint(running, "scheduler_stats.num_running_reqs")
        dec_uint(waiting, "scheduler_stats.num_waiting_reqs")
        dec_uint(step, "scheduler_stats.step_counter")
        dec_uint(wave, "scheduler_stats.current_wave")
    if type(kv) is not float or not math.isfinite(kv):
        kv = dec_finite_float(kv, "scheduler_stats.kv_cache_usage")
    return running, waiting, step, wave, kv


def stats_report(d: object) -> StatsReport:
    running, waiting, step, wave, kv = _decode_stats_fields(d)
    # StatsReport(EngineLoad(waiting, running, kv), wave, step), without the named tuples'
    # argument parsing (half the cost of this function on the coordinator's hot path)
    return _new_tuple(StatsReport, (_new_tuple(EngineLoad, (waiting, running, kv)), wave, step))


def _decode_outputs(items: list[Any]) -> tuple[EngineCoreOutput, ...]:
    result = []
    for i, o in enumerate(items):
        if type(o) is not list or len(o) < 2:
            raise ProtocolError(
                f"outputs[{i}] must be an EngineCoreOutput array of >= 2 elements, "
                f"got {type_name(o)}"
            )
        rid = o[0]
        if type(rid) is not str:
            raise ProtocolError(f"outputs[{i}].request_id must be a str, got {type_name(rid)}")
        tokens = o[1]
        if type(tokens) is list and all(type(t) is int and t >= 0 for t in tokens):
            tokens = tuple(tokens)
        else:
            tokens = dec_uint_tuple(tokens, f"outputs[{i}].new_token_ids")  # says what is wrong
        finish = o[5] if len(o) > 5 else None
        if finish is not None and (type(finish) is not int or finish < 0):
            dec_uint(finish, f"outputs[{i}].finish_reason")
        result.append(_new_output(rid, tokens, finish))
    return tuple(result)


def decode_engine_core_outputs(frame: bytes) -> EngineCoreOutputs:
    """Decode one ``EngineCoreOutputs`` frame (§4.5), leniently like msgspec.

    The frame must be exactly one msgpack array; a shorter array leaves trailing fields
    at their defaults and extra trailing elements are ignored. Types are checked:
    ``engine_index`` int >= 0; ``outputs`` array of EngineCoreOutput arrays (only
    request_id, new_token_ids and finish_reason are read); ``scheduler_stats`` map or nil
    (only the five coordinator keys and ``prefix_cache_stats`` are read; missing keys
    default, unknown keys are ignored, a malformed ``prefix_cache_stats`` reads as
    vLLM's defaults); ``timestamp`` float (an int is accepted); ``utility_output`` array or nil
    (kept raw); ``finished_requests`` array of str or nil; ``wave_complete`` /
    ``start_wave`` int >= 0 or nil; ``weight_version`` str or nil. Anything else raises
    ProtocolError.
    """
    return engine_core_outputs_from_object(unpack(frame, "EngineCoreOutputs", MAX_DATA_FRAME_BYTES))


def engine_core_outputs_from_object(obj: Any) -> EngineCoreOutputs:
    if type(obj) is not list:
        raise ProtocolError(f"EngineCoreOutputs must be a msgpack array, got {type_name(obj)}")
    if len(obj) < 9:
        obj = obj + _ECO_DEFAULTS[len(obj) :]
    engine_index, outputs, stats, ts, util, finished, wc, sw, wv = obj[:9]

    if type(engine_index) is not int or engine_index < 0:
        dec_uint(engine_index, "EngineCoreOutputs.engine_index")
    if type(outputs) is not list:
        raise ProtocolError(f"EngineCoreOutputs.outputs must be an array, got {type_name(outputs)}")
    outs = _decode_outputs(outputs) if outputs else ()
    if stats is not None:
        stats = _decode_stats(stats)
    if type(ts) is not float:
        ts = dec_float(ts, "EngineCoreOutputs.timestamp")
    if util is not None and type(util) is not list:
        raise ProtocolError(
            f"EngineCoreOutputs.utility_output must be an array or nil, got {type_name(util)}"
        )
    if finished is not None:
        if type(finished) is not list:
            raise ProtocolError(
                f"EngineCoreOutputs.finished_requests must be an array or nil, "
                f"got {type_name(finished)}"
            )
        for i, r in enumerate(finished):
            if type(r) is not str:
                raise ProtocolError(
                    f"EngineCoreOutputs.finished_requests[{i}] must be a str, got {type_name(r)}"
                )
        finished = tuple(finished)
    if wc is not None and (type(wc) is not int or wc < 0):
        dec_uint(wc, "EngineCoreOutputs.wave_complete")
    if sw is not None and (type(sw) is not int or sw < 0):
        dec_uint(sw, "EngineCoreOutputs.start_wave")
    if wv is not None and type(wv) is not str:
        raise ProtocolError(
            f"EngineCoreOutputs.weight_version must be a str or nil, got {type_name(wv)}"
        )
    return _new_outputs(engine_index, outs, stats, ts, util, finished, wc, sw, wv)


class OutputKind(enum.Enum):
    """Shape of an ``EngineCoreOutputs`` message (see :func:`classify_output`)."""

    STATS = "stats"
    WAVE_COMPLETE = "wave_complete"
    START_WAVE = "start_wave"
    REQUEST_BATCH = "request_batch"
    UTILITY_REPLY = "utility_reply"
    MIXED = "mixed"
    EMPTY = "empty"


def classify_output(out: EngineCoreOutputs) -> OutputKind:
    """Classify ``out`` into mutually exclusive shapes (like vLLM's Rust decoder).

    * WAVE_COMPLETE / START_WAVE: exactly that control field and nothing else meaningful
      (no stats, outputs, finished_requests or utility_output).
    * UTILITY_REPLY: ``utility_output`` set, no stats/outputs/finished_requests.
    * REQUEST_BATCH: non-empty ``outputs`` or ``finished_requests`` not None (stats may
      ride along, as on vLLM's normal output stream).
    * STATS: ``scheduler_stats`` only.
    * MIXED: both wave fields, a wave field with anything else, or a utility reply with
      anything else (vLLM never sends these; the Rust decoder rejects them).
    * EMPTY: none of the above is set. ``engine_index``, ``timestamp`` and
      ``weight_version`` never affect the result.
    """
    wc = out.wave_complete is not None
    sw = out.start_wave is not None
    stats = out.scheduler_stats is not None
    request = bool(out.outputs) or out.finished_requests is not None
    utility = out.utility_output is not None
    if wc or sw:
        if (wc and sw) or stats or request or utility:
            return OutputKind.MIXED
        return OutputKind.WAVE_COMPLETE if wc else OutputKind.START_WAVE
    if utility:
        return OutputKind.MIXED if (stats or request) else OutputKind.UTILITY_REPLY
    if request:
        return OutputKind.REQUEST_BATCH
    if stats:
        return OutputKind.STATS
    return OutputKind.EMPTY
