"""Section 4, ``hot``: the embedded coordinator's per-call costs (``snapshot()``,
``notify_first_request()``, ``engine_loads()``) against a tuple read under a lock, and the
cost of decoding one stats report against ``msgpack.unpackb``."""

from __future__ import annotations

from benchmarks.shared import scenarios as sc
from benchmarks.shared.suite import Row, Suite


def run_section(suite: Suite) -> None:
    result = sc.hot_path(suite.env, suite.sizes.hot_calls)
    suite.details["hot_path"] = result
    for name, key, base_key in (
        ("snapshot()", "snapshot_ns", "baseline_ns"),
        ("notify_first_request() while running", "notify_first_request_ns", "baseline_arg_ns"),
        ("engine_loads() (2 engines)", "engine_loads_ns", "baseline_ns"),
    ):
        row = Row("4 hot path", name, result[key], "ns", result[base_key], "tuple under Lock")
        if key != "engine_loads_ns":
            row.target = "<= 3x"
            row.met = row.ratio is not None and row.ratio <= 3.0
        suite.rows.append(row)
    costs = sc.decode_costs(suite.sizes.hot_calls // 4)
    suite.details["decode_costs"] = costs
    for name, key in (
        ("decode a stats report, msgspec path (fast extra)", "msgspec_path_ns"),
        ("decode a stats report, msgpack path", "msgpack_path_ns"),
    ):
        if key not in costs:
            suite.skipped("4 hot path", name, "msgspec is not installed")
            continue
        suite.rows.append(
            Row("4 hot path", name, costs[key], "ns", costs["unpackb_ns"], "msgpack.unpackb")
        )
