"""What the protocol tests share: the vLLM vectors' frames, msgpack packing, hypothesis
strategies for every message, and the general decoder the coordinator's fast paths are held to
(``general_decode``)."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import strategies as st

from trio_dpcoord import protocol as P
from trio_dpcoord.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FrontPublish,
    OutputKind,
    ProtocolError,
    SchedulerStats,
    decode_engine_core_outputs,
)

Vector = dict[str, Any]
Vectors = dict[str, Vector]

U64 = 2**64 - 1


def frames_of(v: Vector) -> list[bytes]:
    return [bytes.fromhex(h) for h in v["frames_hex"]]


def unhex(value: Any) -> Any:
    """JSON meaning -> Python value ({"hex": ...} -> bytes)."""
    if isinstance(value, dict):
        if set(value) == {"hex"}:
            return bytes.fromhex(value["hex"])
        return {k: unhex(x) for k, x in value.items()}
    if isinstance(value, list):
        return [unhex(x) for x in value]
    return value


def pack(value: Any) -> bytes:
    out: bytes = msgpack.packb(value, use_bin_type=True)
    return out


ECO_KIND = {
    "eco_scheduler_stats_moe": OutputKind.STATS,
    "eco_scheduler_stats_dense": OutputKind.STATS,
    "eco_wave_complete": OutputKind.WAVE_COMPLETE,
    "eco_start_wave": OutputKind.START_WAVE,
    "eco_normal_output_batch": OutputKind.REQUEST_BATCH,
    "eco_utility_output": OutputKind.UTILITY_REPLY,
}


# ------------------------------------------------------------------ hypothesis strategies

u64 = st.integers(min_value=0, max_value=U64)
finite = st.floats(allow_nan=False, allow_infinity=False)
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=U64)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=6)
    ),
    max_leaves=30,
)
engine_ref = st.none() | u64 | st.binary(max_size=4)
publishes = st.builds(
    FrontPublish,
    counts=st.none() | st.lists(st.tuples(u64, u64, finite), max_size=8).map(tuple),
    current_wave=u64,
    engines_running=st.booleans(),
)
loads = st.builds(P.EngineLoad, waiting=u64, running=u64, kv_cache_usage=finite)
token_ids = st.lists(u64, max_size=8).map(tuple)
stats_strategy = st.builds(
    SchedulerStats,
    num_running_reqs=u64,
    num_waiting_reqs=u64,
    step_counter=u64,
    current_wave=u64,
    kv_cache_usage=finite,
)
# decoded msgpack values: arrays come back as lists, so no tuples; floats not NaN
plain_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=U64)
    | finite
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=4),
    max_leaves=12,
)
eco_strategy = st.builds(
    EngineCoreOutputs,
    engine_index=u64,
    outputs=st.lists(
        st.builds(EngineCoreOutput, st.text(max_size=12), token_ids, st.none() | u64),
        max_size=4,
    ).map(tuple),
    scheduler_stats=st.none() | stats_strategy,
    timestamp=finite,
    utility_output=st.none() | st.lists(plain_values, max_size=4),
    finished_requests=st.none() | st.lists(st.text(max_size=12), max_size=4).map(tuple),
    wave_complete=st.none() | u64,
    start_wave=st.none() | u64,
    weight_version=st.none() | st.text(max_size=12),
)
requests = st.builds(
    EngineCoreRequest,
    request_id=st.text(max_size=20),
    prompt_token_ids=token_ids,
    arrival_time=finite,
    client_index=u64,
    current_wave=u64,
    data_parallel_rank=st.none() | u64,
    max_tokens=st.none() | u64,
)


# ------------------------------------------------------------------ the general decoder


def general_decode(frame: bytes) -> tuple[P.OutputKind, int, object] | str:
    """The reference: full decode then classify, reduced to what the hot path returns."""
    try:
        out = decode_engine_core_outputs(frame)
    except ProtocolError:
        return "ProtocolError"
    kind = P.classify_output(out)
    value: object = None
    if kind is P.OutputKind.STATS:
        s = out.scheduler_stats
        assert s is not None
        value = P.StatsReport(
            P.EngineLoad(
                waiting=s.num_waiting_reqs,
                running=s.num_running_reqs,
                kv_cache_usage=s.kv_cache_usage,
            ),
            wave=s.current_wave,
            step=s.step_counter,
        )
    elif kind is P.OutputKind.WAVE_COMPLETE:
        value = out.wave_complete
    elif kind is P.OutputKind.START_WAVE:
        value = out.start_wave
    return kind, out.engine_index, value
