"""The coordinator's decoder of engine outputs: both paths (msgspec, msgpack-python) say
exactly what the full decoder says (``decode_engine_core_outputs`` then
``classify_output``), the same value or the same ProtocolError message, on every kind of
frame of ``tests/protocol/decoder_contract.py``; its ingest path (``decode_ingest_stats``) gives
the same fields or leaves the frame to them, never anything else."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import example, given

from tests.protocol.decoder_contract import (
    REAL_STATS_FRAME,
    SETTINGS,
    Contract,
    DupMap,
    Ext,
    RawStr,
    Wide,
    calls_of,
    contract_tests,
    coordinator_frames,
    real_stats,
    vector_frame,
    without_msgspec,
    write,
)
from tests.protocol.wire import U64, general_decode
from trio_dpcoord import protocol
from trio_dpcoord.protocol import (
    COORDINATOR_OUTPUT_DECODER,
    decode_coordinator_output,
    decode_coordinator_output_with_msgpack,
    decode_coordinator_output_with_msgspec,
)

INGEST_PATHS = {
    "layouts": protocol.ingest_stats_with_layouts,
    "msgpack": protocol.ingest_stats_with_msgpack,
    "msgspec": protocol.ingest_stats_with_msgspec,
}
"""The coordinator's pure-Python ingest paths of a stats report."""


def _reference(frame: bytes) -> object:
    protocol.decode_engine_core_outputs(frame)  # the error's message, when it fails
    return general_decode(frame)


COORDINATOR = Contract(
    "coordinator",
    {
        "msgpack": decode_coordinator_output_with_msgpack,
        "msgspec": decode_coordinator_output_with_msgspec,
    },
    _reference,
    lambda decoded: decoded,
    coordinator_frames(),
)


TestCoordinatorContract = contract_tests(COORDINATOR)


def test_the_vllm_vectors_decode_to_their_values() -> None:
    report = protocol.StatsReport(protocol.EngineLoad(3, 12, 0.4375), wave=5, step=17)
    for decode in COORDINATOR.paths.values():
        assert decode(REAL_STATS_FRAME) == (protocol.OutputKind.STATS, 2, report)
        assert decode(vector_frame("eco_wave_complete")) == (
            protocol.OutputKind.WAVE_COMPLETE,
            0,
            5,
        )
        assert decode(vector_frame("eco_start_wave")) == (protocol.OutputKind.START_WAVE, 2, 6)
        batch = vector_frame("eco_normal_output_batch")
        assert decode(batch)[0] is protocol.OutputKind.REQUEST_BATCH


# ------------------------------------------------------------------ the ingest path


def assert_ingest_agrees(frame: bytes) -> None:
    """Each path of ``decode_ingest_stats`` returns the stats report's six fields, flat,
    exactly when the contract's decoder says STATS, or None (then the decoder judges the
    frame): never other fields, never an exception."""
    expected = COORDINATOR.expected(frame)
    for name, ingest in INGEST_PATHS.items():
        record = ingest(frame)
        if record is None:
            continue
        assert expected[0] is protocol.OutputKind.STATS, (name, frame.hex())
        _, engine, report = expected
        load = report.load
        assert record == (
            engine,
            load.waiting,
            load.running,
            load.kv_cache_usage,
            report.wave,
            report.step,
        )


@SETTINGS
@given(coordinator_frames())
def test_the_ingest_path_agrees_on_generated_frames(frame: bytes) -> None:
    assert_ingest_agrees(frame)


def test_the_ingest_path_reads_the_reports_engines_send() -> None:
    """vLLM's own report (and the benchmarks' fixed-width one) is read by both ingest
    paths, not left to the general decoder; wave reports and request batches are."""
    wide = write(
        [3, [], {**real_stats(), "step_counter": Wide(17)}, 1.0, None, None, None, None, None]
    )
    for ingest in INGEST_PATHS.values():
        assert ingest(REAL_STATS_FRAME) == (2, 3, 12, 0.4375, 5, 17)
        assert ingest(wide) is not None
        for name in ("eco_wave_complete", "eco_start_wave", "eco_normal_output_batch"):
            assert ingest(vector_frame(name)) is None
        assert ingest(b"\xc1") is None


# ------------------------------------------------------------------ the edges


def stats_frame(stats: Any, *extra_slots: Any) -> bytes:
    return write([1, [], stats, 1.5, None, None, None, None, None, *extra_slots])


