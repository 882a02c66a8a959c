"""``python -m benchmarks plot``: the benchmark page's pictures, from the same records.

Needs the ``plot`` extra (matplotlib; drawn with its Agg backend, no display). Each
picture is drawn from the latest record of its sections (:mod:`benchmarks.shared.results`)
and skipped, with a line saying so, when the record is missing:

* ``routing_real.png``: the hit rate of each policy on a real ``vllm serve``, and its
  TTFT p50 and p99 as ratios to vLLM's choice (``routing_real``);
* ``routing_decision.png``: one decision's p50 and p99 by ranks, ours beside vLLM's score
  and vLLM's own ``get_core_engine_for_request`` (``routing_decision``);
* ``restarts.png``: the recovery time of each coordinator kill (``restart_real``,
  ``restart_fleet``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.shared.results import RESULTS_DIR, Record, latest, load_records

PLOTS_DIR = RESULTS_DIR / "plots"
VLLM_CHOICE = "vLLM's choice"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _split(figure: str) -> tuple[str, str, str]:
    """``"TRACE: POLICY, FIGURE"`` into its three parts."""
    trace, _, rest = figure.partition(": ")
    policy, _, name = rest.rpartition(", ")
    return trace, policy, name


def routing_real(record: Record, out: Path) -> Path:
    """Hit rate per policy and trace; TTFT p50/p99 as ratios to vLLM's choice."""
    plt = _pyplot()
    hit: dict[str, dict[str, float]] = {}
    ttft: dict[str, dict[str, dict[str, float]]] = {"TTFT p50": {}, "TTFT p99": {}}
    for figure in record.figures:
        trace, policy, name = _split(figure["figure"])
        if name == "hit rate" and figure["value"] is not None:
            hit.setdefault(trace, {})[policy] = figure["value"]
        elif name in ttft:
            ratio = 1.0 if policy == VLLM_CHOICE else figure.get("ratio")
            if ratio is not None:
                ttft[name].setdefault(trace, {})[policy] = ratio
    traces = list(hit)
    policies = list(dict.fromkeys(p for by in hit.values() for p in by))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / max(1, len(policies))
    for panel, (title, data, unit) in zip(
        axes,
        (
            ("prefix-cache hit rate", hit, "% of prompt tokens"),
            ("TTFT p50", ttft["TTFT p50"], "x vLLM's choice"),
            ("TTFT p99", ttft["TTFT p99"], "x vLLM's choice"),
        ),
        strict=True,
    ):
        for number, policy in enumerate(policies):
            xs = [i + number * width for i, t in enumerate(traces) if policy in data.get(t, {})]
            ys = [data[t][policy] for t in traces if policy in data.get(t, {})]
            panel.bar(xs, ys, width, label=policy)
        panel.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(traces))])
        panel.set_xticklabels(traces)
        panel.set_title(title)
        panel.set_ylabel(unit)
        if unit.startswith("x"):
            panel.axhline(1.0, color="grey", linewidth=0.8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=max(1, len(policies)), fontsize=9)
    fig.suptitle(f"Engine choice on a real vllm serve (DP = 2), {record.date[:10]}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(plt, fig, out / "routing_real.png")


_RANKS = re.compile(r"N=(\d+)")


def routing_decision(record: Record, out: Path) -> Path:
    """p50 and p99 of one decision by ranks: ours, vLLM's score, vLLM's own."""
    plt = _pyplot()
    series: dict[str, dict[int, float]] = {}
    for figure in record.figures:
        match = _RANKS.search(figure.get("section", ""))
        name = figure["figure"]
        if match is None or not name.startswith("choose() p") or figure["value"] is None:
            continue
        ranks, q = int(match.group(1)), name[len("choose() ") : name.index(",")]
        if "vLLM's score" in name:
            series.setdefault(f"vLLM's score (EngineChooser) {q}", {})[ranks] = figure["value"]
            series.setdefault(f"vLLM 0.33.0's own {q}", {})[ranks] = figure["baseline"]
        else:
            label = "ours, store deferred" if "store deferred" in name else "ours (prefix)"
            series.setdefault(f"{label} {q}", {})[ranks] = figure["value"]
    fig, panel = plt.subplots(figsize=(10, 5))
    colours: dict[str, str] = {}
    for label, points in series.items():
        xs = sorted(points)
        family, _, q = label.rpartition(" ")
        colour = colours.setdefault(family, f"C{len(colours)}")
        style = "-" if q == "p50" else "--"
        panel.plot(xs, [points[x] for x in xs], style, color=colour, marker="o", label=label)
    ticks = sorted({x for points in series.values() for x in points})
    panel.set_xscale("log", base=2)
    panel.set_xticks(ticks, [str(x) for x in ticks])
    panel.set_yscale("log")
    panel.set_xlabel("ranks (engines)")
    panel.set_ylabel("us per decision")
    panel.set_title(
        f"One routing decision, 4,096-token prompt, warm index ({record.date[:10]}, "
        f"{record.commit[:7] or 'commit unknown'})"
    )
    panel.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return _save(plt, fig, out / "routing_decision.png")


def restarts(real: Record | None, fleet: Record | None, out: Path) -> Path:
    """The recovery time of each kill, on a real vllm serve and on the simulated fleet."""
    plt = _pyplot()
    fig, panel = plt.subplots(figsize=(8, 4.5))
    if real is not None:
        for label, times in real.details.get("recovery_ms_per_kill", {}).items():
            kills = range(1, len(times) + 1)
            panel.plot(kills, times, marker="o", label=f"real vllm serve: {label}")
    if fleet is not None:
        kills_data = fleet.details.get("kills", [])
        numbers = [k["kill"] for k in kills_data]
        panel.plot(
            numbers,
            [k["recovery_ms"] for k in kills_data],
            marker="s",
            label="simulated fleet, 64 engines: from the kill",
        )
        cut = [k for k in kills_data if k.get("partitioned_node")]
        panel.plot(
            [k["kill"] for k in cut],
            [k["heal_to_first_publish_ms"] for k in cut],
            "^",
            label="simulated fleet, a node cut off: from the heal",
        )
    panel.set_yscale("log")
    panel.set_xlabel("kill")
    panel.set_ylabel("ms to the first publish of the new coordinator")
    panel.set_title("Recovery of each kill -9 of the DP coordinator")
    panel.legend(fontsize=8)
    fig.tight_layout()
    return _save(plt, fig, out / "restarts.png")


def draw(results_dir: Path = RESULTS_DIR, out: Path = PLOTS_DIR) -> list[Path]:
    """Every picture whose records exist; the paths written."""
    newest = latest(load_records(results_dir))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if "routing_real" in newest:
        written.append(routing_real(newest["routing_real"], out))
    else:
        print("routing_real.png skipped: no routing_real record")
    if "routing_decision" in newest:
        written.append(routing_decision(newest["routing_decision"], out))
    else:
        print("routing_decision.png skipped: no routing_decision record")
    if "restart_real" in newest or "restart_fleet" in newest:
        written.append(restarts(newest.get("restart_real"), newest.get("restart_fleet"), out))
    else:
        print("restarts.png skipped: no restart_real or restart_fleet record")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks plot", description=__doc__)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="records to read")
    parser.add_argument("--out", type=Path, default=PLOTS_DIR, help="where the PNGs go")
    args = parser.parse_args(argv)
    for path in draw(args.results, args.out):
        print(f"wrote {path}")
    return 0
