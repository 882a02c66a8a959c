"""What the tests of the two fast decoders of engine outputs share (the coordinator's,
``tests/protocol/test_coordinator_decoder.py``, and the engine client's,
``tests/protocol/test_client_decoder.py``): the contract both keep (each path, msgspec and
msgpack-python, says exactly what the full decoder says, the same value or the same
ProtocolError message), the frames they are held to it on (the fuzz corpus, the vLLM
vectors, every encodable message, arbitrary msgpack, and frames generated to find where a
typed msgspec decode could be looser than msgpack-python: non-string keys, bad UTF-8, ext
and bin values, deep nesting, duplicate keys, wide encodings, slots past the ninth), and
the raw msgpack writer that makes them."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.fuzz_codec import frames as fuzz_frames
from tests.conftest import VECTORS_PATH
from tests.protocol.wire import U64, eco_strategy, msgpack_values, pack
from trio_dpcoord import protocol
from trio_dpcoord.protocol import ProtocolError

SETTINGS = settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Contract:
    """A fast decoder held to the full decoder: its paths, the reference answer (the full
    decoder's, reduced to what the fast one returns; raises ProtocolError), how a path's
    answer is reduced the same way, and the frames generated for it."""

    name: str
    paths: dict[str, Callable[[bytes], Any]]
    reference: Callable[[bytes], object]
    reduce: Callable[[Any], object]
    frames: st.SearchStrategy[bytes]

    def expected(self, frame: bytes) -> Any:
        """The reference, with the error's message: what the caller logs and counts."""
        try:
            return self.reference(frame)
        except ProtocolError as exc:
            return ("ProtocolError", str(exc))

    def outcome(self, decode: Callable[[bytes], Any], frame: bytes) -> Any:
        try:
            return self.reduce(decode(frame))
        except ProtocolError as exc:
            return ("ProtocolError", str(exc))

    def assert_paths_agree(self, frame: bytes) -> None:
        expected = self.expected(frame)
        for name, decode in self.paths.items():
            assert self.outcome(decode, frame) == expected, (self.name, name, frame.hex())


def contract_tests(contract: Contract) -> type:
    """A class of the properties every fast decoder keeps, on every kind of frame, for
    ``contract``: a test file binds it to a ``Test...`` name. A fresh class per contract
    (hypothesis keys its examples by test function: two contracts must not share one)."""

    class ContractTests:
        @SETTINGS
        @given(data=st.data())
        def test_paths_agree_on_generated_frames(self, data: st.DataObject) -> None:
            contract.assert_paths_agree(data.draw(contract.frames))

        @SETTINGS
        @given(frame=fuzz_frames())
        def test_paths_agree_on_the_fuzz_corpus(self, frame: bytes) -> None:
            contract.assert_paths_agree(frame)

        @given(out=eco_strategy)
        def test_paths_agree_on_every_encodable_message(
            self, out: protocol.EngineCoreOutputs
        ) -> None:
            contract.assert_paths_agree(protocol.encode_engine_core_outputs(out))

        @given(value=msgpack_values)
        def test_paths_agree_on_arbitrary_msgpack(self, value: Any) -> None:
            contract.assert_paths_agree(pack(value))

        def test_paths_agree_on_the_vllm_vectors(self) -> None:
            frames = [bytes.fromhex(h) for v in VECTORS for h in v["frames_hex"]]
            assert len(frames) > 25
            for frame in frames:
                contract.assert_paths_agree(frame)

    ContractTests.__qualname__ = ContractTests.__name__ = f"Test{contract.name.title()}Contract"
    return ContractTests


def without_msgspec(script: str) -> Any:
    """What ``script`` prints (one JSON value) in a process where msgspec cannot be
    imported, as on a machine without the ``fast`` extra."""
    result = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['msgspec'] = None\n" + script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


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


VECTORS: list[dict[str, Any]] = json.loads(VECTORS_PATH.read_text())


def vector_frame(name: str) -> bytes:
    """The first frame of the vLLM vector ``name`` (tests/data/vectors.json)."""
    return bytes.fromhex(next(v for v in VECTORS if v["name"] == name)["frames_hex"][0])


REAL_STATS_FRAME = vector_frame("eco_scheduler_stats_moe")


def real_stats() -> dict[str, Any]:
    """vLLM 0.33.0's stats map as its engines send it (tests/data/vectors.json), a copy."""
    stats: dict[str, Any] = msgpack.unpackb(REAL_STATS_FRAME)[2]
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


# ------------------------------------------------------------------ the client's frames


tokens = st.lists(st.integers(0, 5) | st.just(U64), max_size=3) | hostile
"""Token id lists, sometimes odd (negative, bools, floats, nested...)."""


@st.composite
def output_arrays(draw: st.DrawFn) -> Any:
    """An ``EngineCoreOutput`` array as vLLM writes it (19 slots, 0.33.0; a prefix of
    them from 0.32.0), some slots odd."""
    slots: list[Any] = [None] * 19
    slots[13] = 0  # num_nans_in_logits
    slots[0] = draw(st.text(max_size=6) | hostile)
    slots[1] = draw(tokens)
    slots[5] = draw(st.none() | st.integers(0, 6) | hostile)
    for index in draw(st.lists(st.sampled_from([2, 3, 4, *range(6, 19)]), max_size=3)):
        slots[index] = draw(hostile)
    slots = slots[: draw(st.integers(0, 19))] if draw(st.booleans()) else slots
    return Wide(slots) if draw(st.booleans()) else slots


@st.composite
def client_frames(draw: st.DrawFn) -> bytes:
    """Frames shaped like what engines send a front-end, each slot sometimes odd."""
    slots: list[Any] = [
        draw(st.integers(0, 8) | st.just(U64) | hostile),
        draw(st.lists(output_arrays(), max_size=3) | hostile),
        draw(st.none() | stats_maps() | hostile),
        draw(st.floats() | st.integers(0, 10) | st.floats(width=32).map(Wide) | hostile),
        draw(st.none() | st.just([3, None, [None, [1, "a"]]]) | hostile),
        draw(st.none() | st.lists(st.text(max_size=4), max_size=2) | hostile),
        draw(st.none() | st.integers(0, 9) | hostile),
        draw(st.none() | st.integers(0, 9) | hostile),
        draw(st.none() | st.just("default") | hostile),
    ]
    slots = slots[: draw(st.integers(0, 9))] if draw(st.booleans()) else slots
    if draw(st.booleans()):
        slots += draw(st.lists(hostile, min_size=1, max_size=3))  # past the ninth slot
    return write(Wide(slots) if draw(st.booleans()) else slots)
