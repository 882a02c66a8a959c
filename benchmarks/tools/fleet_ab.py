"""Checkouts against each other on the process fleet, one trace, alternating passes.

``python -m benchmarks.tools.fleet_ab --trace "no reuse" --rates 100 600 --seeds 2 --passes 6
--jsonl OUT vllm=.:vllm before=/path/to/old/checkout:approximate after=.:approximate``

Each ``LABEL=PATH:POLICY`` runs :func:`benchmarks.sections.routing_fleet.run_fleet_policy` (one
fresh cluster of 8 engine processes) in a subprocess whose ``PYTHONPATH`` is ``PATH`` (a
checkout of this repository, so an old one runs its own policy on the same trace); the
first variant is the baseline. Pass ``k`` runs the variants in order, pass ``k + 1`` in
reverse (ABBA), so that the shared machine's noise falls on all of them. The figures are
the ``routing_fleet`` section's (``FleetFigures``); the table gives each variant's
means and, per (pass, seed), its ratio to the baseline's run beside it: the median and
the range (one run caught by another process's burst moves a mean ratio a lot, the
median little).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any


def _one(trace_name: str, rate: float, policy: str, seed: int) -> None:
    import importlib

    try:
        rt = importlib.import_module("benchmarks.sections.routing")
        rf = importlib.import_module("benchmarks.sections.routing_fleet")
    except ImportError:  # a checkout from before the benchmarks' rooms (stop 42 and older)
        rt = importlib.import_module("benchmarks._routing")
        rf = importlib.import_module("benchmarks._routing_fleet")

    sizes = rf.FLEET_FULL
    trace = rt.make_trace(
        trace_name, seed, rf.FLEET_RANKS, replace(sizes.trace_sizes, rate_per_rank=rate)
    )
    print(json.dumps(asdict(rf.run_fleet_policy(trace, policy, sizes))))


def table(records: list[dict[str, Any]], base: str) -> list[str]:
    """Per rate and variant: mean tokens/s, TTFT p50/p99, busiest/mean, and the ratios to
    ``base`` in the same (pass, seed)."""
    cells: dict[tuple[float, int, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for record in records:
        if "throughput" in record:
            cells[(record["rate"], record["pass"], record["seed"])][record["variant"]] = record
    lines = []
    for rate in sorted({key[0] for key in cells}):
        runs = [cell for key, cell in cells.items() if key[0] == rate and base in cell]
        lines.append(f"{rate:g} requests/s a rank, {len(runs)} (pass, seed) pairs")
        for variant in sorted({name for cell in runs for name in cell}):
            mine = [cell[variant] for cell in runs if variant in cell]
            tput = [c[variant]["throughput"] / c[base]["throughput"] for c in runs if variant in c]
            p99 = [c[variant]["ttft_p99_s"] / c[base]["ttft_p99_s"] for c in runs if variant in c]

            def mean(field: str, runs: list[dict[str, Any]] = mine) -> float:
                return float(statistics.mean(run[field] for run in runs))

            lines.append(
                f"  {variant:>10}: hit {mean('hit_rate') * 100:4.1f} %, "
                f"{mean('throughput'):7.0f} tok/s, TTFT p50 "
                f"{mean('ttft_p50_s') * 1e3:5.0f} ms, p99 {mean('ttft_p99_s') * 1e3:5.0f} ms, "
                f"busiest/mean {mean('busiest_over_mean'):.3f}; vs {base}: throughput median "
                f"{statistics.median(tput):.3f}x ({min(tput):.2f}..{max(tput):.2f}), TTFT p99 "
                f"median {statistics.median(p99):.3f}x ({min(p99):.2f}..{max(p99):.2f})"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tools.fleet_ab", description=__doc__
    )
    parser.add_argument("variants", nargs="*", help="LABEL=PATH:POLICY, the baseline first")
    parser.add_argument("--trace", default="no reuse")
    parser.add_argument("--rates", type=float, nargs="+", default=[100.0, 600.0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--jsonl", type=Path, help="append each run here (and read it back)")
    parser.add_argument("--table", type=Path, nargs="+", help="only print these JSONL files")
    parser.add_argument("--one", nargs=4, metavar=("TRACE", "RATE", "POLICY", "SEED"))
    args = parser.parse_args()
    if args.one:
        trace_name, rate, policy, seed = args.one
        _one(trace_name, float(rate), policy, int(seed))
        return
    if args.table:
        records = [json.loads(line) for path in args.table for line in path.open() if line]
        print("\n".join(table(records, records[0]["variant"])))
        return
    variants = [spec.split("=", 1) for spec in args.variants]
    records = []
    for number in range(args.passes):
        order = variants if number % 2 == 0 else variants[::-1]
        for rate in args.rates:
            for seed in range(args.seeds):
                for label, spec in order:
                    path, policy = spec.rsplit(":", 1)
                    env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
                    # this file by path: PATH's own benchmarks and trio_dpcoord are imported
                    command = [sys.executable, os.path.abspath(__file__), "--one"]
                    done = subprocess.run(
                        [*command, args.trace, str(rate), policy, str(seed)],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    lines = done.stdout.strip().splitlines()
                    record: dict[str, Any] = {"pass": number, "rate": rate, "seed": seed}
                    record["variant"] = label
                    if done.returncode == 0 and lines:
                        record.update(json.loads(lines[-1]))
                    else:
                        record["error"] = done.stderr[-2000:]
                    records.append(record)
                    if args.jsonl:
                        with args.jsonl.open("a") as out:
                            out.write(json.dumps(record) + "\n")
                    print(f"pass {number}, {rate:g}/s, seed {seed}, {label}: done", flush=True)
    print("\n".join(table(records, variants[0][0])))


if __name__ == "__main__":
    main()
