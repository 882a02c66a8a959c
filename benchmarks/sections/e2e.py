"""Section 6, ``e2e``: ``examples/launch_cluster.py --json`` at its defaults (a simulated
cluster end to end), its requests/s, wake latency and errors as it reports them."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

from benchmarks.shared.scenarios import Env
from benchmarks.shared.suite import Row, Suite
from benchmarks.shared.util import REPO_ROOT, spawn, with_death_signal

E2E_WAKE_NOTE = "no baseline: includes the simulated engines' step loop; compare (2)"

LAUNCHER = REPO_ROOT / "examples" / "launch_cluster.py"


def end_to_end(env: Env, timeout_s: float) -> dict[str, Any]:
    """``examples/launch_cluster.py --json`` at its defaults; its last stdout line."""
    argv = with_death_signal([sys.executable, str(LAUNCHER), "--json"])
    log_path = env.log_dir / "launch_cluster.log"
    with spawn("launch_cluster", argv, env.log_dir) as child:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        last: dict[str, Any] | None = None
        with contextlib.suppress(RuntimeError):  # EOF: it exited
            while time.monotonic() < deadline:
                last = child.read_json(max(deadline - time.monotonic(), 0.1))
        wall = time.monotonic() - t0
        status = child.popen.wait(timeout=30)
    if status != 0 or last is None:
        raise RuntimeError(f"launch_cluster.py exited {status}; see {log_path}")
    last["wall_seconds"] = wall
    return last


def e2e_unavailable() -> str | None:
    if not LAUNCHER.exists():
        return "examples/launch_cluster.py does not exist yet"
    return None


def run_section(suite: Suite) -> None:
    reason = e2e_unavailable()
    if reason:
        suite.skipped("6 end to end", "launch_cluster.py", reason)
        return
    summary = end_to_end(suite.env, suite.sizes.e2e_timeout_s)
    suite.details["e2e"] = summary
    requests = summary.get("completed", summary.get("requests"))
    seconds = summary.get("duration_s") or summary.get("elapsed_s")
    rps = summary.get("requests_per_s") or summary.get("rps")
    if rps is None and requests and seconds:
        rps = requests / seconds
    note = "" if rps is not None else "no requests/s or elapsed figure in its summary"
    suite.rows.append(Row("6 end to end", "launch_cluster requests/s", rps, "req/s", note=note))
    wake = summary.get("wake_latency_ms") or {}
    for stat in ("p50", "p99"):
        value = wake.get(stat)
        note = "not in its summary" if value is None else E2E_WAKE_NOTE
        suite.rows.append(
            Row(
                "6 end to end",
                f"launch_cluster wake {stat}",
                None if value is None else value * 1000,
                "us",
                note=note if stat == "p50" else "",
            )
        )
    errors = summary.get("errors")
    suite.rows.append(
        Row(
            "6 end to end",
            "launch_cluster errors",
            errors,
            "",
            target="0",
            met=None if errors is None else errors == 0,
        )
    )
