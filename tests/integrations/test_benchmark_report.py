"""``python -m benchmarks report`` and ``plot`` on the committed records
(``benchmarks/results/``): the page carries, for every section, its latest record's date,
commit and every figure, and each picture is drawn from the records it needs.

Expectations come from the JSON files themselves, so the test holds whatever the latest
run measured; speed is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.reporting.report import GUIDE, MAX_LINES, PLOTS
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


def section_part(page: str, heading: str) -> str:
    """The page's text under ``### HEADING (...)``, up to the next heading."""
    start = page.index(f"\n### {heading} (")
    end = page.find("\n### ", start + 1)
    return page[start : end if end != -1 else len(page)]


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


def test_the_page_shows_each_sections_latest_figures(tmp_path: Path) -> None:
    out = tmp_path / "README.md"
    run_benchmarks("report", "--out", str(out))
    page = out.read_text()
    assert page.count("\n") <= MAX_LINES
    newest = latest(load_records(RESULTS_DIR))
    assert newest, "no committed records under benchmarks/results/"
    for guide in GUIDE:
        assert f"`{guide.command}`" in page
        part = section_part(page, guide.heading)
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


def test_the_committed_page_is_the_reports(tmp_path: Path) -> None:
    """benchmarks/README.md is what ``report`` writes from the committed records."""
    out = tmp_path / "README.md"
    run_benchmarks("report", "--out", str(out))
    assert (REPO / "benchmarks" / "README.md").read_text() == out.read_text()


def test_the_pictures_are_drawn_from_the_records(tmp_path: Path) -> None:
    run_benchmarks("plot", "--out", str(tmp_path))
    newest = latest(load_records(RESULTS_DIR))
    needs = {
        "routing_real.png": {"routing_real"},
        "routing_decision.png": {"routing_decision"},
        "restarts.png": {"restart_real", "restart_fleet"},
    }
    assert set(needs) == {name for name, _ in PLOTS}
    for name, sections in needs.items():
        path = tmp_path / name
        if sections & set(newest):
            assert path.read_bytes()[:8] == PNG_MAGIC, name
            assert path.stat().st_size > 10_000, name
        else:
            assert not path.exists(), name