@pytest.mark.parametrize(
    ("frame", "accepted"),
    [
        # where a typed decode would be looser than msgpack-python's, if it skipped
        (stats_frame({**real_stats(), "perf_stats": {1: 2}}), False),  # a non-string key
        (stats_frame({**real_stats(), "new_key": {None: 0}}), False),
        (stats_frame({**real_stats(), "perf_stats": RawStr(b"\xff\xfe")}), False),  # bad UTF-8
        (stats_frame({**real_stats(), "new_key": [RawStr(b"\xc3")]}), False),
        (stats_frame(real_stats(), {2: 3}), False),  # a 10th slot the full decoder reads
        # valid, yet not for the typed decode: the msgpack path takes them
        (stats_frame({**real_stats(), "perf_stats": b"bin"}), True),
        (stats_frame({**real_stats(), "perf_stats": Ext(1, b"x")}), True),
        (stats_frame({**real_stats(), "perf_stats": Ext(-1, b"xyz")}), False),  # a bad timestamp
        (stats_frame({**real_stats(), "perf_stats": [[[[1]]]]}), True),  # 4 levels deep
        (stats_frame({**real_stats(), "perf_stats": {b"bin key": 1}}), True),
        (stats_frame(real_stats(), None), True),  # a 10th slot, harmless
        (stats_frame({**real_stats(), "new_key": [1, {"a": None}]}), True),  # a newer vLLM
        (stats_frame({"new_key": 1, "num_running_reqs": -1}), False),
        (stats_frame({"new_key": 1, "kv_cache_usage": math.nan}), False),
        (write(Wide([1, [], real_stats(), 1.5])), True),  # array16
        # the fields it reads
        (stats_frame(DupMap((("num_running_reqs", 1), ("num_running_reqs", 7)))), True),
        (stats_frame({"num_running_reqs": True}), False),
        (stats_frame({"num_waiting_reqs": -1}), False),
        (stats_frame({"kv_cache_usage": math.nan}), False),
        (stats_frame({"kv_cache_usage": math.inf}), False),
        (stats_frame({"kv_cache_usage": 1}), True),
        (stats_frame({"kv_cache_usage": Wide(0.5)}), True),
        (stats_frame({"step_counter": 1.0}), False),
        (stats_frame({"current_wave": U64}), True),
        (write([U64, [], None, 0.0, None, None, U64]), True),
        (write([0, [], None, 0.0, None, None, 3, 4]), True),  # both wave fields: MIXED
        (write([0, [], {}, 0.0, None, None, 3]), True),  # stats with wave_complete: MIXED
        (write([0, [], None, 0.0, None, None, -3]), False),
        (write([0, [], None, True]), False),
        (write([0, [], None, 0.0, None, None, None, None, RawStr(b"\xff")]), False),
        (write([]), True),  # EMPTY
        (b"", False),
        (b"\x99", False),
        (write([1]) + b"\x00", False),
    ],
)
def test_both_paths_agree_on_the_edges(frame: bytes, accepted: bool) -> None:
    COORDINATOR.assert_paths_agree(frame)
    assert_ingest_agrees(frame)
    assert (COORDINATOR.expected(frame)[0] != "ProtocolError") == accepted


@given(coordinator_frames())
@example(stats_frame(real_stats()))
def test_the_duplicate_key_rule_is_msgpacks(frame: bytes) -> None:
    """The last of repeated keys wins, in both paths as in msgpack-python (checked on
    frames that decode, against a direct read of the stats map)."""
    result = COORDINATOR.outcome(decode_coordinator_output_with_msgspec, frame)
    if result[0] is protocol.OutputKind.STATS:
        stats = msgpack.unpackb(frame, strict_map_key=False)[2]
        assert isinstance(result[2], protocol.StatsReport)
        assert result[2].load.running == stats.get("num_running_reqs", 0)


def test_the_msgspec_path_reads_what_engines_send_by_itself() -> None:
    """vLLM's stats reports (with the stats keys of 0.32.0/0.33.0 or a newer key),
    wave_complete and start_wave never reach the msgpack path: msgspec reads them."""
    decode = decode_coordinator_output_with_msgspec
    report = protocol.StatsReport(protocol.EngineLoad(3, 12, 0.4375), wave=5, step=17)
    newer = write([2, [], {**real_stats(), "new_key": {"a": [1]}}, 1.0, None, None, None, None])
    wave_complete = write([0, [], None, 1.0, None, None, 5, None, None])
    start_wave = write([4, [], None, 1.0, None, None, None, 6, None])
    with calls_of(decode_coordinator_output_with_msgpack) as msgpack_path:
        assert decode(REAL_STATS_FRAME) == (protocol.OutputKind.STATS, 2, report)
        assert decode(newer) == (protocol.OutputKind.STATS, 2, report)
        assert decode(wave_complete) == (protocol.OutputKind.WAVE_COMPLETE, 0, 5)
        assert decode(start_wave) == (protocol.OutputKind.START_WAVE, 4, 6)
    assert msgpack_path == []
    # and the trace sees that path when it is taken: a request batch is the msgpack path's
    with calls_of(decode_coordinator_output_with_msgpack) as msgpack_path:
        COORDINATOR.outcome(decode, write([0, [[b"r"]], None, 1.0, None, None, None, None, None]))
    assert msgpack_path


def test_the_service_uses_the_msgspec_path_when_installed_and_msgpack_otherwise() -> None:
    """With msgspec importable the coordinator decodes with it; with the import blocked
    (the ``fast`` extra not installed) it takes the msgpack path and decodes the same."""
    assert COORDINATOR_OUTPUT_DECODER == "msgspec"
    assert decode_coordinator_output is not decode_coordinator_output_with_msgpack
    script = (
        "import json\n"
        "from trio_dpcoord import protocol as p\n"
        f"frame = bytes.fromhex({stats_frame(real_stats()).hex()!r})\n"
        "assert p.decode_coordinator_output is p.decode_coordinator_output_with_msgpack\n"
        "try:\n"
        "    p.decode_coordinator_output_with_msgspec(frame)\n"
        "except RuntimeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('msgspec path without msgspec')\n"
        "kind, engine, report = p.decode_coordinator_output(frame)\n"
        "print(json.dumps([p.COORDINATOR_OUTPUT_DECODER, kind.value, engine, list(report.load)]))\n"
    )
    assert without_msgspec(script) == ["msgpack", "stats", 1, [3, 12, 0.4375]]
