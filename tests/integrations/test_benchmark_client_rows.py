"""The engine-client benchmark's rows (benchmarks/sections/client.py): each figure is the
median of a subject's passes (not its best), CPU per request counts vLLM's coordinator
process beside its client, and the pure twin has rows of its own."""

from __future__ import annotations

from typing import Any

from benchmarks.sections.client import (
    OURS,
    OURS_PURE,
    SUBJECTS,
    VLLM,
    client_rows,
    ratio_interval,
)


def _pass(kind: str, seconds: float, cpu_s: float, ttft_s: float) -> dict[str, Any]:
    return {
        "client": "vLLM DPLBAsyncMPClient" if kind == VLLM else "trio_dpcoord",
        "requests": 100,
        "seconds": seconds,
        "ttft_s": [ttft_s] * 100,
        "cpu_s": cpu_s,
        "coordinator_cpu_s": 0.01 if kind == VLLM else None,
        "requests_by_rank": [50, 50],
        "waves": 2,
    }


def _passes() -> dict[str, list[dict[str, Any]]]:
    # five passes each, one of them far faster and cheaper than the rest (a lucky pass)
    cpus = {OURS: [0.02, 0.03, 0.01, 0.04, 0.05], OURS_PURE: [0.06, 0.04, 0.05, 0.07, 0.08]}
    cpus[VLLM] = [0.03, 0.02, 0.04, 0.05, 0.06]
    seconds = [2.0, 4.0, 1.0, 5.0, 8.0]
    return {
        kind: [
            _pass(kind, s, c, t)
            for s, c, t in zip(seconds, cpus[kind], [0.1, 0.2, 0.05, 0.3, 0.4], strict=True)
        ]
        for kind in SUBJECTS
    }


def test_every_figure_is_the_median_of_the_passes_with_the_best_in_the_note() -> None:
    rows = {row.figure.split(" (")[0]: row for row in client_rows(_passes(), "a load")}
    rate = rows["requests/s"]
    assert rate.value == rate.baseline == 100 / 4.0  # the median pass, not 100 / 1.0
    assert "median of 5 passes: a load" in rate.figure
    assert f"{OURS} best 100" in rate.note
    cpu = rows["CPU per request, client process"]
    assert cpu.value == 0.03 / 100 * 1000
    assert cpu.baseline == 0.04 / 100 * 1000
    assert f"{OURS} best 0.1," in cpu.note
    both = rows["CPU per request, client + DP coordinator"]
    assert both.value == cpu.value  # ours: the coordinator is inside the client process
    assert both.baseline == (0.04 + 0.01) / 100 * 1000  # vLLM's: client + coordinator
    assert rows["TTFT p99"].value == 200.0


def test_the_pure_twin_has_rows_beside_vllm() -> None:
    rows = {row.figure: row for row in client_rows(_passes(), "a load")}
    pure = rows["CPU per request, client + DP coordinator, pure twin (TRIO_DPCOORD_PURE_PYTHON=1)"]
    assert pure.value == 0.06 / 100 * 1000
    assert pure.baseline == (0.04 + 0.01) / 100 * 1000
    assert rows["requests/s, pure twin (TRIO_DPCOORD_PURE_PYTHON=1)"].value == 100 / 4.0
    assert "TTFT p99, pure twin (TRIO_DPCOORD_PURE_PYTHON=1)" in rows


def test_a_goals_ratio_has_its_bootstrap_interval_in_the_note() -> None:
    rows = {row.figure.split(" (")[0]: row for row in client_rows(_passes(), "a load")}
    # the same passes on both sides for req/s: the interval holds 1.0x
    assert "bootstrap interval over the passes" in rows["requests/s"].note
    low, high = ratio_interval([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0])
    assert low < 1.0 < high
    # a fixed seed: the same passes give the same interval
    assert ratio_interval([3.0, 1.0, 2.0], [2.0, 2.5]) == ratio_interval(
        [3.0, 1.0, 2.0], [2.0, 2.5]
    )


def test_a_clear_difference_has_an_interval_clear_of_one() -> None:
    ours = [2.0, 2.1, 1.9, 2.2, 2.0, 1.8]
    theirs = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0]
    low, high = ratio_interval(ours, theirs)
    assert 1.5 < low <= 2.0 <= high < 2.5
