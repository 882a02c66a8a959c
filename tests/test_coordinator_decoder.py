"""The coordinator's decoder of engine outputs: both paths (msgspec, msgpack-python) say
exactly what the full decoder says (``decode_engine_core_outputs`` then
``classify_output``), the same value or the same ProtocolError message, on the fuzz
corpus, the vLLM vectors and generated frames built to find where a typed msgspec decode
could be looser than msgpack-python (non-string keys, bad UTF-8, ext and bin values, deep
nesting, duplicate keys, wide encodings, slots past the ninth)."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fuzz.fuzz_codec import frames as fuzz_frames
from tests.conftest import VECTORS_PATH
from tests.test_protocol import (
    U64,
    eco_strategy,
    general_decode,
    msgpack_values,
    pack,
)
from trio_dpcoord import protocol
from trio_dpcoord.protocol import (
    COORDINATOR_OUTPUT_DECODER,
    CoordinatorOutput,
    ProtocolError,
    decode_coordinator_output,
    decode_coordinator_output_with_msgpack,
    decode_coordinator_output_with_msgspec,
)

Outcome = tuple[protocol.OutputKind, int, object] | tuple[str, str]

PATHS: dict[str, Callable[[bytes], CoordinatorOutput]] = {
    "msgpack": decode_coordinator_output_with_msgpack,
    "msgspec": decode_coordinator_output_with_msgspec,
}


def full(frame: bytes) -> Outcome:
    """The reference, with the error's message: what the core logs and counts."""
    try:
        protocol.decode_engine_core_outputs(frame)
    except ProtocolError as exc:
        return ("ProtocolError", str(exc))
    result = general_decode(frame)
    assert not isinstance(result, str)
    return result


def outcome(decode: Callable[[bytes], CoordinatorOutput], frame: bytes) -> Outcome:
    try:
        return decode(frame)
    except ProtocolError as exc:
        return ("ProtocolError", str(exc))


def assert_both_paths_agree(frame: bytes) -> None:
    expected = full(frame)
    for name, decode in PATHS.items():
        assert outcome(decode, frame) == expected, (name, frame.hex())


# ------------------------------------------------------------------ a raw msgpack writer
# msgpack-python writes canonical msgpack only; these wrappers write what it will not:
# strings of any bytes, maps with repeated keys, wider-than-needed headers and numbers.


@dataclass(frozen=True)
class RawStr:
    """A msgpack str of these bytes, valid UTF-8 or not."""

    data: bytes


@dataclass(frozen=True)
class DupMap:
    """A msgpack map of these pairs, in order, keys repeated or not."""

    pairs: tuple[tuple[Any, Any], ...]


@dataclass(frozen=True)
class Ext:
    """A msgpack ext of any type code, -1 (timestamps) included, of any length."""

    code: int
    data: bytes


@dataclass(frozen=True)
class Wide:
    """The value with a wider header than needed: array16 / map16, int64, float32."""

    value: Any


def write(value: Any) -> bytes:
    if isinstance(value, RawStr):
        n = len(value.data)
        return (bytes([0xA0 | n]) if n < 32 else b"\xd9" + bytes([n])) + value.data
    if isinstance(value, Ext):
        fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}.get(len(value.data))
        head = bytes([fixed]) if fixed else b"\xc7" + bytes([len(value.data)])
        return head + struct.pack(">b", value.code) + value.data
    if isinstance(value, DupMap):
        head = bytes([0x80 | len(value.pairs)])
        return head + b"".join(write(k) + write(v) for k, v in value.pairs)
    if isinstance(value, Wide):
        inner = value.value
        if isinstance(inner, list):
            return b"\xdc" + struct.pack(">H", len(inner)) + b"".join(map(write, inner))
        if isinstance(inner, dict):
            body = b"".join(write(k) + write(v) for k, v in inner.items())
            return b"\xde" + struct.pack(">H", len(inner)) + body
        if isinstance(inner, float):
            return b"\xca" + struct.pack(">f", inner)
        if isinstance(inner, int) and not isinstance(inner, bool) and -(2**63) <= inner < 2**63:
            return b"\xd3" + struct.pack(">q", inner)
        return write(inner)
    if isinstance(value, list):
        if len(value) >= 16:
            return write(Wide(value))
        return bytes([0x90 | len(value)]) + b"".join(map(write, value))
    if isinstance(value, dict):
        if len(value) >= 16:
            return write(Wide(value))
        return bytes([0x80 | len(value)]) + b"".join(write(k) + write(v) for k, v in value.items())
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _vector_frame(name: str) -> bytes:
    vectors = {v["name"]: v for v in json.loads(VECTORS_PATH.read_text())}
    return bytes.fromhex(vectors[name]["frames_hex"][0])


