"""Print the side-by-side table of the real-vLLM scenarios: ``python -m tests.vllm_real.report``.

Reads the rows ``tests/vllm/test_real.py`` appended to ``.cache/vllm-real-report.jsonl``
(or the file given as the first argument); the last row of each scenario and coordinator
wins, so a rerun replaces an earlier run's figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ._venv import REPO_ROOT

DEFAULT_REPORT = REPO_ROOT / ".cache" / "vllm-real-report.jsonl"
OUTCOME_KEYS = (
    "dropped",
    "exit_status",
    "noticed",
    "shutdown_seconds",
    "coordinator_force_killed",
    "ipc_files_left",
    "coordinator_ipc_files_left",
)


def _cells(row: dict[str, Any]) -> list[str]:
    requests = f"{row['requests_ok']}/{row['requests']}" if "requests" in row else "-"
    waves = f"{row['waves_started']}/{row['waves_ended']}" if "waves_started" in row else "-"
    if row.get("silent_waves"):
        waves += f" ({row['silent_waves']} silent)"
    outcome = ", ".join(f"{key}={row[key]}" for key in OUTCOME_KEYS if key in row)
    return [
        requests,
        waves,
        f"{row['startup_seconds']:.0f}",
        f"{row['coordinator_cpu_seconds']:.2f}"
        + (
            f" ({row['coordinator_cpu_seconds_scenario']:.2f})"
            if "coordinator_cpu_seconds_scenario" in row
            else ""
        ),
        f"{row['coordinator_rss_mib']:.0f}",
        outcome or "-",
    ]


HEADER = (
    "scenario",
    "coordinator",
    "requests ok",
    "waves started/ended",
    "startup s",
    "coordinator CPU s in all (in the scenario)",
    "coordinator RSS MiB",
    "outcome",
)


def table(rows: list[dict[str, Any]]) -> str:
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        latest[(row["scenario"], row["coordinator"])] = row
    scenarios = list(dict.fromkeys(row["scenario"] for row in rows))
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for scenario in scenarios:
        for coordinator in ("vllm", "trio"):
            found = latest.get((scenario, coordinator))
            if found is not None:
                cells = [scenario, coordinator, *_cells(found)]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else DEFAULT_REPORT
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
