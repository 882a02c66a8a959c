"""The committed vectors (tests/data/vectors.json) are still what vLLM 0.33.0's code makes,
and our codec reads and writes every one of them.

Regenerates every vector at test time with vLLM's real code (see
``tests/vllm_reference/make_vectors.py``): ``MsgpackEncoder`` over ``EngineCoreOutputs``,
``EngineCoreOutput``, ``UtilityOutput``, ``SchedulerStats`` and ``EngineCoreRequest``;
``DPCoordinatorProc._send_start_wave``; ``EngineCoreRequestType``; the byte literals in
vLLM's sources; and the live ``DPCoordinatorProc`` process for the ``live_*`` vectors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import VECTORS_PATH
from tests.protocol.test_vllm_frames import CHECKS
from tests.vllm_reference import make_vectors

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def fresh_vectors(vllm_root: Path) -> list[dict[str, Any]]:
    return make_vectors.generate(vllm_root)


def test_the_committed_vectors_are_vllms_bytes(fresh_vectors: list[dict[str, Any]]) -> None:
    committed = json.loads(VECTORS_PATH.read_text())
    assert make_vectors.differences(committed, fresh_vectors) == []
    assert len(committed) == len(CHECKS) == 25


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_our_codec_reads_and_writes_vllms_fresh_vector(
    fresh_vectors: list[dict[str, Any]], name: str
) -> None:
    (vector,) = [v for v in fresh_vectors if v["name"] == name]
    CHECKS[name](vector)
