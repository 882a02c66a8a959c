"""Run a whole simulated vLLM DP cluster on one machine and watch the coordinator work.

    python examples/launch_cluster.py                       # inproc coordinator, 4 engines
    python examples/launch_cluster.py --mode standalone     # `trio-dpcoord serve` + open_frontend
    python examples/launch_cluster.py --engines 2 --wake-path frontend --json
    python examples/launch_cluster.py --timeline waves.png     # a picture of the run
    python examples/launch_cluster.py --routing prefix --sessions 16   # prefix-aware choice
    python examples/launch_cluster.py --routing prefix --sessions 16 --prefix-cache 256 --kv-events
    python examples/launch_cluster.py --engine-protocol vllm   # through open_engine_client

One command starts the coordinator (embedded in this trio front-end, or as the
standalone ``python -m trio_dpcoord serve`` process), N simulated MoE engine processes
that step in lock-step through a real collective, and a load generator that sends
``--requests`` requests in bursts separated by idle gaps, so that many waves start and
end. A live progress line goes to stderr when it is a terminal; the summary goes to
stdout, and with ``--json`` the last stdout line is the summary as one JSON object.

With ``--engine-protocol vllm`` the engines speak vLLM's engine-core protocol (the
handshake, ``EngineCoreRequest``/``EngineCoreOutputs``, utility calls) and the load goes
through :func:`trio_dpcoord.open_engine_client`, the client real vLLM engines get, with
the coordinator embedded in it (inproc only; pauses are vLLM's ``pause_scheduler("keep")``
and ``resume_scheduler`` utility calls).

Exit status: 0 only when every request completed, no collective timed out and no error
was counted (coordinator included); 1 otherwise; 130 when interrupted (Ctrl-C stops
everything cleanly, no process is left behind).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Sequence

import trio

from trio_dpcoord import EngineChooser
from trio_dpcoord.sim import (
    ENGINE_CLIENT_MODE,
    ClusterConfig,
    ClusterReport,
    LoadPlan,
    Progress,
    plot_timeline,
    run_cluster,
    run_engine_core_cluster,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Run a simulated DP cluster (coordinator, front-end, engine processes).",
    )
    parser.add_argument(
        "--mode",
        choices=("inproc", "standalone"),
        default="inproc",
        help="embed open_coordinator (inproc) or run `trio-dpcoord serve` "
        "(standalone) (default: %(default)s)",
    )
    parser.add_argument(
        "--engine-protocol",
        choices=("sim", "vllm"),
        default="sim",
        help="how the front-end talks to the engines: the simulation's front-end "
        "(sim) or vLLM's engine-core protocol through open_engine_client (vllm) "
        "(default: %(default)s)",
    )
    parser.add_argument("--engines", type=int, default=4, help="DP size (default: %(default)s)")
    parser.add_argument(
        "--requests", type=int, default=400, help="requests to send (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the load generator (default: %(default)s)"
    )
    parser.add_argument(
        "--wake-path",
        choices=("frontend", "engine", "both"),
        default="both",
        help="who wakes paused engines: the engines' start_wave (engine, vLLM "
        ">= 0.33), the front-end's notify_first_request with pre-0.33 engines "
        "(frontend), or both (default: %(default)s)",
    )
    parser.add_argument(
        "--routing",
        choices=EngineChooser.ROUTINGS,
        default="vllm",
        help="the front-end's engine choice: vLLM 0.33.0's score (vllm) or prefix-cache "
        "affinity weighed against the busiest rank (prefix) (default: %(default)s)",
    )
    parser.add_argument(
        "--sessions",
        type=int,
        default=0,
        help="send multi-turn chat prompts over N sessions sharing a system prompt "
        "instead of a fixed 4-token prompt, 0 for the latter (default: %(default)s)",
    )
    parser.add_argument(
        "--prefix-cache",
        type=int,
        default=0,
        metavar="BLOCKS",
        help="give every engine an LRU prefix cache of BLOCKS 16-token blocks: engines "
        "compute only uncached prompt tokens, each step grows with its tokens "
        "(--step-per-token) and they report prefix-cache hits, shown in the summary "
        "(default: 0, no cache, fixed steps)",
    )
    parser.add_argument(
        "--step-per-token",
        type=float,
        default=2e-5,
        help="with --prefix-cache: seconds each processed token adds to a step (the "
        "lock-step model's assumed 50k tokens/s of prefill) (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="with --prefix-cache: engines publish vLLM KV-cache events and the front-end "
        "feeds them to the prefix routing (its exact feed)",
    )
    parser.add_argument(
        "--step-time",
        type=float,
        default=0.002,
        help="seconds per engine step (default: %(default)s)",
    )
    parser.add_argument(
        "--max-running",
        type=int,
        default=8,
        help="requests an engine advances per step (default: %(default)s)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        nargs=2,
        default=(4, 16),
        metavar=("MIN", "MAX"),
        help="tokens per request, drawn uniformly (default: 4 16)",
    )
    parser.add_argument(
        "--burst",
        type=int,
        nargs=2,
        default=(5, 40),
        metavar=("MIN", "MAX"),
        help="requests per burst (default: 5 40)",
    )
    parser.add_argument(
        "--gap",
        type=float,
        nargs=2,
        default=(0.0, 0.25),
        metavar=("MIN", "MAX"),
        help="idle seconds after a burst finished (default: 0 0.25)",
    )
    parser.add_argument(
        "--pause-every",
        type=int,
        default=5,
        help="pause and resume all engines every N bursts, 0 never (default: %(default)s)",
    )
    parser.add_argument(
        "--sync-interval",
        type=int,
        default=16,
        help="engines' dp_sync_interval (default: %(default)s)",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=10.0,
        help="seconds a step may wait for the other ranks (default: %(default)s)",
    )
    parser.add_argument(
        "--restart-vanished",
        action="store_true",
        help="restart an engine process that exits unexpectedly and resubmit its "
        "in-flight requests, the whole DP group when its collective timed out, and a "
        "standalone coordinator on the same addresses, instead of ending the run",
    )
    parser.add_argument(
        "--json", action="store_true", help="make the last stdout line the summary as JSON"
    )
    parser.add_argument(
        "--timeline",
        metavar="PATH",
        default=None,
        help="draw the run to PATH (.png or .svg): one band per engine (running / idle / "
        "paused), wave numbers, wake-ups and their latency, requests in flight; needs "
        "matplotlib (pip install 'trio-dpcoord[plot]')",
    )
    parser.add_argument(
        "--log-level",
        default="ERROR",
        help="log level of this process and the children (default: %(default)s)",
    )
    return parser


class _ProgressLine:
    """One updating line on stderr, only when stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._shown = False

    def show(self, p: Progress) -> None:
        if not self.enabled:
            return
        state = "running" if p.running else "paused "
        load = " ".join(
            f"{n:>3}{'*' if running else ' '}"
            for n, running in zip(p.engine_pending, p.engine_running, strict=False)
        )
        sys.stderr.write(
            f"\r\x1b[K{p.completed:>6}/{p.total} done  wave {p.wave:>4} {state}  "
            f"in flight per engine (* = stepping): {load}"
        )
        sys.stderr.flush()
        self._shown = True

    def clear(self) -> None:
        if self.enabled and self._shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self._shown = False

    def log_line(self, line: str) -> None:
        self.clear()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _summary(report: ClusterReport) -> str:
    lat = report.wake_latency_ms()

    def ms(value: float | int | None) -> str:
        return "n/a" if value is None else f"{value:.1f} ms"

    coordinator = f"{report.mode} coordinator"
    if report.mode == ENGINE_CLIENT_MODE:
        coordinator = "vLLM engine-core protocol, coordinator inside open_engine_client"
    lines = [
        f"simulated cluster: {coordinator}, {report.engines} engines, "
        f"wake path {report.wake_path}, routing {report.routing}, seed {report.seed}",
        f"  requests sent / completed: {report.requests} / {report.completed} "
        f"(planned {report.planned})",
        *_prefix_lines(report),
        f"  waves: {report.waves}   pauses: {report.pauses}   "
        f"front-end wake notices: {report.notifications}",
        f"  wake latency (request to an idle cluster -> every engine running): "
        f"p50 {ms(lat['p50'])}, p99 {ms(lat['p99'])}, max {ms(lat['max'])} "
        f"({lat['count']} wakes)",
        f"  errors: {report.errors} (coordinator {report.coordinator_errors}, "
        f"wave regressions {report.wave_regressions})   "
        f"collective timeouts: {len(report.collective_timeouts)}",
    ]
    lines += [f"  collective timeout: {line}" for line in report.collective_timeouts]
    lines += [f"  engine failure: {line}" for line in report.engine_failures]
    lines += [f"  engine restarted: {line}" for line in report.engine_restarts]
    lines += [f"  DP group restarted after: {line}" for line in report.group_restarts]
    lines += [f"  coordinator restarted: {line}" for line in report.coordinator_restarts]
    if report.engine_restarts or report.group_restarts:
        lines.append(f"  requests resubmitted: {report.resubmitted}")
    lines += [f"  failure: {line}" for line in report.failures]
    lines.append(f"  duration: {report.duration:.1f} s   result: {'OK' if report.ok else 'FAILED'}")
    return "\n".join(lines)


