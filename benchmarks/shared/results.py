"""Results on disk: what a run records about itself, and the dated files under
``benchmarks/results/`` that ``python -m benchmarks report`` and ``plot`` read.

A **run** (``python -m benchmarks ... --json PATH``) is one JSON object: ``meta`` (the
date in UTC, the commit, the machine, Python, the ``build`` of trio_dpcoord in use),
``figures`` (one object per row, each with its ``section_key``: the section's name on the
command line) and ``details`` (the raw measurements).

A **record** is one section's share of a run, saved as
``benchmarks/results/<YYYY-MM-DD>_<section>[_quick].json`` (``--save``): ``section``,
``meta``, ``figures``, ``details``. Records imported from an earlier README say so in
``meta.note``. The report shows, for each section, the record with the latest date.
``benchmarks/results/history/`` holds the rounds the README used to tell in prose, as
JSON (their tables and text); nothing reads those but people.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.shared.util import REPO_ROOT

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
HISTORY_DIR = RESULTS_DIR / "history"
PURE_BUILD = "pure"
"""The ``build`` of a tree without compiled modules: the pure-Python code throughout."""


def cpu_model() -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it (else the platform's guess)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine and the versions a figure depends on."""
    import msgpack
    import trio
    import zmq

    uname = os.uname()
    return {
        "uname": " ".join(
            (uname.sysname, uname.nodename, uname.release, uname.version, uname.machine)
        ),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count() or 0,
        "nproc": str(os.cpu_count()),
        "python": sys.version.split()[0],
        "trio": trio.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgpack": ".".join(map(str, msgpack.version)),
    }


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def commit() -> tuple[str, bool]:
    """The checkout's commit, and whether its tracked files other than the results
    differ from it (then the figures are of that commit plus the differences)."""
    changed = _git(
        "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"
    )
    return _git("rev-parse", "HEAD"), bool(changed)


def build() -> str:
    """Which build of trio_dpcoord runs here: ``"compiled"`` or :data:`PURE_BUILD`
    (:func:`trio_dpcoord.hot_path_build`)."""
    import trio_dpcoord

    return trio_dpcoord.hot_path_build()


def run_meta(
    started: datetime.datetime,
    mode: str,
    elapsed_s: float,
    command: str,
    checkout: tuple[str, bool],
) -> dict[str, Any]:
    """The ``meta`` object of a run: when, where, on which commit (``checkout``, read when
    the run started: :func:`commit`) and build, how."""
    sha, dirty = checkout
    host = machine()
    return {
        "date": started.astimezone(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode,
        "elapsed_s": round(elapsed_s, 1),
        "commit": sha,
        "dirty": dirty,
        "machine": host,
        "python": host["python"],
        "build": build(),
        "command": command,
    }


def finite(value: object) -> object:
    """NaN/inf become null: strict JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dump(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(finite(value), indent=2, allow_nan=False)
    path.write_text(text + "\n")


def record_path(section: str, meta: dict[str, Any], directory: Path = RESULTS_DIR) -> Path:
    """Where a section's record of a run goes: one file a section a day (and mode)."""
    day = str(meta["date"])[:10]
    suffix = "_quick" if meta.get("mode") == "quick" else ""
    return directory / f"{day}_{section}{suffix}.json"


def save_run(
    run: dict[str, Any],
    details_by_section: dict[str, dict[str, Any]],
    directory: Path = RESULTS_DIR,
) -> list[Path]:
    """Split a run into one record a section and write each (see the module docstring)."""
    written = []
    sections = dict.fromkeys(f["section_key"] for f in run["figures"] if f.get("section_key"))
    for section in sections:
        path = record_path(section, run["meta"], directory)
        dump(
            path,
            {
                "section": section,
                "meta": run["meta"],
                "figures": [f for f in run["figures"] if f.get("section_key") == section],
                "details": details_by_section.get(section, {}),
            },
        )
        written.append(path)
    return written


@dataclass(frozen=True)
class Record:
    """One section's figures from one run (or one import), as read back from disk."""

    path: Path
    section: str
    meta: dict[str, Any]
    figures: list[dict[str, Any]]
    details: dict[str, Any]

    @property
    def date(self) -> str:
        return str(self.meta.get("date", ""))

    @property
    def commit(self) -> str:
        return str(self.meta.get("commit") or "")


def load_records(directory: Path = RESULTS_DIR) -> list[Record]:
    """Every record in ``directory`` (not its sub-folders), oldest first."""
    records = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "section" not in data or "figures" not in data:
            continue
        records.append(
            Record(path, data["section"], data["meta"], data["figures"], data.get("details", {}))
        )
    return sorted(records, key=lambda r: (r.date, r.path.name))


def latest(records: Iterable[Record]) -> dict[str, Record]:
    """The record with the latest date for each section."""
    newest: dict[str, Record] = {}
    for record in records:
        held = newest.get(record.section)
        if held is None or (record.date, record.path.name) >= (held.date, held.path.name):
            newest[record.section] = record
    return newest
