"""Section 7, ``saturation``: the largest fleet a coordinator keeps up with per report
interval (ours standalone, default settings, and vLLM's, under the same fleet generator:
:mod:`benchmarks.programs.fleet`)."""

from __future__ import annotations

import logging
import traceback
from typing import Any

from benchmarks.shared import scenarios as sc
from benchmarks.shared.suite import VLLM_LABEL, Row, Suite

logger = logging.getLogger("benchmarks.saturation")


def run_section(suite: Suite) -> None:
    """The sweep: per (interval, N), ours (standalone, default settings) and vLLM's,
    one after the other, under the same fleet generator; then the largest N kept up
    per interval, ours against vLLM's."""
    s = suite.sizes
    kinds = [] if suite.standalone_reason else [sc.STANDALONE]
    if not suite.vllm_reason:
        kinds.append(sc.VLLM)
    if not kinds:
        suite.skipped("7 saturation", "sweep", suite.standalone_reason or "")
        return
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for interval, n in s.saturation_points:
        key = f"{n}@{interval:g}ms"
        results[key] = {}
        for kind in kinds:
            try:
                report = sc.saturation_point(suite.env, kind, n, interval, s.saturation_seconds)
            except Exception as exc:
                logger.error("saturation %s %s failed:\n%s", key, kind, traceback.format_exc())
                report = {"failed": f"{exc!r}"[:160]}
            else:
                report["kept_up"] = sc.kept_up(report)
            results[key][kind] = report
    suite.details["saturation"] = results
    for interval, n in s.saturation_points:
        _saturation_rows(suite, interval, n, results[f"{n}@{interval:g}ms"])
    for interval in sorted({i for i, _ in s.saturation_points}):
        largest = {
            kind: max(
                (
                    n
                    for i, n in s.saturation_points
                    if i == interval and results[f"{n}@{i:g}ms"][kind].get("kept_up")
                ),
                default=0,
            )
            for kind in kinds
        }
        tried = [n for i, n in s.saturation_points if i == interval]
        row = Row(
            "7 saturation",
            f"largest fleet kept up at {interval:g} ms",
            float(largest.get(sc.STANDALONE, 0)),
            "engines",
            float(largest.get(sc.VLLM, 0)) or None,
            VLLM_LABEL,
            note=f"tried N = {', '.join(map(str, tried))}",
        )
        if interval == 20:
            row.target = ">= 1.5x"
            row.met = row.ratio is not None and row.ratio >= 1.5
        if interval == 100 and 2048 in tried:
            row.target = "2048"
            row.met = largest.get(sc.STANDALONE, 0) >= 2048
        suite.rows.append(row)


def _saturation_rows(
    suite: Suite, interval: float, n: int, point: dict[str, dict[str, Any]]
) -> None:
    ours, base = point.get(sc.STANDALONE, {}), point.get(sc.VLLM, {})
    prefix = f"N={n} @{interval:g} ms"
    if "failed" in ours or not ours:
        note = ours.get("failed", "skipped")
        suite.rows.append(Row("7 saturation", prefix, None, "", note=f"failed: {note}"))
        return
    if "failed" in base:
        base = {}

    def share(report: dict[str, Any]) -> str:
        if not report:
            return "-"
        window = report["window_s"]
        return (
            f"{'kept up' if report['kept_up'] else 'BEHIND'}, "
            f"generator {report['generator_cpu_s'] / window:.0%} of a core, "
            f"sent {report['sent_rate']:,.0f}/{report['target_rate']:,.0f} msg/s, "
            f"machine {report['machine_busy']:.0%} busy, main thread waited "
            f"{report['main_run_delay_s'] / window * 1000:.0f} ms/s for a CPU"
        )

    note = f"ours: {share(ours)}; vLLM: {share(base)}"
    if base.get("out_of_order_warnings"):
        note += f"; vLLM warned of {base['out_of_order_warnings']} out-of-order reports"

    def per_msg(report: dict[str, Any], key: str) -> float | None:
        if not report or not report["sent"]:
            return None
        return float(report[key]) / float(report["sent"]) * 1e6

    for report in (ours, base):
        if report and not report["waves"]:  # no wave came through at all
            report.update(lag_p50_ms=None, lag_p99_ms=None)
    figures: list[tuple[str, float | None, float | None, str, str, str]] = [
        ("wake lag p50", ours["lag_p50_ms"], base.get("lag_p50_ms"), "ms", "", ""),
        ("wake lag p99", ours["lag_p99_ms"], base.get("lag_p99_ms"), "ms", "< 100 ms", note),
        (
            "CPU per message, main thread",
            per_msg(ours, "main_cpu_s"),
            per_msg(base, "main_cpu_s"),
            "us",
            "",
            "",
        ),
        (
            "CPU per message, other threads (libzmq I/O)",
            per_msg(ours, "other_cpu_s"),
            per_msg(base, "other_cpu_s"),
            "us",
            "",
            "",
        ),
        ("peak RSS", ours["peak_rss_mib"], base.get("peak_rss_mib"), "MiB", "", ""),
        (
            "publish freshness p50",
            ours["freshness_p50_ms"],
            base.get("freshness_p50_ms"),
            "ms",
            "",
            f"publishes: ours {ours['publishes']}, vLLM {base.get('publishes', '-')}",
        ),
        (
            "publish freshness p99",
            ours["freshness_p99_ms"],
            base.get("freshness_p99_ms"),
            "ms",
            "",
            "",
        ),
    ]
    for figure, value, baseline, unit, target, row_note in figures:
        row = Row(
            "7 saturation",
            f"{prefix} {figure}",
            value,
            unit,
            baseline,
            VLLM_LABEL if baseline is not None else "",
            note=row_note,
        )
        if target == "< 100 ms":
            row.target = target
            row.met = bool(ours["kept_up"])
        if figure == "peak RSS" and n >= 2048:
            row.target = "< 512 MiB"
            row.met = value is not None and value < 512
        suite.rows.append(row)
