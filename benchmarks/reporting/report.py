"""``python -m benchmarks report``: the benchmark pages from the latest records.

Two kinds of page, split where a reader's question changes:

* ``benchmarks/README.md``, the page a newcomer reads first: how to run the benchmarks,
  the section guide (one line a section: its command, what it measures, what it needs,
  its latest record and a link to its page), and one headline table of every section's
  goal rows (the figures with a target), each beside its same-run baseline.
* ``benchmarks/pages/<section>.md``, one a section: every figure of the section's latest
  record under ``benchmarks/results/`` (:mod:`benchmarks.shared.results`), dated and tied
  to its commit, machine and build. A section with no record yet shows the first table
  of its latest round in ``benchmarks/results/history/`` (the rounds the page used to
  tell in prose).

Nothing on the pages is typed by hand but the section guide below. A record of a section
the guide does not know still gets a page (after the guide's sections). Pages of
sections that have neither a record nor a round any more are removed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.reporting.guide import GUIDE, SectionGuide
from benchmarks.shared.results import HISTORY_DIR, RESULTS_DIR, Record, latest, load_records
from benchmarks.shared.suite import fmt
from benchmarks.shared.util import REPO_ROOT

BENCHMARKS_DIR = REPO_ROOT / "benchmarks"
README_NAME = "README.md"
PAGES_DIR_NAME = "pages"
MAX_LINES = 400
"""The most lines any one page may have (the front page and each section's page)."""
PLOTS = (
    ("routing_real.png", "Hit rate and TTFT per policy on a real vllm serve", ("routing_real",)),
    ("routing_decision.png", "The prefix decision's cost by ranks", ("routing_decision",)),
    ("restarts.png", "Recovery time of each coordinator kill", ("restart_real", "restart_fleet")),
)
"""The pictures ``python -m benchmarks plot`` draws (file under ``results/plots/``, title,
the sections whose records it is drawn from: their pages show it)."""


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


def table_row(cells: Sequence[object]) -> str:
    """One markdown table row of ``cells``."""
    return "| " + " | ".join(cell(c) for c in cells) + " |"


def table_head(header: Sequence[str]) -> list[str]:
    """A markdown table's header and rule."""
    return [table_row(header), "|" + "---|" * len(header)]


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


def figure_cells(figure: dict[str, Any]) -> list[str]:
    """A figure's cells: its name, value, baseline, ratio, target and whether it was met."""
    return [
        figure.get("figure", ""),
        value_text(figure),
        baseline_text(figure),
        ratio_text(figure),
        figure.get("target", ""),
        met_text(figure),
    ]


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
    lines = table_head(header)
    for figure in record.figures:
        cells = figure_cells(figure)
        if len(groups) > 1:
            cells.insert(0, figure.get("section", ""))
        if notes:
            cells.append(figure.get("note", "") if figure.get("value") is not None else "")
        lines.append(table_row(cells))
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


GENERATED = [
    "<!-- Written by `python -m benchmarks report` from benchmarks/results/*.json: change",
    "the records or benchmarks/reporting/ (report.py, guide.py), not this page. -->",
]


def page_name(key: str) -> str:
    """A section's page, relative to ``benchmarks/``."""
    return f"{PAGES_DIR_NAME}/{key}.md"


def about(guide: SectionGuide) -> str:
    """What the section measures, and what it needs, as a sentence."""
    needs = "" if guide.needs == "-" else f" (needs: {guide.needs})"
    return f"{guide.what[0].upper()}{guide.what[1:]}{needs}."


def sections(newest: dict[str, Record]) -> list[SectionGuide]:
    """The guide's sections in its order, then any section with a record that the guide
    does not describe (a section added since), by name."""
    known = {guide.key for guide in GUIDE}
    added = [
        SectionGuide(key, key, f"python -m benchmarks {key}", "not in the report's guide yet", "-")
        for key in sorted(newest)
        if key not in known
    ]
    return [*GUIDE, *added]


def history_table_lines(table: HistoryTable) -> list[str]:
    return table_head(table.header) + [table_row(row) for row in table.rows]


def section_page(guide: SectionGuide, record: Record | None, table: HistoryTable | None) -> str:
    """One section's page: its command and what it measures, then every figure of its
    latest record (or its latest round of the history)."""
    out = [f"# {guide.heading} (`{guide.command}`)", "", *GENERATED, ""]
    if record is not None:
        out += [f"{about(guide)} {provenance(record)}", "", *figure_table(record)]
    elif table is not None:
        out += [
            f"{about(guide)} No record yet. Its latest round, {table.date} ({table.title}), "
            f"imported from the stop-42 README: "
            f"[{table.path.name}](../results/history/{table.path.name}).",
            "",
            *history_table_lines(table),
        ]
    else:
        out.append(f"{about(guide)} No record yet.")
    pictures = [(name, title) for name, title, keys in PLOTS if guide.key in keys]
    if pictures:
        out += ["", " ".join(f"![{title}](../results/plots/{name})" for name, title in pictures)]
    out += [
        "",
        "All sections and their goal rows: [the benchmarks' page](../README.md); how each "
        "figure is measured: [METHODS.md](../METHODS.md).",
    ]
    return "\n".join(out) + "\n"


def record_summary(record: Record) -> str:
    """The guide table's cell for a section's latest record."""
    meta = record.meta
    return f"{record.date[:10]}, {meta.get('build', '?')} build, {meta.get('mode', '?')} mode"


def goal_count(record: Record) -> str:
    goals = sum(1 for figure in record.figures if figure.get("target"))
    return f"{len(record.figures)}, {goals} with a goal" if goals else f"{len(record.figures)}"


def front_page(
    guides: Sequence[SectionGuide],
    newest: dict[str, Record],
    history: dict[str, HistoryTable],
) -> str:
    """``benchmarks/README.md``: how to run them, the section guide with a link to each
    section's page, and one headline table of every section's goal rows."""
    out = [
        "# Benchmarks",
        "",
        *GENERATED,
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
        "python -m benchmarks report                    # these pages, from the latest records",
        "python -m benchmarks plot                      # their pictures (the plot extra)",
        "```",
        "",
        "From the repository root, in the project's venv. `--json` writes `meta` (UTC date,",
        "commit, machine, Python, `build`), `figures` and `details`; `--save` writes one record",
        "a section, `results/<date>_<section>[_quick].json`. Logs: `results/logs/` (ignored).",
        "",
        "## The sections",
        "",
        "Each section's page shows every figure of its latest record, with its date, commit,",
        "machine, build and command.",
        "",
        *table_head(["section", "command", "what it measures", "latest record", "figures"]),
    ]
    for guide in guides:
        record = newest.get(guide.key)
        table = history.get(guide.key)
        if record is not None:
            latest_cell, count = record_summary(record), goal_count(record)
        elif table is not None:
            latest_cell, count = f"none; a round of {table.date} (history)", str(len(table.rows))
        else:
            latest_cell, count = "none", "0"
        link = f"[{cell(guide.heading)}]({page_name(guide.key)})"
        out.append(table_row([link, f"`{guide.command}`", about(guide), latest_cell, count]))
    out += [
        "",
        "## Goals",
        "",
        "Every figure with a target, from each section's latest record; the other figures, and",
        "when and how each was measured, are on the section's page.",
        "",
        *table_head(
            ["section", "figure", "value", "baseline (same run)", "ratio", "target", "met"]
        ),
    ]
    for guide in guides:
        record = newest.get(guide.key)
        figures = record.figures if record is not None else []
        grouped = len({figure.get("section", "") for figure in figures}) > 1
        for figure in figures:
            if not figure.get("target"):
                continue
            # a record of several groups (ranks, say): each row names its group
            name = figure.get("section", "") if grouped else guide.heading
            out.append(
                table_row([f"[{cell(name)}]({page_name(guide.key)})", *figure_cells(figure)])
            )
    out += ["", " ".join(f"![{title}](results/plots/{name})" for name, title, _ in PLOTS)]
    return "\n".join(out) + "\n"


def render(results_dir: Path = RESULTS_DIR, history_dir: Path | None = None) -> dict[str, str]:
    """Every page, by its path relative to ``benchmarks/``: ``README.md`` and one
    ``pages/<section>.md`` a section."""
    history_dir = history_dir or results_dir / "history"
    newest = latest(load_records(results_dir))
    history = history_tables(history_dir)
    guides = sections(newest)
    pages = {README_NAME: front_page(guides, newest, history)}
    for guide in guides:
        pages[page_name(guide.key)] = section_page(
            guide, newest.get(guide.key), history.get(guide.key)
        )
    return pages


def write(pages: dict[str, str], out: Path) -> list[str]:
    """Write ``pages`` under ``out`` and remove the section pages under ``out/pages/``
    that are not among them; returns the pages longer than :data:`MAX_LINES`."""
    for name, text in pages.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    for stale in sorted((out / PAGES_DIR_NAME).glob("*.md")):
        if f"{PAGES_DIR_NAME}/{stale.name}" not in pages:
            stale.unlink()
    return [name for name, text in pages.items() if text.count("\n") > MAX_LINES]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="records to read")
    parser.add_argument("--history", type=Path, default=HISTORY_DIR, help="rounds to fall back on")
    parser.add_argument(
        "--out",
        type=Path,
        default=BENCHMARKS_DIR,
        help="where the pages go: OUT/README.md and OUT/pages/<section>.md",
    )
    args = parser.parse_args(argv)
    pages = render(args.results, args.history)
    too_long = write(pages, args.out)
    lines = {name: text.count("\n") for name, text in pages.items()}
    print(
        f"wrote {args.out / README_NAME} ({lines[README_NAME]} lines) and "
        f"{len(pages) - 1} section pages under {args.out / PAGES_DIR_NAME} "
        f"(the longest {max(lines.values())} lines)"
    )
    for name in too_long:
        print(f"{name}: more than {MAX_LINES} lines: split it")
    return 1 if too_long else 0
