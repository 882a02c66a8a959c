"""The compiled twin of the coordinator's ingest decoder against its pure-Python spec.

``protocol/_output_decoder.py`` takes ``decode_ingest_stats`` from its compiled twin
(``protocol/_output_decoder_kernel.pyx``) where it was built. Here the pure module runs
beside the package's own (loaded from source by :func:`tests.pure_twin.pure_twin_modules`)
over frames of every shape: the project's own encoder, msgpack variants written byte by
byte (every int width, float32 and float64, keys in any order and any str header, extra
keys, nil fields, wide map headers), vLLM's vectors, the fuzz corpus, the coordinator
decoder's hostile frames, and mutated bytes. The compiled answer is the pure one, or None
where the pure path's final answer (after the full decoder) is that same report; and the
whole :func:`decode_coordinator_output` answer, ProtocolError messages included, is the
same on both builds. With ``TRIO_DPCOORD_PURE_PYTHON=1`` (or no compiler at install)
both sides are pure and this checks the loader and the switch; CI runs it both ways.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from benchmarks.programs.fleet import fleet_stream
from fuzz.fuzz_codec import frames as fuzz_frames
from tests.protocol.decoder_contract import (
    REAL_STATS_FRAME,
    VECTORS,
    calls_of,
    coordinator_frames,
    real_stats,
)
from tests.protocol.wire import eco_strategy
from tests.pure_twin import (
    PURE_PYTHON,
    PURE_TWIN_PACKAGE,
    REQUIRE_COMPILED,
    kernel_state,
    package_module,
    pure_twin_modules,
    run_fresh,
)
from trio_dpcoord import protocol
from trio_dpcoord.protocol import EngineLoad, OutputKind, ProtocolError, StatsReport

MODULE = "protocol._output_decoder"
FAST = package_module(MODULE)
PURE = pure_twin_modules([MODULE])[MODULE]

BUILT, IN_USE = kernel_state(MODULE)

SETTINGS = settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
U64 = 2**64 - 1


def final(decode: Callable[[bytes], Any], frame: bytes) -> Any:
    """What the coordinator makes of a frame: the decoded triple or the error's message."""
    try:
        return decode(frame)
    except ProtocolError as exc:
        return ("ProtocolError", str(exc))


def as_decoded(record: tuple[Any, ...]) -> Any:
    """An ingest record as the full decoder states the same report."""
    engine, waiting, running, kv, wave, step = record
    return (OutputKind.STATS, engine, StatsReport(EngineLoad(waiting, running, kv), wave, step))


def assert_twins_agree(frame: bytes) -> tuple[Any, ...] | None:
    """The differential contract on one frame; returns the compiled build's record."""
    fast = FAST.decode_ingest_stats(frame)
    spec = PURE.ingest_with_msgpack(frame)  # the pure ingest path that judges most
    pure = PURE.decode_ingest_stats(frame)  # the pure build's own (msgspec where installed)
    pure_final = final(PURE.decode_coordinator_output, frame)
    assert final(FAST.decode_coordinator_output, frame) == pure_final, frame.hex()
    if fast is not None:
        # the pure paths' records where they give one (the msgspec path may take a frame
        # the msgpack path leaves to the full decoder: a weight version); the kernel
        # never takes what the msgpack path does not
        assert (spec, pure) != (None, None), frame.hex()
        assert spec in (None, fast) and pure in (None, fast), frame.hex()
        assert spec is not None or not IN_USE, frame.hex()
        assert [type(v) for v in fast] == [int, int, int, float, int, int], frame.hex()
        assert pure_final == as_decoded(fast), frame.hex()
    # refused here: the full decoder gives the report the pure path would have taken
    for record in (spec, pure):
        if record is not None:
            assert pure_final == as_decoded(record), frame.hex()
    # the pure path without msgspec: read against a learnt layout (the second time at
    # least), the msgpack path's answer
    for _ in range(2):
        assert PURE.ingest_with_layouts(frame) == spec, frame.hex()
    return fast  # type: ignore[no-any-return]


