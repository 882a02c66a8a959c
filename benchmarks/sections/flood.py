"""Section 8, ``flood``: SIGTERM right after 2,000 engines disconnected at once: the time
to exit, the exit status and the WARNING lines, ours beside vLLM's."""

from __future__ import annotations

from benchmarks.shared import scenarios as sc
from benchmarks.shared.suite import VLLM_LABEL, Row, Suite


def run_section(suite: Suite) -> None:
    """SIGTERM right after every one of 2,000 engines disconnected at once."""
    n = suite.sizes.flood_engines
    kinds = [] if suite.standalone_reason else [sc.STANDALONE]
    if not suite.vllm_reason:
        kinds.append(sc.VLLM)
    results = {kind: sc.flood_shutdown(suite.env, kind, n) for kind in kinds}
    suite.details["flood"] = results
    ours, base = results.get(sc.STANDALONE), results.get(sc.VLLM)
    if ours is None:
        suite.skipped("8 flood", "SIGTERM in a mass disconnect", suite.standalone_reason or "")
        return
    note = (
        f"exit status: ours {ours['status']}, vLLM {base['status'] if base else '-'}; "
        f"counters line printed: {'yes' if ours['counters_printed'] else 'NO'}"
    )
    exit_row = Row(
        "8 flood",
        f"SIGTERM after {n:,} engines left at once: time to exit",
        ours["exit_s"] * 1000,
        "ms",
        base["exit_s"] * 1000 if base else None,
        VLLM_LABEL if base else "",
        "<= 1000 ms, exit 0",
        ours["status"] == 0 and ours["exit_s"] <= 1.0 and bool(ours["counters_printed"]),
        note,
    )
    warn_row = Row(
        "8 flood",
        f"SIGTERM after {n:,} engines left at once: WARNING lines",
        float(ours["warnings"]),
        "lines",
        float(base["warnings"]) if base and base["warnings"] else None,
        VLLM_LABEL if base else "",
        "<= 20",
        ours["warnings"] <= 20,
        note=f"vLLM: {base['warnings']} lines" if base else "",
    )
    suite.rows += [exit_row, warn_row]
