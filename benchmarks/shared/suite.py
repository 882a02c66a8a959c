"""What every section of a suite run shares: the rows it adds, the sizes it runs at, and
the run's state (the environment, the raw measurements, which baselines can run).

A section is a module of :mod:`benchmarks.sections` with ``run_section(suite)``: it
measures, then appends :class:`Row` objects to ``suite.rows`` and its raw measurements to
``suite.details``. A failing measurement becomes a row saying so (:meth:`Suite.guarded`),
never a crash of the whole run.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.shared import scenarios as sc

logger = logging.getLogger("benchmarks")

VLLM_LABEL = "vLLM 0.33.0"
SPEED_FIGURES = (
    ("throughput", "throughput", "tok/s", 1.0),
    ("TTFT p50", "ttft_p50_s", "ms", 1000.0),
    ("TTFT p99", "ttft_p99_s", "ms", 1000.0),
)
"""The routing sections' (figure, attribute, unit, scale) rows for throughput and TTFT."""
TRIO_FLOOR_NOTE = "no coordinator: the least a trio program of the coordinator's shape does"


@dataclass
class Row:
    """One figure: value next to its same-run baseline, the ratio, and the target.

    ``section`` is the table's heading ("1 ingest", "10 routing N=8"); ``section_key`` the
    name of the section that measured it on the command line (``python -m benchmarks
    KEY``), set by the suite for every row a section adds."""

    section: str
    figure: str
    value: float | None
    unit: str
    baseline: float | None = None
    baseline_label: str = ""
    target: str = ""
    met: bool | None = None
    note: str = ""
    section_key: str = ""

    @property
    def ratio(self) -> float | None:
        if self.value is None or not self.baseline:
            return None
        return self.value / self.baseline


@dataclass
class Sizes:
    ingest_total: int
    ingest_rounds: int
    ingest_pushers: int
    waves: int
    wake_engines: tuple[int, ...]
    load_engines: tuple[int, ...]
    hot_calls: int
    scale_engines: tuple[int, ...]
    scale_waves: int
    publish_calls: int
    e2e_timeout_s: float
    vllm_ingest_total: int
    vllm_scale_engines: tuple[int, ...]
    vllm_scale_rounds: int
    saturation_points: tuple[tuple[float, int], ...]
    """(report interval in ms, engines) of the saturation sweep."""
    saturation_seconds: float
    flood_engines: int


QUICK = Sizes(
    ingest_total=100_000,
    ingest_rounds=2,
    ingest_pushers=4,
    waves=300,
    wake_engines=(2, 8, 64),
    load_engines=(8,),
    hot_calls=200_000,
    scale_engines=(2, 16, 64, 128, 256),
    scale_waves=100,
    publish_calls=2_000,
    e2e_timeout_s=60,
    vllm_ingest_total=100_000,
    vllm_scale_engines=(8, 256, 1024),
    vllm_scale_rounds=2,
    saturation_points=((20, 512), (20, 1024), (100, 2048)),
    saturation_seconds=3,
    flood_engines=2000,
)
FULL = Sizes(
    ingest_total=400_000,
    ingest_rounds=3,
    ingest_pushers=4,
    waves=2_000,
    wake_engines=(2, 8, 64),
    load_engines=(2, 8, 64),
    hot_calls=1_000_000,
    scale_engines=(2, 4, 8, 16, 32, 64, 128, 256),
    scale_waves=500,
    publish_calls=10_000,
    e2e_timeout_s=300,
    vllm_ingest_total=200_000,
    vllm_scale_engines=(8, 64, 256, 1024),
    vllm_scale_rounds=3,
    saturation_points=(
        (20, 256),
        (20, 512),
        (20, 1024),
        (20, 1280),
        (20, 1536),
        (20, 2048),
        (100, 1024),
        (100, 2048),
    ),
    saturation_seconds=8,
    flood_engines=2000,
)


class Suite:
    """One run's state, handed to every section in turn (see the module docstring)."""

    def __init__(self, env: sc.Env, sizes: Sizes) -> None:
        self.env = env
        self.sizes = sizes
        self.rows: list[Row] = []
        self.details: dict[str, Any] = {}
        self.standalone_reason = sc.standalone_unavailable()
        self.vllm_reason = sc.vllm_unavailable(env)
        if self.vllm_reason:
            logger.warning("vLLM's coordinator rows skipped: %s", self.vllm_reason)

    @property
    def full(self) -> bool:
        """Full mode (the ``FULL`` sizes), not ``--quick``."""
        return self.sizes is FULL

    def guarded(self, section: str, figure: str, step: Callable[[], None]) -> None:
        """Run one measurement; a failure becomes a row saying so, not a crash."""
        try:
            step()
        except Exception as exc:
            logger.error("%s / %s failed:\n%s", section, figure, traceback.format_exc())
            self.rows.append(Row(section, figure, None, "", note=f"failed: {exc!r}"[:160]))

    def skipped(self, section: str, figure: str, reason: str) -> None:
        self.rows.append(Row(section, figure, None, "", note=f"skipped: {reason}"))


def fmt(value: float | None, unit: str = "") -> str:
    """A figure as the tables print it: thousands separated, 3 significant-ish digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return f"{value:,} {unit}".strip()
    if abs(value) >= 1000:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text} {unit}".strip()


def render(rows: Sequence[Row]) -> str:
    header = ("section", "figure", "value", "baseline (same run)", "ratio", "target", "met")
    lines = [header]
    for r in rows:
        ratio = r.ratio
        met = {True: "yes", False: "NO", None: ""}[r.met]
        value = fmt(r.value, r.unit) if r.value is not None else (r.note or "-")
        baseline = f"{fmt(r.baseline, r.unit)} {r.baseline_label}".strip() if r.baseline else ""
        lines.append(
            (
                r.section,
                r.figure,
                value,
                baseline,
                f"{ratio:.2f}x" if ratio is not None else "",
                r.target,
                met,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(lines[0], widths, strict=True)) + " |"]
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in lines[1:]:
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |")
    return "\n".join(out)
