"""The engine client's decoder of engine outputs: both paths (msgspec, msgpack-python) say
exactly what the full decoder says (``decode_engine_core_outputs``: the request outputs'
ids, token ids and finish reasons, and the utility answer), the same values or the same
ProtocolError message, on the fuzz corpus, the vLLM vectors, every encodable message
and generated frames built to find where a typed msgspec decode could be looser than
msgpack-python (the raw writer and hostile values of the coordinator decoder's tests,
in every slot of the request outputs)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.fuzz_codec import frames as fuzz_frames
from tests.conftest import VECTORS_PATH
from tests.test_coordinator_decoder import (
    Ext,
    RawStr,
    Wide,
    calls_of,
    hostile,
    real_stats,
    stats_maps,
    write,
)
from tests.test_protocol import U64, eco_strategy, msgpack_values, pack
from trio_dpcoord import protocol
from trio_dpcoord.protocol import (
    CLIENT_OUTPUT_DECODER,
    ClientOutput,
    EngineDead,
    ProtocolError,
    decode_client_frames,
    decode_client_output,
    decode_client_output_with_msgpack,
    decode_client_output_with_msgspec,
)

Outcome = tuple[list[tuple[str, tuple[int, ...], int | None]], object] | tuple[str, str]

PATHS: dict[str, Callable[[bytes], ClientOutput]] = {
    "msgpack": decode_client_output_with_msgpack,
    "msgspec": decode_client_output_with_msgspec,
}


def reduced(outputs: Any, utility: object) -> Outcome:
    return [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs], utility


def full(frame: bytes) -> Outcome:
    """The reference, with the error's message: what the client logs and counts."""
    try:
        out = protocol.decode_engine_core_outputs(frame)
    except ProtocolError as exc:
        return ("ProtocolError", str(exc))
    return reduced(out.outputs, out.utility_output)


def outcome(decode: Callable[[bytes], ClientOutput], frame: bytes) -> Outcome:
    try:
        outputs, utility = decode(frame)
    except ProtocolError as exc:
        return ("ProtocolError", str(exc))
    for output in outputs:  # what the client relies on, whichever path
        assert type(output.new_token_ids) is tuple
    return reduced(outputs, utility)


def assert_both_paths_agree(frame: bytes) -> None:
    expected = full(frame)
    for name, decode in PATHS.items():
        assert outcome(decode, frame) == expected, (name, frame.hex())


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


SETTINGS = settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(client_frames())
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
    batch = {v["name"]: bytes.fromhex(v["frames_hex"][0]) for v in vectors}[
        "eco_normal_output_batch"
    ]
    for decode in PATHS.values():
        outputs, utility = decode(batch)
        assert outputs and utility is None
        assert all(type(o.request_id) is str for o in outputs)


def output(rid: str, token_ids: list[int], finish: int | None = None, **slots: Any) -> list[Any]:
    """A 19-slot ``EngineCoreOutput`` as vLLM 0.33.0 writes it."""
    array: list[Any] = [rid, token_ids, None, None, None, finish]
    array += [None, None, None, None, None, None, None, 0, None, None, None, None, None]
    for index, value in slots.items():
        array[int(index.removeprefix("slot"))] = value
    return array


def frame(outputs: list[Any], stats: Any = None, utility: Any = None, *extra: Any) -> bytes:
    return write([1, outputs, stats, 1.5, utility, None, None, None, "default", *extra])


