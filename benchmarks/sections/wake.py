"""Section 2, ``wake``: wake latency, from a ``start_wave`` (or ``notify_first_request``)
to the last of N engines holding START_DP_WAVE, beside the forwarder and vLLM's coordinator
measured in the same interleaved chunks (:func:`benchmarks.shared.scenarios.wake_compare`)."""

from __future__ import annotations

from typing import Any

from benchmarks.shared import scenarios as sc
from benchmarks.shared.suite import TRIO_FLOOR_NOTE, VLLM_LABEL, Row, Suite
from trio_dpcoord import hot_path_build

VLLM_WAKE_TARGETS = {"p50": 1.25, "p99": 1.0, "cpu_per_wave_us": 1.5}
"""Our targets at N = 8, standalone, as ratios to vLLM's coordinator measured in the same
run (issue 45): wake p50 <= 1.25x, p99 <= 1.0x, CPU per wave <= 1.5x."""


def run_section(suite: Suite) -> None:
    s = suite.sizes
    for n in s.wake_engines:
        variants: dict[str, tuple[str, ...]] = {
            "forwarder": ("start_wave",),
            "inproc": ("start_wave", "notify_first_request"),
        }
        if suite.standalone_reason:
            suite.skipped("2 wake", f"N={n} standalone", suite.standalone_reason)
        else:
            variants["standalone"] = ("start_wave",)
        if not suite.vllm_reason:
            variants[sc.VLLM] = ("start_wave",)
            if n == 8:
                for floor in sc.TRIO_FLOORS:
                    variants[floor] = ("start_wave",)
                if "standalone" in variants and hot_path_build() == "compiled":
                    variants[sc.STANDALONE_PURE] = ("start_wave",)
        result = sc.wake_compare(suite.env, n, s.waves, variants)
        suite.details[f"wake_{n}"] = result
        wake_rows(suite, n, result)


def wake_rows(suite: Suite, n: int, result: dict[str, dict[str, Any]]) -> None:
    """The rows of one N's measurements (``result``: label -> statistics, as saved in
    a record's details), so that a record's rows can be derived again from them."""
    base = result["forwarder start_wave"]
    for label, values in result.items():
        if label.startswith(("forwarder", sc.VLLM, sc.STANDALONE_PURE, *sc.TRIO_FLOORS)):
            continue
        for stat, limit in (("p50", 2.0), ("p99", 3.0), ("max", None)):
            row = Row(
                "2 wake",
                f"N={n} {label} {stat}",
                values[stat],
                "us",
                base[stat],
                "forwarder",
            )
            if n == 8 and limit is not None:
                row.target = f"<= {limit:g}x"
                row.met = row.ratio is not None and row.ratio <= limit
            suite.rows.append(row)
    wake_vs_vllm(suite, n, result)


def wake_vs_vllm(suite: Suite, n: int, result: dict[str, dict[str, Any]]) -> None:
    """Standalone (and the embedded notify path) against vLLM's engine-initiated wake,
    measured in the same interleaved chunks."""
    if suite.vllm_reason:
        suite.skipped("2 wake", f"N={n} vs vLLM", suite.vllm_reason)
        return
    base = result[f"{sc.VLLM} start_wave"]
    floors = [f"{floor} start_wave" for floor in sc.TRIO_FLOORS]
    pure = f"{sc.STANDALONE_PURE} start_wave"
    for label in ("standalone start_wave", pure, "inproc notify_first_request", *floors):
        if label not in result:
            continue
        stats = ["p50", "p99", "max"]
        if n == 8 and label != "inproc notify_first_request":
            stats.append("cpu_per_wave_us")
        for stat in stats:
            row = Row(
                "2 wake",
                f"N={n} {label} {_STAT_NAMES.get(stat, stat)} vs vLLM",
                result[label][stat],
                "us",
                base[stat],
                f"{VLLM_LABEL} start_wave",
            )
            limit = (
                VLLM_WAKE_TARGETS.get(stat)
                if label == "standalone start_wave"
                else (0.5 if stat == "p50" and label.startswith("inproc") else None)
            )
            if label in floors:
                row.note = TRIO_FLOOR_NOTE
            elif label == pure:
                row.note = "the pure-Python twins (TRIO_DPCOORD_PURE_PYTHON=1)"
            elif n == 8 and limit is not None:
                row.target = f"<= {limit:g}x"
                row.met = row.ratio is not None and row.ratio <= limit
            suite.rows.append(row)


_STAT_NAMES = {"cpu_per_wave_us": "CPU per wave"}
"""Row names of the statistics that are not percentiles."""