def test_the_build_asked_for_runs() -> None:
    """Forced pure: the pure name; else the compiled one wherever the twin was built
    (and CI's default install must have built it)."""
    if REQUIRE_COMPILED and not PURE_PYTHON:
        assert BUILT, "the compiled twin was not built"
    assert (BUILT and not PURE_PYTHON) == IN_USE
    assert FAST.decode_ingest_stats.__module__.endswith("_kernel") == IN_USE
    assert PURE.decode_ingest_stats.__module__.startswith(PURE_TWIN_PACKAGE)
    assert PURE.decode_ingest_stats is not FAST.decode_ingest_stats
    # what the coordinator's ingest calls, public
    assert protocol.decode_ingest_stats is FAST.decode_ingest_stats


@pytest.mark.parametrize("forced_pure", [False, True])
def test_a_fresh_process_runs_the_build_it_names(forced_pure: bool) -> None:
    """The start-up line (``build_description``) names the kernel exactly when the
    ingest decoder is the compiled one; TRIO_DPCOORD_PURE_PYTHON forces the pure one."""
    script = (
        "import json\n"
        "from trio_dpcoord._compiled import build_description\n"
        "from trio_dpcoord.protocol import decode_ingest_stats\n"
        "print(json.dumps([build_description(), decode_ingest_stats.__module__]))"
    )
    line, module = run_fresh(script, forced_pure=forced_pure)
    compiled = module.endswith("_kernel")
    assert line.startswith("compiled hot path in use") == (compiled and "_keys_kernel" in line)
    if forced_pure:
        assert not compiled
        assert "TRIO_DPCOORD_PURE_PYTHON is set" in line
    elif BUILT:
        assert compiled
        assert MODULE.split(".")[-1] + "_kernel" in line


# ------------------------------------------------------------------ what engines send


def test_the_reports_engines_send_are_read_by_the_compiled_path() -> None:
    """vLLM's own report, the benchmarks' fleet stream and the project's encoder's
    reports are vouched for (not left to the full decoder), each the pure path's record."""
    frames = [REAL_STATS_FRAME, *fleet_stream(8, 64)]
    stats = protocol.SchedulerStats(num_running_reqs=3, num_waiting_reqs=70000, kv_cache_usage=0.5)
    for index in (0, 7, 300, U64):
        out = protocol.EngineCoreOutputs(engine_index=index, scheduler_stats=stats, timestamp=1.0)
        frames.append(protocol.encode_engine_core_outputs(out))
    for frame in frames:
        record = assert_twins_agree(frame)
        assert record is not None
        assert record == PURE.ingest_with_msgpack(frame)
    assert FAST.decode_ingest_stats(REAL_STATS_FRAME) == (2, 3, 12, 0.4375, 5, 17)


def test_wave_reports_and_request_batches_go_to_the_full_decoder() -> None:
    for vector in VECTORS:
        if vector["name"] in ("eco_wave_complete", "eco_start_wave", "eco_normal_output_batch"):
            frame = bytes.fromhex(vector["frames_hex"][0])
            assert FAST.decode_ingest_stats(frame) is None
            assert assert_twins_agree(frame) is None


def test_what_is_not_bytes_is_refused() -> None:
    for value in (bytearray(REAL_STATS_FRAME), memoryview(REAL_STATS_FRAME), None, 3, ""):
        assert FAST.decode_ingest_stats(value) is None
        assert PURE.decode_ingest_stats(value) is None


# ------------------------------------------------------------------ msgpack variants


def _uint(value: int, width: str) -> bytes:
    """``value`` (>= 0) in the msgpack int encoding ``width``, where it fits (else the
    narrowest)."""
    fits = {
        "fix": (0x7F, b"", ""),
        "u8": (0xFF, b"\xcc", ">B"),
        "u16": (0xFFFF, b"\xcd", ">H"),
        "u32": (0xFFFFFFFF, b"\xce", ">I"),
        "u64": (U64, b"\xcf", ">Q"),
        "i8": (0x7F, b"\xd0", ">b"),
        "i16": (0x7FFF, b"\xd1", ">h"),
        "i32": (0x7FFFFFFF, b"\xd2", ">i"),
        "i64": (2**63 - 1, b"\xd3", ">q"),
    }
    limit, tag, fmt = fits[width]
    if value > limit:
        return bytes(msgpack.packb(value))
    return bytes([value]) if width == "fix" else tag + struct.pack(fmt, value)


