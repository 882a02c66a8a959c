"""The engine client's decoder of engine outputs: both paths (msgspec, msgpack-python) say
exactly what the full decoder says (``decode_engine_core_outputs``: the request outputs'
ids, token ids and finish reasons, and the utility answer), the same values or the same
ProtocolError message, on every kind of frame of ``tests/protocol/decoder_contract.py`` (the
generated ones with odd values in every slot of the request outputs)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.protocol.decoder_contract import (
    Contract,
    Ext,
    RawStr,
    Wide,
    calls_of,
    client_frames,
    contract_tests,
    real_stats,
    vector_frame,
    without_msgspec,
    write,
)
from tests.protocol.wire import U64
from trio_dpcoord import protocol
from trio_dpcoord.protocol import (
    CLIENT_OUTPUT_DECODER,
    EngineDead,
    ProtocolError,
    decode_client_frames,
    decode_client_output,
    decode_client_output_with_msgpack,
    decode_client_output_with_msgspec,
)


def reduced(outputs: Any, utility: object) -> object:
    return [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs], utility


def _reference(frame: bytes) -> object:
    out = protocol.decode_engine_core_outputs(frame)
    return reduced(out.outputs, out.utility_output)


def _reduce(decoded: Any) -> object:
    outputs, utility = decoded
    for output in outputs:  # what the client relies on, whichever path
        assert type(output.new_token_ids) is tuple
    return reduced(outputs, utility)


CLIENT = Contract(
    "client",
    {
        "msgpack": decode_client_output_with_msgpack,
        "msgspec": decode_client_output_with_msgspec,
    },
    _reference,
    _reduce,
    client_frames(),
)


TestClientContract = contract_tests(CLIENT)


def test_the_vllm_vectors_decode_to_their_values() -> None:
    for decode in CLIENT.paths.values():
        outputs, utility = decode(vector_frame("eco_normal_output_batch"))
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
    CLIENT.assert_paths_agree(data)
    assert (CLIENT.expected(data)[0] != "ProtocolError") == accepted


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
    assert without_msgspec(script) == ["msgpack", "a", [4], 1]
