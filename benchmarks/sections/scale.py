"""Section 5, ``scale``: RSS, CPU per wave and the front publish's cost as the fleet grows,
against the forwarder and (standalone) against vLLM's coordinator."""

from __future__ import annotations

import math
from collections.abc import Sequence

from benchmarks.shared import scenarios as sc
from benchmarks.shared.suite import TRIO_FLOOR_NOTE, VLLM_LABEL, Row, Suite


def run_section(suite: Suite) -> None:
    s = suite.sizes
    points: dict[str, dict[int, dict[str, float]]] = {"inproc": {}, "forwarder": {}}
    for n in s.scale_engines:
        for kind in ("forwarder", "inproc"):
            points[kind][n] = sc.scale_point(suite.env, kind, n, s.scale_waves)
        pub = sc.front_publish_cost(n, s.publish_calls)
        points["inproc"][n]["front_publish_us"] = pub["publish_ns"] / 1000
        points["forwarder"][n]["front_publish_us"] = pub["baseline_ns"] / 1000
    suite.details["scale"] = {k: {str(n): v for n, v in p.items()} for k, p in points.items()}
    coord, base = points["inproc"], points["forwarder"]
    for n in s.scale_engines:
        rss = Row(
            "5 scale", f"RSS N={n}", coord[n]["rss_mib"], "MiB", base[n]["rss_mib"], "forwarder"
        )
        if n == 256:
            rss.target = "< 50 MiB"
            rss.met = coord[n]["rss_mib"] < 50
        suite.rows.append(rss)
    for n in s.scale_engines:
        suite.rows.append(
            Row(
                "5 scale",
                f"CPU per wave N={n}",
                coord[n]["cpu_per_wave_us"],
                "us",
                base[n]["cpu_per_wave_us"],
                "forwarder",
            )
        )
    for n in s.scale_engines:
        suite.rows.append(
            Row(
                "5 scale",
                f"front publish N={n}",
                coord[n]["front_publish_us"],
                "us",
                base[n]["front_publish_us"],
                "msgpack.packb",
            )
        )
    slope, r2 = linear_fit([(n, coord[n]["rss_mib"]) for n in s.scale_engines])
    base_slope, _ = linear_fit([(n, base[n]["rss_mib"]) for n in s.scale_engines])
    fit = Row(
        "5 scale",
        "RSS growth per engine",
        slope * 1024,
        "KiB",
        base_slope * 1024,
        "forwarder",
        "linear",
        r2 >= 0.9 or slope * 1024 < 64,
        note=f"least squares over N, R^2 = {r2:.3f}",
    )
    suite.rows.append(fit)
    suite.guarded("5 scale", "vs vLLM", lambda: scale_vs_vllm(suite))


def scale_vs_vllm(suite: Suite) -> None:
    """Standalone against vLLM's coordinator: CPU per wave and RSS with N engines
    connected (interleaved rounds; the least CPU of each, noise only adds), and the
    timed front publish of N engines' counts."""
    s = suite.sizes
    reason = suite.vllm_reason or suite.standalone_reason
    if reason:
        suite.skipped("5 scale", "vs vLLM", reason)
        return
    points: dict[int, dict[str, dict[str, float]]] = {}
    for n in s.vllm_scale_engines:
        rounds: dict[str, list[dict[str, float]]] = {"standalone": [], sc.VLLM: []}
        if n == 8:
            rounds.update({floor: [] for floor in sc.TRIO_FLOORS})
        waves = s.scale_waves if n <= 256 else max(20, s.scale_waves // 2)
        # one round at 1,024 engines in quick mode: its set-up dominates the run time.
        # Over ipc:// ZMTP heartbeats are off by default (as vLLM has none), so there is
        # no separate "heartbeats off" configuration to measure; the spread between
        # rounds of one configuration is what noise does here
        rounds_here = s.vllm_scale_rounds if n < 1024 or suite.full else 1
        for _ in range(rounds_here):
            for kind in rounds:
                rounds[kind].append(sc.scale_point(suite.env, kind, n, waves))
        point = {
            kind: {
                "cpu_per_wave_us": min(r["cpu_per_wave_us"] for r in runs),
                "rss_mib": runs[-1]["rss_mib"],
                "wake_p50_us": min(r["wake_p50_us"] for r in runs),
            }
            for kind, runs in rounds.items()
        }
        if n >= 256:
            point["standalone"]["front_publish_us"] = (
                sc.front_publish_cost(n, s.publish_calls)["publish_ns"] / 1000
            )
            point[sc.VLLM]["front_publish_us"] = (
                sc.vllm_front_publish_cost(suite.env, n, s.publish_calls)["publish_ns"] / 1000
            )
        points[n] = point
    suite.details["scale_vs_vllm"] = {str(n): p for n, p in points.items()}
    for n, point in points.items():
        base = point[sc.VLLM]
        for floor in sc.TRIO_FLOORS:
            if floor in point:
                suite.rows.append(
                    Row(
                        "5 scale",
                        f"CPU per wave N={n} {floor} vs vLLM",
                        point[floor]["cpu_per_wave_us"],
                        "us",
                        base["cpu_per_wave_us"],
                        VLLM_LABEL,
                        note=TRIO_FLOOR_NOTE,
                    )
                )
        ours = point["standalone"]
        for key, figure, unit in (
            ("cpu_per_wave_us", "CPU per wave", "us"),
            ("rss_mib", "RSS", "MiB"),
            ("front_publish_us", "front publish", "us"),
        ):
            if key not in ours or (key == "rss_mib" and n < 256):
                continue
            row = Row(
                "5 scale",
                f"{figure} N={n} standalone vs vLLM",
                ours[key],
                unit,
                base[key],
                VLLM_LABEL,
            )
            if (n == 8 and key == "cpu_per_wave_us") or n == 1024:
                row.target = "<= 1x"
                row.met = row.ratio is not None and row.ratio <= 1.0
            suite.rows.append(row)


def linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope and R^2 of y over x."""
    n = len(points)
    if n < 2:
        return math.nan, math.nan
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    syy = sum((y - my) ** 2 for _, y in points)
    slope = sxy / sxx if sxx else math.nan
    r2 = (sxy * sxy) / (sxx * syy) if sxx and syy else 1.0
    return slope, r2


REAL_SUBCOMMANDS = ("routing_real", "restart_real", "restart_fleet")
"""Subcommands with options of their own, never part of a suite run: ``routing_real``
replays traces on a real ``vllm serve`` per policy (benchmarks/sections/routing_real.py);
``restart_real`` kills the DP coordinator of a real ``vllm serve`` under requests, ours
and vLLM's (benchmarks/sections/restart_real.py); ``restart_fleet`` kills ``serve --supervised``'s
worker under a simulated fleet over tcp (benchmarks/sections/restart_fleet.py)."""
