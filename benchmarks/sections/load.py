"""Section 3, ``load``: wake latency while stats arrive at half the coordinator's ingest
rate of section 1, against the idle forwarder and vLLM's coordinator under the same load."""

from __future__ import annotations

from benchmarks.sections.ingest import INGEST_ENGINES
from benchmarks.sections.ingest import measure as measure_stream
from benchmarks.shared import scenarios as sc
from benchmarks.shared.suite import VLLM_LABEL, Row, Suite

LOAD_FRACTION = 0.5
"""Stats load during (3), as a fraction of the coordinator's ingest throughput from (1):
at 1.0 it would be saturated by definition and latency would be its queue length."""


def run_section(suite: Suite) -> None:
    s = suite.sizes
    inproc_rate = suite.details.get("ingest_inproc", {}).get("rate")
    if not inproc_rate:
        inproc_rate = sc.ingest(suite.env, "inproc", s.ingest_total // 2, s.ingest_pushers)["rate"]
    rate = LOAD_FRACTION * inproc_rate
    for n in s.load_engines:
        idle_key = f"wake_{n}"
        if idle_key not in suite.details:
            suite.details[idle_key] = sc.wake_compare(
                suite.env, n, s.waves, {"forwarder": ("start_wave",)}
            )
        idle = suite.details[idle_key]["forwarder start_wave"]
        result = sc.wake_compare(
            suite.env, n, s.waves, {"inproc": ("start_wave",)}, load_rate=rate
        )["inproc start_wave"]
        suite.details[f"load_{n}"] = result
        note = (
            f"stats at {result['load_rate_achieved']:,.0f} msg/s"
            f" ({LOAD_FRACTION:g} x the inproc ingest rate of (1))"
        )
        for stat in ("p50", "p99", "max"):
            row = Row(
                "3 wake+load",
                f"N={n} inproc start_wave {stat}",
                result[stat],
                "us",
                idle[stat],
                "idle forwarder",
                note=note if stat == "p99" else "",
            )
            if n == 8 and stat == "p99":
                row.target = "<= 5x"
                row.met = row.ratio is not None and row.ratio <= 5.0
            suite.rows.append(row)
    suite.guarded("3 wake+load", "vs vLLM", lambda: load_vs_vllm(suite))


def load_vs_vllm(suite: Suite) -> None:
    """Standalone and vLLM's coordinator, N = 8, interleaved, each under the same stats
    load: half of vLLM's ingest rate from (1) (or of ours, when it did not run)."""
    reason = suite.vllm_reason or suite.standalone_reason
    if reason:
        suite.skipped("3 wake+load", "N=8 vs vLLM", reason)
        return
    s = suite.sizes
    rounds = suite.details.get("ingest_vs_vllm_rounds", {})
    vllm_rate = max(rounds.get(sc.VLLM, [0.0]))
    if not vllm_rate:
        total = s.vllm_ingest_total // 2
        vllm_rate = measure_stream(suite.env, sc.VLLM, INGEST_ENGINES, total)["rate"]
    rate = LOAD_FRACTION * vllm_rate
    result = sc.wake_compare(
        suite.env,
        8,
        s.waves,
        {"standalone": ("start_wave",), sc.VLLM: ("start_wave",)},
        load_rate=rate,
    )
    suite.details["load_vs_vllm_8"] = result
    ours, base = result["standalone start_wave"], result[f"{sc.VLLM} start_wave"]
    note = (
        f"stats at {ours['load_rate_achieved']:,.0f} msg/s to each"
        f" ({LOAD_FRACTION:g} x vLLM's 1-pusher ingest rate of (1))"
    )
    for stat in ("p50", "p99", "max"):
        suite.rows.append(
            Row(
                "3 wake+load",
                f"N=8 standalone start_wave {stat} under load vs vLLM",
                ours[stat],
                "us",
                base[stat],
                f"{VLLM_LABEL}, same load",
                note=note if stat == "p99" else "",
            )
        )