def _prefix_lines(report: ClusterReport) -> list[str]:
    """The engines' own prefix-cache figures, when they have a cache."""
    rate = report.prefix_hit_rate
    if rate is None:
        return []
    per_engine = " ".join(
        f"{hits / queries:.0%}" if queries else "-"
        for hits, queries in zip(report.prefix_hits, report.prefix_queries, strict=True)
    )
    events = f", {report.kv_event_batches} KV-event batches" if report.kv_event_batches else ""
    return [
        f"  prefix-cache hit rate measured by the engines: {rate:.1%} "
        f"({sum(report.prefix_hits)} of {sum(report.prefix_queries)} prompt tokens; "
        f"per engine {per_engine}){events}"
    ]


async def _run(
    config: ClusterConfig, progress: _ProgressLine, engine_protocol: str = "sim"
) -> ClusterReport | None:
    """Run the cluster; SIGINT/SIGTERM cancel it (children are reaped) and return None."""
    report: ClusterReport | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    progress.log_line("interrupted: stopping the cluster")
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            if engine_protocol == "vllm":
                report = await run_engine_core_cluster(config, log_line=progress.log_line)
            else:
                report = await run_cluster(
                    config, progress=progress.show, log_line=progress.log_line
                )
            nursery.cancel_scope.cancel()
    progress.clear()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = ClusterConfig(
            engines=args.engines,
            mode=args.mode,
            wake_path=args.wake_path,
            load=LoadPlan(
                requests=args.requests,
                seed=args.seed,
                burst=(args.burst[0], args.burst[1]),
                gap=(args.gap[0], args.gap[1]),
                tokens=(args.tokens[0], args.tokens[1]),
                pause_every=args.pause_every,
                sessions=args.sessions,
            ),
            routing=args.routing,
            prefix_cache_blocks=args.prefix_cache,
            step_per_token=args.step_per_token if args.prefix_cache else 0.0,
            kv_events=args.kv_events,
            step_time=args.step_time,
            max_running=args.max_running,
            sync_interval=args.sync_interval,
            collective_timeout=args.collective_timeout,
            engine_log_level=args.log_level.upper(),
            restart_vanished=args.restart_vanished,
            record_timeline=args.timeline is not None,
        )
    except ValueError as exc:
        print(f"launch_cluster: {exc}", file=sys.stderr)
        return 2
    if args.engine_protocol == "vllm":
        unsupported = [
            option
            for option, used in (
                ("--mode standalone", args.mode != "inproc"),
                ("--wake-path", args.wake_path != "both"),
                ("--restart-vanished", args.restart_vanished),
                ("--timeline", args.timeline is not None),
                ("--prefix-cache", args.prefix_cache > 0),
            )
            if used
        ]
        if unsupported:
            print(
                f"launch_cluster: --engine-protocol vllm does not take {', '.join(unsupported)}",
                file=sys.stderr,
            )
            return 2
    progress = _ProgressLine(sys.stderr.isatty())
    report = trio.run(_run, config, progress, args.engine_protocol)
    if report is None:
        print("interrupted: every process stopped", file=sys.stderr)
        return 130
    print(_summary(report), flush=True)
    if args.timeline is not None and report.timeline is not None:
        title = (
            f"{report.engines} engines, {report.mode} coordinator, wake path "
            f"{report.wake_path}: {report.completed} requests, {report.waves} waves"
        )
        try:
            plot_timeline(report.timeline, args.timeline, title=title)
        except (RuntimeError, OSError, ValueError) as exc:
            print(f"launch_cluster: cannot draw the timeline: {exc}", file=sys.stderr)
            return 1
        print(f"  timeline: {args.timeline}", flush=True)
    if args.json:
        print(json.dumps(report.to_json()), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
