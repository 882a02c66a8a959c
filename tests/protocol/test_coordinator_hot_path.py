"""The coordinator's hot path (``decode_coordinator_output``) says exactly what the general
decoder then ``classify_output`` say, on generated, arbitrary, mutated and vLLM's frames."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from tests.protocol.wire import (
    Vectors,
    eco_strategy,
    frames_of,
    general_decode,
    msgpack_values,
    pack,
)
from trio_dpcoord import protocol as P
from trio_dpcoord.protocol import (
    EngineCoreOutputs,
    ProtocolError,
    encode_engine_core_outputs,
)


def hot_decode(frame: bytes) -> tuple[P.OutputKind, int, object] | str:
    try:
        return P.decode_coordinator_output(frame)
    except ProtocolError:
        return "ProtocolError"


@given(eco_strategy)
def test_coordinator_hot_path_agrees_with_the_general_decoder(out: EngineCoreOutputs) -> None:
    frame = encode_engine_core_outputs(out)
    assert hot_decode(frame) == general_decode(frame)


@given(msgpack_values)
def test_coordinator_hot_path_agrees_on_arbitrary_msgpack(value: Any) -> None:
    frame = pack(value)
    assert hot_decode(frame) == general_decode(frame)


@given(st.data())
def test_coordinator_hot_path_agrees_on_mutated_control_frames(
    vectors: Vectors, data: st.DataObject
) -> None:
    name = data.draw(
        st.sampled_from(
            [
                "eco_scheduler_stats_moe",
                "eco_scheduler_stats_dense",
                "eco_wave_complete",
                "eco_start_wave",
                "eco_utility_output",
                "eco_normal_output_batch",
            ]
        )
    )
    wire = msgpack.unpackb(frames_of(vectors[name])[0], raw=False)
    i = data.draw(st.integers(0, len(wire) - 1))
    wire[i] = data.draw(msgpack_values)
    frame = pack(
        wire[: data.draw(st.integers(0, len(wire) + 1))] if data.draw(st.booleans()) else wire
    )
    assert hot_decode(frame) == general_decode(frame)


def test_coordinator_hot_path_on_the_vectors(vectors: Vectors) -> None:
    expected = {
        "eco_scheduler_stats_moe": (
            P.OutputKind.STATS,
            2,
            P.StatsReport(P.EngineLoad(waiting=3, running=12, kv_cache_usage=0.4375), 5, 17),
        ),
        "eco_wave_complete": (P.OutputKind.WAVE_COMPLETE, 0, 5),
        "eco_start_wave": (P.OutputKind.START_WAVE, 2, 6),
        "eco_utility_output": (P.OutputKind.UTILITY_REPLY, 0, None),
    }
    for name, result in expected.items():
        assert P.decode_coordinator_output(frames_of(vectors[name])[0]) == result
    batch = P.decode_coordinator_output(frames_of(vectors["eco_normal_output_batch"])[0])
    assert batch[0] is P.OutputKind.REQUEST_BATCH