@pytest.mark.parametrize(
    ("data", "accepted"),
    [
        (frame([output("a", [1]), output("b", [2, 3], 1)]), True),
        (frame([output("a", [1])], real_stats()), True),  # stats ride along
        (frame([output("a", [1])], {**real_stats(), "new_key": [1]}), True),  # a newer vLLM
        (frame([output("a", [1])], {**real_stats(), "kv_cache_usage": float("nan")}), False),
        (frame([output("a", [1])], {"new_key": 1, "num_running_reqs": -1}), False),
        (frame([], None, [7, None, [None, {"k": [1, 2]}]]), True),  # a utility answer
        (frame([], None, [7, None, [None, [[[[1]]]]]]), True),  # deep: the msgpack path's
        (frame([output("a", [1], slot6=17)]), True),  # a stop token id
        (frame([output("a", [1], slot6="stop")]), True),  # a stop string
        (frame([output("a", [1], slot2=[[[0.5]], [[1]], [0]])]), True),  # logprobs lists
        (frame([output("a", [1], slot4=Ext(1, b"tensor"))]), True),  # an ext value
        (frame([output("a", [1], slot8={1: 2})]), False),  # a non-string key
        (frame([output("a", [1], slot8=RawStr(b"\xff"))]), False),  # bad UTF-8
        (frame([output("a", [1], slot8={b"bin": 1})]), True),
        (frame([output("a", [True])]), False),  # a bool token id
        (frame([output("a", [-1])]), False),
        (frame([output("a", [U64])]), True),
        (frame([output("a", [1], -1)]), False),
        (frame([output("a", [1], True)]), False),
        (frame([output("a", [1], 9)]), True),  # a finish reason beyond vLLM's five
        (frame([["a"]]), False),  # an output of one slot
        (frame([["a", [1]]]), True),  # two slots: the rest default
        (frame([[RawStr(b"\xc3"), [1]]]), False),
        (frame([output("a", [1])], None, None, None), True),  # a 10th slot, harmless
        (frame([output("a", [1])], None, None, {2: 3}), False),  # a 10th slot, malformed
        (write(Wide([1, [output("a", [1])], None, 1.5])), True),
        (write([]), True),
        (b"", False),
        (b"\x99", False),
    ],
)
def test_both_paths_agree_on_the_edges(data: bytes, accepted: bool) -> None:
    assert_both_paths_agree(data)
    assert (full(data)[0] != "ProtocolError") == accepted


def test_the_msgspec_path_reads_what_engines_send_by_itself() -> None:
    """vLLM's request batches (with or without stats, of 0.32.0's or 0.33.0's width) and
    utility answers never reach the msgpack path: msgspec reads them."""
    decode = decode_client_output_with_msgspec
    batch = frame([output("a", [5]), output("b", [6, 7], 1)], real_stats())
    short = frame([output("a", [5])[:17]], {**real_stats(), "new_key": {"a": [1]}})
    answer = frame([], None, [3, None, [None, {"ok": True}]])
    with calls_of(decode_client_output_with_msgpack) as msgpack_path:
        assert reduced(*decode(batch)) == ([("a", (5,), None), ("b", (6, 7), 1)], None)
        assert reduced(*decode(short)) == ([("a", (5,), None)], None)
        assert reduced(*decode(answer)) == ([], [3, None, [None, {"ok": True}]])
    assert msgpack_path == []


def test_the_dead_marker_and_empty_messages() -> None:
    assert isinstance(decode_client_frames([protocol.ENGINE_CORE_DEAD]), EngineDead)
    with pytest.raises(ProtocolError, match="empty message"):
        decode_client_frames([])
    # further frames carry tensors: the first is read
    outputs, _ = decode_client_frames([frame([output("a", [1])]), b"tensor"])  # type: ignore[misc]
    assert [o.request_id for o in outputs] == ["a"]


def test_the_client_uses_the_msgspec_path_when_installed_and_msgpack_otherwise() -> None:
    assert CLIENT_OUTPUT_DECODER == "msgspec"
    assert decode_client_output is not decode_client_output_with_msgpack
    script = (
        "import sys; sys.modules['msgspec'] = None\n"
        "import json\n"
        "from trio_dpcoord import protocol as p\n"
        f"frame = bytes.fromhex({frame([output('a', [4], 1)]).hex()!r})\n"
        "assert p.decode_client_output is p.decode_client_output_with_msgpack\n"
        "try:\n"
        "    p.decode_client_output_with_msgspec(frame)\n"
        "except RuntimeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('msgspec path without msgspec')\n"
        "outputs, utility = p.decode_client_output(frame)\n"
        "o = outputs[0]\n"
        "print(json.dumps([p.CLIENT_OUTPUT_DECODER, o.request_id, list(o.new_token_ids),"
        " o.finish_reason]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["msgpack", "a", [4], 1]