def _int(value: int, width: str) -> bytes:
    if value >= 0:
        return _uint(value, width)
    return bytes(msgpack.packb(value))  # negative: msgpack's own narrowest


def _str(text: str, header: str) -> bytes:
    data = text.encode()
    n = len(data)
    if header == "fix" and n < 32:
        return bytes([0xA0 | n]) + data
    if header == "str8" and n < 256:
        return b"\xd9" + bytes([n]) + data
    if header == "str16":
        return b"\xda" + struct.pack(">H", n) + data
    return b"\xdb" + struct.pack(">I", n) + data


def _float(value: float, width: int) -> bytes:
    """float32 (rounded) where asked and in its range, else float64."""
    if width == 32 and not abs(value) > 3.4e38:
        return b"\xca" + struct.pack(">f", value)
    return b"\xcb" + struct.pack(">d", value)


def _map_header(count: int, header: str) -> bytes:
    if header == "fix" and count < 16:
        return bytes([0x80 | count])
    if header == "map16":
        return b"\xde" + struct.pack(">H", count)
    return b"\xdf" + struct.pack(">I", count)


int_widths = st.sampled_from(["fix", "u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64"])
counts = st.integers(0, 130) | st.integers(0, U64) | st.integers(-(2**63), -1)
floats = st.floats(width=32) | st.floats()
READ_KEYS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "step_counter",
    "current_wave",
    "kv_cache_usage",
)
OTHER_KEYS = [k for k in real_stats() if k not in READ_KEYS]
plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), U64) | floats | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)