_REAL_STATS_FRAME = _vector_frame("eco_scheduler_stats_moe")


def real_stats() -> dict[str, Any]:
    """vLLM 0.33.0's stats map as its engines send it (tests/data/vectors.json), a copy."""
    stats: dict[str, Any] = msgpack.unpackb(_REAL_STATS_FRAME)[2]
    return stats


STATS_KEYS = list(real_stats())

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | st.binary(max_size=6).map(RawStr)
    | st.builds(Ext, st.integers(-128, 127), st.binary(max_size=9))
    | st.integers(-(2**63), 2**63 - 1).map(Wide)
    | st.floats(width=32).map(Wide)
)
hostile = st.recursive(
    leaves,
    lambda c: (
        st.lists(c, max_size=4)
        | st.lists(c, max_size=3).map(Wide)
        | st.dictionaries(st.text(max_size=5), c, max_size=3)
        | st.dictionaries(st.integers(-5, 5) | st.binary(max_size=3), c, max_size=2)
        | st.lists(st.tuples(st.sampled_from(["a", "b"]), c), max_size=3).map(
            lambda pairs: DupMap(tuple(pairs))
        )
    ),
    max_leaves=12,
)
counts = st.integers(0, 50) | st.just(U64) | hostile


@st.composite
def stats_maps(draw: st.DrawFn) -> Any:
    """Mostly vLLM's map with some entries changed, dropped, added or repeated."""
    stats: dict[Any, Any] = real_stats()
    for key in draw(st.lists(st.sampled_from(STATS_KEYS), max_size=3)):
        if draw(st.booleans()):
            stats.pop(key, None)
    for key in draw(st.lists(st.sampled_from(STATS_KEYS[:2] + STATS_KEYS[4:6]), max_size=2)):
        stats[key] = draw(counts)
    if draw(st.booleans()):
        stats["kv_cache_usage"] = draw(st.floats() | st.integers(0, 3) | hostile)
    for key in draw(st.lists(st.sampled_from(STATS_KEYS[7:]), max_size=3)):
        stats[key] = draw(hostile)
    if draw(st.booleans()):
        stats[draw(st.text(max_size=8) | st.integers(0, 3))] = draw(hostile)
    if draw(st.booleans()):
        key = draw(st.sampled_from(STATS_KEYS[:7]))
        return DupMap((*stats.items(), (key, draw(counts))))
    return Wide(stats) if draw(st.booleans()) else stats


@st.composite
def coordinator_frames(draw: st.DrawFn) -> bytes:
    """Frames shaped like what engines send the coordinator, each slot sometimes odd."""
    slots: list[Any] = [
        draw(st.integers(0, 8) | st.just(U64) | hostile),
        draw(st.just([]) | hostile),
        draw(st.none() | stats_maps() | hostile),
        draw(st.floats() | st.integers(0, 10) | st.floats(width=32).map(Wide) | hostile),
        draw(st.none() | hostile),
        draw(st.none() | st.lists(st.text(max_size=4), max_size=2) | hostile),
        draw(st.none() | st.integers(0, 9) | hostile),
        draw(st.none() | st.integers(0, 9) | hostile),
        draw(st.none() | st.text(max_size=4) | hostile),
    ]
    if draw(st.booleans()):  # a quiet message: no wave fields, or only one
        slots[draw(st.sampled_from([6, 7]))] = None
    slots = slots[: draw(st.integers(0, 9))] if draw(st.booleans()) else slots
    if draw(st.booleans()):
        slots += draw(st.lists(hostile, min_size=1, max_size=3))  # past the ninth slot
    return write(Wide(slots) if draw(st.booleans()) else slots)


# ------------------------------------------------------------------ the properties

SETTINGS = settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(coordinator_frames())
def test_both_paths_agree_with_the_full_decoder_on_generated_frames(frame: bytes) -> None:
    assert_both_paths_agree(frame)


@SETTINGS
@given(fuzz_frames())
def test_both_paths_agree_with_the_full_decoder_on_the_fuzz_corpus(frame: bytes) -> None:
    assert_both_paths_agree(frame)


@given(eco_strategy)
def test_both_paths_agree_on_every_encodable_message(out: protocol.EngineCoreOutputs) -> None:
    assert_both_paths_agree(protocol.encode_engine_core_outputs(out))


