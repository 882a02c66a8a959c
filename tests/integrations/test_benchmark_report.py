"""``python -m benchmarks report`` and ``plot`` on the committed records
(``benchmarks/results/``): each section's page carries its latest record's date, commit and
every figure; the front page links every section's page and shows every goal row; the
committed pages are the report's; each picture is drawn from the records it needs.

Expectations come from the JSON files themselves, so the test holds whatever the latest
run measured; speed is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.reporting.guide import GUIDE
from benchmarks.reporting.report import MAX_LINES, PAGES_DIR_NAME, PLOTS
from benchmarks.shared.results import HISTORY_DIR, RESULTS_DIR, Record, latest, load_records
from benchmarks.shared.suite import fmt

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_benchmarks(*args: str) -> None:
    """``python -m benchmarks ARGS`` from the repository root, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=str(REPO), MPLBACKEND="Agg")
    subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=REPO,
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
    )


def written_pages(out: Path) -> dict[str, str]:
    """Every page under ``out`` (``README.md`` and ``pages/*.md``), by its path there."""
    paths = [out / "README.md", *sorted((out / PAGES_DIR_NAME).glob("*.md"))]
    return {path.relative_to(out).as_posix(): path.read_text() for path in paths}


def table_rows(part: str) -> list[str]:
    """The data rows of the part's table (header and rule left out)."""
    rows = [line for line in part.splitlines() if line.startswith("| ")]
    return rows[1:]


def escaped(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def check_record(part: str, record: Record) -> None:
    assert f"Measured {record.date.replace('T', ' ').replace('+00:00', ' UTC')}" in part
    assert (record.commit[:10] if record.commit else "commit unknown") in part
    assert f"build {record.meta['build']}" in part
    rows = table_rows(part)
    assert len(rows) == len(record.figures)
    for row, figure in zip(rows, record.figures, strict=True):
        assert f"| {escaped(figure['figure'])} |" in row
        if figure["value"] is not None:
            assert escaped(fmt(figure["value"], figure["unit"])) in row
        if figure.get("baseline"):
            assert escaped(fmt(figure["baseline"], figure["unit"])) in row
        if figure.get("ratio") is not None:
            assert f"{figure['ratio']:.2f}x" in row
        if figure.get("target"):
            assert escaped(figure["target"]) in row


def test_each_sections_page_shows_its_latest_figures(tmp_path: Path) -> None:
    run_benchmarks("report", "--out", str(tmp_path))
    pages = written_pages(tmp_path)
    for name, text in pages.items():
        assert text.count("\n") <= MAX_LINES, name
    newest = latest(load_records(RESULTS_DIR))
    assert newest, "no committed records under benchmarks/results/"
    keys = [guide.key for guide in GUIDE] + sorted(set(newest) - {g.key for g in GUIDE})
    assert set(pages) == {"README.md"} | {f"{PAGES_DIR_NAME}/{key}.md" for key in keys}
    for guide in GUIDE:
        part = pages[f"{PAGES_DIR_NAME}/{guide.key}.md"]
        assert part.startswith(f"# {guide.heading} (`{guide.command}`)\n")
        record = newest.get(guide.key)
        if record is not None:
            check_record(part, record)
            continue
        # no record: its latest round of the history, every cell of that round's table
        rounds = [(json.loads(p.read_text()), p.name) for p in HISTORY_DIR.glob("*.json")]
        dated = [
            (str(r["date"]), name, r)
            for r, name in rounds
            if r["section"] == guide.key and r["date"] and r["tables"]
        ]
        if not dated:
            assert "No record yet." in part
            continue
        newest_round = max(dated, key=lambda entry: entry[:2])[2]
        assert str(newest_round["date"]) in part
        for cells in newest_round["tables"][0]["rows"]:
            assert "| " + " | ".join(escaped(c) for c in cells) + " |" in part


def test_the_front_page_links_every_section_and_shows_every_goal_row(tmp_path: Path) -> None:
    run_benchmarks("report", "--out", str(tmp_path))
    front = (tmp_path / "README.md").read_text()
    assert front.count("\n") <= MAX_LINES // 2  # the page read first stays short
    newest = latest(load_records(RESULTS_DIR))
    for guide in GUIDE:
        page = f"]({PAGES_DIR_NAME}/{guide.key}.md) | "
        assert f"| [{escaped(guide.heading)}{page}`{guide.command}` |" in front
        record = newest.get(guide.key)
        goals = [f for f in record.figures if f.get("target")] if record is not None else []
        rows = [line for line in front.splitlines() if line.startswith("| [") and page in line]
        assert len(rows) == 1 + len(goals)  # its guide line, then one row a goal
        for row, figure in zip(rows[1:], goals, strict=True):
            assert f"| {escaped(figure['figure'])} |" in row
            assert escaped(figure["target"]) in row
            if figure["value"] is not None:
                assert escaped(fmt(figure["value"], figure["unit"])) in row


def test_the_committed_pages_are_the_reports(tmp_path: Path) -> None:
    """benchmarks/README.md and benchmarks/pages/*.md are what ``report`` writes from the
    committed records, and no other page is committed there."""
    run_benchmarks("report", "--out", str(tmp_path))
    assert written_pages(REPO / "benchmarks") == written_pages(tmp_path)


def test_a_page_left_by_a_section_gone_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / PAGES_DIR_NAME / "a_section_gone.md"
    stale.parent.mkdir()
    stale.write_text("# gone\n")
    run_benchmarks("report", "--out", str(tmp_path))
    assert not stale.exists()
    assert (tmp_path / PAGES_DIR_NAME / "wake.md").exists()


def test_the_pictures_are_drawn_from_the_records(tmp_path: Path) -> None:
    run_benchmarks("plot", "--out", str(tmp_path))
    newest = latest(load_records(RESULTS_DIR))
    needs = {
        "routing_real.png": {"routing_real"},
        "routing_decision.png": {"routing_decision"},
        "restarts.png": {"restart_real", "restart_fleet"},
    }
    assert needs == {name: set(sections) for name, _, sections in PLOTS}
    for name, sections in needs.items():
        path = tmp_path / name
        if sections & set(newest):
            assert path.read_bytes()[:8] == PNG_MAGIC, name
            assert path.stat().st_size > 10_000, name
        else:
            assert not path.exists(), name