@st.composite
def variant_frames(draw: st.DrawFn) -> bytes:
    """A stats-only report written byte by byte in any of msgpack's encodings of it,
    sometimes with a field of another type, a nil where a value goes, a key repeated."""
    pairs: list[bytes] = []
    read = {
        "num_running_reqs": counts,
        "num_waiting_reqs": counts,
        "step_counter": counts,
        "current_wave": counts,
    }
    for key in draw(st.permutations([*read, "kv_cache_usage", *OTHER_KEYS])):
        if draw(st.integers(0, 9)) == 0:
            continue  # left out: its default
        header = draw(st.sampled_from(["fix", "str8", "str16", "str32"]))
        if key in read:
            value = _int(draw(read[key]), draw(int_widths))
        elif key == "kv_cache_usage":
            value = _float(draw(floats), draw(st.sampled_from([32, 64])))
        else:
            value = bytes(msgpack.packb(draw(plain)))
        if draw(st.integers(0, 15)) == 0:  # an odd value: nil, bool, str, negative
            value = bytes(msgpack.packb(draw(st.none() | st.booleans() | st.text(max_size=2))))
        pairs.append(_str(key, header) + value)
        if draw(st.integers(0, 20)) == 0:
            pairs.append(pairs[-1])  # repeated
    for _ in range(draw(st.integers(0, 2))):  # keys of a newer vLLM
        pairs.append(_str(draw(st.text(max_size=20)), "fix") + bytes(msgpack.packb(draw(plain))))
    header = draw(st.sampled_from(["fix", "map16", "map32"]))
    stats = _map_header(len(pairs), header) + b"".join(pairs)
    slots = [
        _uint(draw(st.integers(0, 9) | st.just(U64)), draw(int_widths)),
        b"\x90",
        stats,
        _float(draw(floats), draw(st.sampled_from([32, 64]))),
        *[b"\xc0"] * 5,
    ]
    if draw(st.integers(0, 6)) == 0:  # a slot of another kind
        at = draw(st.integers(0, 8))
        slots[at] = bytes(msgpack.packb(draw(plain)))
    return b"\x99" + b"".join(slots)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A report engines send, with a few bytes flipped, cut, inserted or cut off."""
    data = bytearray(draw(st.sampled_from([REAL_STATS_FRAME, *fleet_stream(2, 4)])))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        how = draw(st.sampled_from(["set", "flip", "cut", "insert", "truncate"]))
        if how == "set":
            data[at] = draw(st.integers(0, 255))
        elif how == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "cut":
            del data[at]
        elif how == "insert":
            data.insert(at, draw(st.integers(0, 255)))
        else:
            del data[at:]
        if not data:
            break
    return bytes(data)


@st.composite
def values_in_place(draw: st.DrawFn) -> bytes:
    """A report engines send with other bytes where its read values and its timestamp
    are (the bytes a learnt layout reads, some no longer in the layout's encoding)."""
    data = bytearray(draw(st.sampled_from([REAL_STATS_FRAME, *fleet_stream(2, 4)])))
    starts = [1, len(data) - 13]  # the engine index, the timestamp's float64
    for key in READ_KEYS:  # a value's tag, and its bytes after a tag
        starts += [data.index(key.encode()) + len(key) + skip for skip in (0, 1)]
    for start in draw(st.lists(st.sampled_from(starts), min_size=1, max_size=4)):
        width = draw(st.sampled_from([1, 1, 2, 4, 8, 9]))
        data[start : start + width] = draw(st.binary(min_size=width, max_size=width))
    return bytes(data)


@SETTINGS
@given(values_in_place())
def test_the_twins_agree_on_values_in_place(frame: bytes) -> None:
    for base in (REAL_STATS_FRAME, *fleet_stream(2, 4)):
        assert_twins_agree(base)  # their layouts learnt
    assert_twins_agree(frame)


def test_the_layouts_path_reads_reports_by_their_layout() -> None:
    """Once a layout is learnt, the reports that fit it never reach the msgpack path."""
    frames = fleet_stream(8, 64)
    expected = [PURE.ingest_with_msgpack(frame) for frame in frames]
    assert PURE.ingest_with_layouts(frames[0]) == expected[0]
    count = PURE._layout_count
    with calls_of(PURE.ingest_with_msgpack) as msgpack_path:
        read = [PURE.ingest_with_layouts(frame) for frame in frames]
    assert read == expected
    assert msgpack_path == []
    assert PURE._layout_count == count


@SETTINGS
@given(variant_frames())
@example(b"\x99\x00\x90\x80\xcb" + bytes(8) + b"\xc0" * 5)  # the shortest: an empty map
@example(b"\x99\x00\x90\x80\xca" + bytes(4) + b"\xc0" * 5)
def test_the_twins_agree_on_msgpack_variants(frame: bytes) -> None:
    assert_twins_agree(frame)


@SETTINGS
@given(mutated_frames())
def test_the_twins_agree_on_mutated_reports(frame: bytes) -> None:
    assert_twins_agree(frame)


@SETTINGS
@given(coordinator_frames())
def test_the_twins_agree_on_hostile_frames(frame: bytes) -> None:
    assert_twins_agree(frame)


@SETTINGS
@given(fuzz_frames())
def test_the_twins_agree_on_the_fuzz_corpus(frame: bytes) -> None:
    assert_twins_agree(frame)


@given(eco_strategy)
def test_the_twins_agree_on_every_encodable_message(out: protocol.EngineCoreOutputs) -> None:
    assert_twins_agree(protocol.encode_engine_core_outputs(out))


@given(st.binary(max_size=64))
def test_the_twins_agree_on_random_bytes(frame: bytes) -> None:
    assert_twins_agree(frame)
    assert_twins_agree(b"\x99" + frame)


def test_the_twins_agree_on_the_vllm_vectors() -> None:
    frames = [bytes.fromhex(h) for v in VECTORS for h in v["frames_hex"]]
    assert len(frames) > 25
    for frame in frames:
        assert_twins_agree(frame)


def test_the_twins_agree_on_msgspecs_encoding() -> None:
    """The reports as vLLM's engines write them (msgspec, the narrowest encodings)."""
    msgspec = pytest.importorskip("msgspec")
    encode = msgspec.msgpack.encode
    for running in (0, 1, 127, 128, 255, 256, 65535, 65536, 2**32, U64):
        stats = {**real_stats(), "num_running_reqs": running, "step_counter": running}
        frame = encode([running % 9, [], stats, 12.5, None, None, None, None, None])
        record = assert_twins_agree(frame)
        if IN_USE:
            assert record is not None
            assert record[2] == running
