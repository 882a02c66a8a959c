"""``python -m benchmarks restart_fleet``: ``kill -9`` of ``trio-dpcoord serve --supervised``'s
worker under a simulated fleet over TCP, some kills while a node is partitioned.

Opt-in, a few minutes. As root with ``ip netns`` (:mod:`trio_dpcoord.sim.netns`) it
builds a head namespace and ``--nodes`` node namespaces on a private bridge: the head
runs the coordinator (``serve --supervised``, TCP, ``--allow-remote``), the simulated
front-end and its load; the nodes run the ``--engines`` simulated engine processes
(``python -m trio_dpcoord.sim engine``), spread evenly, rank 0 on node 1 hosting the DP
group's collective. Elsewhere (``--loopback``, or no root) everything runs on loopback
TCP, without partitions, and the report says so. The cluster is
:func:`trio_dpcoord.sim.run_cluster` (standalone mode, as ``tests/test_multihost.py``
runs it); the load is bursts of requests, each burst waiting for its requests before a
short random gap, so that waves end and engines are woken again all the time.

Then the coordinator worker is killed with SIGKILL ``--kills`` times, as often as the
supervisor's bound allows (more than 5 deaths within 60 s end it, docs/protocol.md
§16.3) and each after requests flowed again. Every ``--partition-every``-th kill happens
while one node (rotating, never node 1) is cut off from the bridge, and the node is
healed ``--partition-s`` seconds after the kill (longer than the heartbeat timeout, 3 s):
the new worker meets that node's engines only when they come back.

Figures: requests sent, completed and **lost** (sent and never completed: must be 0);
**wave regressions** as any engine saw them (a START_DP_WAVE older than one it received
before, logged by the simulated engines) and as the front-end saw them (its coordinator's
wave, each engine's reported wave, and a lower wave after a reconnection: all must be 0);
per kill the **recovery time** (kill to the first publish a front-end subscriber receives
from the new worker, :mod:`benchmarks.shared.front_tap`), the time until the new worker's READY
went to every engine, the supervisor's own figure (the new worker bound), and the
requests in flight at the kill.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import re
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import trio

from benchmarks.shared.front_tap import RecoveryTap, open_recovery_tap
from trio_dpcoord.sim import ClusterConfig, ClusterReport, LoadPlan, SimFrontend, run_cluster
from trio_dpcoord.sim.cluster_config import percentile
from trio_dpcoord.sim.netns import NetworkLab, inside, network_lab, unavailable_reason

logger = logging.getLogger("benchmarks.restart_fleet")

WORKER_LINE = re.compile(r"coordinator worker (?:\(pid |restarted as pid )(\d+)")
BOUND_LINE = re.compile(r"restarted as pid \d+: bound the same addresses ([0-9.]+) s after")
READY_LINE = re.compile(r"READY sent to (\d+) engines")
BROADCAST_REGRESSION = re.compile(r"START_DP_WAVE\(\d+\) after START_DP_WAVE\(\d+\)")
RESTART_BOUND = (5, 60.0)
MIN_GAP_S = 3.0
FLOWED = 64
"""Requests completed after a kill (and the new worker's first publish) before the next."""
RECOVERY_TIMEOUT = 60.0
FRONT_PORT = 7100
COLLECTIVE_PORT = 7000


@dataclass
class Kill:
    number: int
    at_s: float
    pid: int
    in_flight: int
    wave: int
    partitioned: str | None = None
    """The node cut off at the kill (healed ``partition_s`` after it), if any."""
    healed_s: float | None = None
    """Kill to heal."""
    after_heal_s: float | None = None
    """Heal to the first publish from the new worker."""
    recovery_s: float | None = None
    """Kill to the first publish a front-end received from the new worker."""
    tap_reconnected_s: float | None = None
    """Kill to the front subscriber's reconnection (its handshake with the new worker)."""
    ready_s: float | None = None
    """Kill to the new worker's READY to every engine (its gate open)."""
    supervisor_bound_s: float | None = None
    waves_resumed: bool = False
    """The front-end's wave moved past the kill's afterwards."""


@dataclass
class FleetResult:
    engines: int
    nodes: int
    network: str
    kills: list[Kill] = field(default_factory=list)
    requests: int = 0
    completed: int = 0
    lost: int = 0
    engine_wave_regressions: int = 0
    frontend_wave_regressions: int = 0
    frontend_wave_resets: int = 0
    collective_timeouts: int = 0
    engine_failures: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    coordinator_errors: int = 0
    duration_s: float = 0.0
    stopped: str = ""


@dataclass
class _Run:
    lab: NetworkLab | None
    log: TextIO
    lines: list[tuple[float, str]] = field(default_factory=list)
    frontend: SimFrontend | None = None
    started: trio.Event = field(default_factory=trio.Event)
    stop: trio.Event = field(default_factory=trio.Event)

    def log_line(self, line: str) -> None:
        self.lines.append((trio.current_time(), line))
        self.log.write(line + "\n")

    def matching(self, pattern: re.Pattern[str], after: float = -math.inf) -> list[re.Match[str]]:
        return [m for t, line in self.lines if t >= after and (m := pattern.search(line))]

    def first_time(self, pattern: re.Pattern[str], after: float) -> float | None:
        return next((t for t, line in self.lines if t >= after and pattern.search(line)), None)


def _config(options: argparse.Namespace, lab: NetworkLab | None) -> ClusterConfig:
    host = lab.head_address if lab is not None else "127.0.0.1"
    if lab is not None:
        per_node = math.ceil(options.engines / len(lab.nodes))
        prefixes = tuple(
            lab.prefix(lab.nodes[rank // per_node].namespace) for rank in range(options.engines)
        )
        collective = f"tcp://{lab.nodes[0].address}:{COLLECTIVE_PORT}"
    else:
        prefixes, collective = (), None
    return ClusterConfig(
        engines=options.engines,
        mode="standalone",
        load=LoadPlan(requests=1, seed=options.seed),  # the load is _drive's
        step_time=options.step_time,
        collective_timeout=30.0,
        ready_timeout=240.0,
        stall_timeout=90.0,
        host=host,
        engine_prefix=prefixes,
        collective_address=collective,
        coordinator_prefix=lab.prefix(lab.head) if lab is not None else (),
        coordinator_args=(
            "--supervised",
            "--log-level=INFO",
            f"--front=tcp://{host}:{options.front_port}",
        ),
    )


async def _drive(run: _Run, options: argparse.Namespace, frontend: SimFrontend) -> None:
    """Bursts of requests until told to stop, each burst finished before a short gap."""
    run.frontend = frontend
    run.started.set()
    rng = random.Random(options.seed)
    while not run.stop.is_set():
        for _ in range(rng.randint(options.engines // 2, 2 * options.engines)):
            await frontend.submit(max_tokens=rng.randint(4, 16))
        await frontend.wait_for(lambda f: f.pending == 0)
        await trio.sleep(rng.uniform(0.0, 0.15))


def _worker_pid(run: _Run) -> int:
    found = run.matching(WORKER_LINE)
    if not found:
        raise RuntimeError("the supervisor has not named its worker")
    return int(found[-1].group(1))


async def _faults(run: _Run, options: argparse.Namespace, result: FleetResult) -> None:
    await run.started.wait()
    frontend = run.frontend
    assert frontend is not None
    with trio.fail_after(60):
        while not run.matching(WORKER_LINE):  # noqa: ASYNC110 - the log grows elsewhere
            await trio.sleep(0.05)
    front = f"tcp://{run.lab.head_address if run.lab else '127.0.0.1'}:{options.front_port}"
    async with open_recovery_tap(front) as tap:
        begin = trio.current_time()
        await frontend.wait_for(lambda f: f.completed >= 4 * options.engines)
        times: list[float] = []
        last = begin
        for number in range(1, options.kills + 1):
            earliest = last + MIN_GAP_S
            count, window = RESTART_BOUND
            if len(times) >= count:  # stay within the supervisor's bound
                earliest = max(earliest, times[-count] + window + 1.0)
            await trio.sleep_until(earliest)
            with trio.move_on_after(10):  # under load: a burst in flight
                await frontend.wait_for(lambda f: f.pending >= options.engines // 2)
            node = None
            every = options.partition_every
            if run.lab is not None and every and number % every == 0:
                others = run.lab.nodes[1:]
                node = others[(number // every - 1) % len(others)]
                run.lab.partition(node)
                await trio.sleep(0.5)
            snapshot = frontend.view.snapshot()
            at = trio.current_time()
            kill = Kill(
                number,
                round(at - begin, 3),
                _worker_pid(run),
                frontend.pending,
                snapshot.current_wave,
                node.namespace if node is not None else None,
            )
            os.kill(kill.pid, signal.SIGKILL)
            times.append(at)
            result.kills.append(kill)
            completed = frontend.completed
            logger.info("kill %d of pid %d, %d in flight", number, kill.pid, kill.in_flight)
            if node is not None and run.lab is not None:
                await trio.sleep(options.partition_s)
                run.lab.heal(node)
                kill.healed_s = trio.current_time() - at
            recovered = await _recovered(run, tap, frontend, at, completed, kill)
            logger.info("kill %d: %s", number, kill)
            if not recovered:
                result.stopped = f"after kill {number}: no recovery within {RECOVERY_TIMEOUT:g} s"
                break
            last = at
    run.stop.set()


async def _recovered(
    run: _Run, tap: RecoveryTap, frontend: SimFrontend, at: float, completed: int, kill: Kill
) -> bool:
    """Wait for the kill's recovery figures (bounded); True if requests flowed again."""
    with trio.move_on_after(RECOVERY_TIMEOUT):
        while not (  # noqa: ASYNC110 - the tap, the log and the front-end change elsewhere
            tap.recovery(at) is not None
            and run.first_time(READY_LINE, at) is not None
            and frontend.completed >= completed + FLOWED
            and frontend.view.snapshot().current_wave > kill.wave
        ):
            await trio.sleep(0.05)
    kill.recovery_s = tap.recovery(at)
    kill.tap_reconnected_s = tap.reconnected(at)
    if kill.recovery_s is not None and kill.healed_s is not None:
        kill.after_heal_s = kill.recovery_s - kill.healed_s
    ready = run.first_time(READY_LINE, at)
    kill.ready_s = None if ready is None else ready - at
    bound = run.matching(BOUND_LINE)
    if len(bound) >= kill.number:
        kill.supervisor_bound_s = float(bound[kill.number - 1].group(1))
    kill.waves_resumed = frontend.view.snapshot().current_wave > kill.wave
    return kill.recovery_s is not None and frontend.completed >= completed + FLOWED


async def _main(options: argparse.Namespace, lab: NetworkLab | None, log: TextIO) -> FleetResult:
    network = "netns" if lab is not None else "loopback tcp (no network namespaces: no partitions)"
    result = FleetResult(options.engines, len(lab.nodes) if lab else 1, network)
    run = _Run(lab, log)
    report: ClusterReport | None = None
    with inside(lab.head) if lab is not None else contextlib.nullcontext():
        async with trio.open_nursery() as nursery:

            async def cluster() -> None:
                nonlocal report
                report = await run_cluster(
                    _config(options, lab),
                    log_line=run.log_line,
                    drive=lambda frontend: _drive(run, options, frontend),
                )
                nursery.cancel_scope.cancel()

            nursery.start_soon(cluster)
            await _faults(run, options, result)
    assert report is not None
    result.requests = report.requests
    result.completed = report.completed
    result.lost = report.requests - report.completed
    result.engine_wave_regressions = len(run.matching(BROADCAST_REGRESSION))
    result.frontend_wave_regressions = report.wave_regressions
    result.frontend_wave_resets = report.wave_resets
    result.collective_timeouts = len(report.collective_timeouts)
    result.engine_failures = list(report.engine_failures)
    result.failures = list(report.failures)
    result.coordinator_errors = report.coordinator_errors
    result.duration_s = round(report.duration, 1)
    return result


@contextlib.contextmanager
def _network(options: argparse.Namespace) -> Iterator[NetworkLab | None]:
    """The lab (and the front port in it), or None: loopback, a free front port."""
    reason = "--loopback" if options.loopback else unavailable_reason()
    if reason is not None:
        logger.warning("loopback tcp, no partitions: %s", reason)
        if options.front_port is None:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                options.front_port = probe.getsockname()[1]
        yield None
        return
    if options.front_port is None:
        options.front_port = FRONT_PORT  # the head namespace is private
    with network_lab(options.nodes) as lab:
        yield lab


def table(results: Sequence[FleetResult]) -> str:
    lines = []
    for r in results:

        def figures(kills: list[Kill], attr: str) -> str:
            values = [getattr(k, attr) for k in kills if getattr(k, attr) is not None]
            if not values:
                return "-"
            never = len(kills) - len(values)
            text = (
                "/".join(f"{percentile(values, q) * 1000:.0f}" for q in (50, 99))
                + f"/{max(values) * 1000:.0f} ms"
            )
            return text + (f" ({never} never)" if never else "")

        plain = [k for k in r.kills if k.partitioned is None]
        cut = [k for k in r.kills if k.partitioned is not None]
        lines += [
            f"simulated fleet: {r.engines} engines on {r.nodes} node(s), {r.network}",
            f"  kills {len(r.kills)} ({len(cut)} during a partition), duration {r.duration_s} s",
            f"  requests {r.requests}, completed {r.completed}, lost {r.lost}",
            f"  wave regressions: engines {r.engine_wave_regressions}, front-end "
            f"{r.frontend_wave_regressions}, resets {r.frontend_wave_resets}",
            f"  recovery p50/p99/max, no partition: {figures(plain, 'recovery_s')}; "
            f"READY to all {figures(plain, 'ready_s')}",
            f"  recovery p50/p99/max, partitioned: {figures(cut, 'recovery_s')}; "
            f"READY to all {figures(cut, 'ready_s')}; healed {figures(cut, 'healed_s')}, "
            f"heal to first publish {figures(cut, 'after_heal_s')}",
            "  supervisor bound the new worker p50/p99/max: "
            f"{figures(r.kills, 'supervisor_bound_s')}",
            f"  in flight at the kills: {[k.in_flight for k in r.kills]}",
            f"  collective timeouts {r.collective_timeouts}, engine failures "
            f"{len(r.engine_failures)}, run failures {r.failures}, coordinator errors "
            f"{r.coordinator_errors}",
        ]
        if r.stopped:
            lines.append(f"  stopped: {r.stopped}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks restart_fleet", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--partition-every", type=int, default=3, help="0: never")
    parser.add_argument("--partition-s", type=float, default=4.0)
    parser.add_argument("--step-time", type=float, default=0.005)
    parser.add_argument(
        "--front-port",
        type=int,
        help=f"the coordinator's front port (default: {FRONT_PORT} in the head namespace, "
        "a free one on loopback)",
    )
    parser.add_argument("--loopback", action="store_true", help="no namespaces, no partitions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, help="the children's stderr lines (default: discarded)")
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("trio_dpcoord").setLevel(logging.WARNING)
    with (
        open(options.log or os.devnull, "w") as log,
        _network(options) as lab,
    ):
        result = trio.run(_main, options, lab, log)
    print(json.dumps(asdict(result)), flush=True)
    print()
    print(table([result]))
    if options.json:
        options.json.write_text(
            json.dumps({"argv": sys.argv[1:], "result": asdict(result)}, indent=1) + "\n"
        )
    return 0