@given(msgpack_values)
def test_both_paths_agree_on_arbitrary_msgpack(value: Any) -> None:
    assert_both_paths_agree(pack(value))


def test_both_paths_agree_on_the_vllm_vectors() -> None:
    vectors = json.loads(VECTORS_PATH.read_text())
    frames = [bytes.fromhex(h) for v in vectors for h in v["frames_hex"]]
    assert len(frames) > 25
    for frame in frames:
        assert_both_paths_agree(frame)
    by_name = {v["name"]: bytes.fromhex(v["frames_hex"][0]) for v in vectors}
    for decode in PATHS.values():
        assert decode(by_name["eco_scheduler_stats_moe"]) == (
            protocol.OutputKind.STATS,
            2,
            protocol.StatsReport(protocol.EngineLoad(3, 12, 0.4375), wave=5, step=17),
        )
        assert decode(by_name["eco_wave_complete"]) == (protocol.OutputKind.WAVE_COMPLETE, 0, 5)
        assert decode(by_name["eco_start_wave"]) == (protocol.OutputKind.START_WAVE, 2, 6)
        assert decode(by_name["eco_normal_output_batch"])[0] is protocol.OutputKind.REQUEST_BATCH


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
    assert_both_paths_agree(frame)
    assert (full(frame)[0] != "ProtocolError") == accepted


@given(coordinator_frames())
@example(stats_frame(real_stats()))
def test_the_duplicate_key_rule_is_msgpacks(frame: bytes) -> None:
    """The last of repeated keys wins, in both paths as in msgpack-python (checked on
    frames that decode, against a direct read of the stats map)."""
    result = outcome(decode_coordinator_output_with_msgspec, frame)
    if result[0] is protocol.OutputKind.STATS:
        stats = msgpack.unpackb(frame, strict_map_key=False)[2]
        assert isinstance(result[2], protocol.StatsReport)
        assert result[2].load.running == stats.get("num_running_reqs", 0)


@contextmanager
def calls_of(function: Callable[..., object]) -> Iterator[list[str]]:
    """The calls of ``function`` made in the block (its callers' names), seen by a trace
    function: the msgspec path calls the msgpack path by its module's name, out of reach
    of a test that would swap it."""
    code = function.__code__
    calls: list[str] = []

    def trace(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is code:
            caller = frame.f_back
            calls.append(caller.f_code.co_name if caller is not None else "?")

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield calls
    finally:
        sys.settrace(previous)


def test_the_msgspec_path_reads_what_engines_send_by_itself() -> None:
    """vLLM's stats reports (with the stats keys of 0.32.0/0.33.0 or a newer key),
    wave_complete and start_wave never reach the msgpack path: msgspec reads them."""
    decode = decode_coordinator_output_with_msgspec
    report = protocol.StatsReport(protocol.EngineLoad(3, 12, 0.4375), wave=5, step=17)
    newer = write([2, [], {**real_stats(), "new_key": {"a": [1]}}, 1.0, None, None, None, None])
    wave_complete = write([0, [], None, 1.0, None, None, 5, None, None])
    start_wave = write([4, [], None, 1.0, None, None, None, 6, None])
    with calls_of(decode_coordinator_output_with_msgpack) as msgpack_path:
        assert decode(_REAL_STATS_FRAME) == (protocol.OutputKind.STATS, 2, report)
        assert decode(newer) == (protocol.OutputKind.STATS, 2, report)
        assert decode(wave_complete) == (protocol.OutputKind.WAVE_COMPLETE, 0, 5)
        assert decode(start_wave) == (protocol.OutputKind.START_WAVE, 4, 6)
    assert msgpack_path == []
    # and the trace sees that path when it is taken: a request batch is the msgpack path's
    with calls_of(decode_coordinator_output_with_msgpack) as msgpack_path:
        outcome(decode, write([0, [[b"r"]], None, 1.0, None, None, None, None, None]))
    assert msgpack_path


def test_the_service_uses_the_msgspec_path_when_installed_and_msgpack_otherwise() -> None:
    """With msgspec importable the coordinator decodes with it; with the import blocked
    (the ``fast`` extra not installed) it takes the msgpack path and decodes the same."""
    assert COORDINATOR_OUTPUT_DECODER == "msgspec"
    assert decode_coordinator_output is not decode_coordinator_output_with_msgpack
    script = (
        "import sys; sys.modules['msgspec'] = None\n"
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
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["msgpack", "stats", 1, [3, 12, 0.4375]]
