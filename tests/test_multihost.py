"""Several hosts and a network that fails: a cluster across network
namespaces on one machine, faults injected under a bursty load.

The head namespace runs ``trio-dpcoord serve`` (TCP, ``--allow-remote`` on the private
test network) and the front-end with its load; two node namespaces run two simulated
engines each (ranks 0, 1 on node 1, which hosts the collective; ranks 2, 3 on node 2).
Faults hit node 2 or the coordinator. Each test prints one ``FIGURE`` line (what the
README's reliability section quotes): run them with ``-s`` to see them.

They need root and ``ip netns``; elsewhere they skip with that reason.
"""

from __future__ import annotations

import math
import os
import re
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import pytest
import trio

from trio_dpcoord.sim import (
    ClusterConfig,
    ClusterReport,
    LoadPlan,
    Progress,
    SimFrontend,
    run_cluster,
)
from trio_dpcoord.sim.netns import NetworkLab, Node, inside, network_lab, unavailable_reason

HEARTBEAT_TIMEOUT = 3.0
NOTICE_WITHIN = 1.0 + HEARTBEAT_TIMEOUT  # the coordinator's default heartbeat settings


@pytest.fixture
def lab() -> Iterator[NetworkLab]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with network_lab(2) as built:
        yield built


@dataclass
class Run:
    """One cluster run in the lab: its log lines with their arrival times, its progress."""

    lab: NetworkLab
    lines: list[tuple[float, str]] = field(default_factory=list)
    progress: Progress | None = None
    changed: trio.Event = field(default_factory=trio.Event)
    load_done_at: float = math.inf
    """When every request had completed (the fleet's shutdown comes after)."""

    def log_line(self, line: str) -> None:
        self.lines.append((trio.current_time(), line))
        self._notify()

    def on_progress(self, progress: Progress) -> None:
        self.progress = progress
        if progress.completed >= progress.total and self.load_done_at == math.inf:
            self.load_done_at = trio.current_time()
        self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_progress(self, predicate: Callable[[Progress], bool]) -> Progress:
        while self.progress is None or not predicate(self.progress):
            await self.changed.wait()
        return self.progress

    def matching(
        self, pattern: str, *, after: float = -1.0, before: float = math.inf
    ) -> list[tuple[float, str]]:
        regex = re.compile(pattern)
        return [(t, line) for t, line in self.lines if after <= t <= before and regex.search(line)]

    async def wait_line(self, pattern: str, *, count: int = 1, after: float = -1.0) -> float:
        """Arrival time of the ``count``-th line matching ``pattern`` (after ``after``)."""
        while len(found := self.matching(pattern, after=after)) < count:
            await self.changed.wait()
        return found[count - 1][0]


def _config(
    lab: NetworkLab,
    *,
    requests: int,
    collective_timeout: float = 30.0,
    restart_vanished: bool = False,
) -> ClusterConfig:
    node1, node2 = lab.nodes
    return ClusterConfig(
        engines=4,
        mode="standalone",
        load=LoadPlan(requests=requests, burst=(8, 24), gap=(0.0, 0.1), pause_every=0),
        collective_timeout=collective_timeout,
        restart_vanished=restart_vanished,
        host=lab.head_address,
        engine_prefix=tuple(lab.prefix(n.namespace) for n in (node1, node1, node2, node2)),
        collective_address=f"tcp://{node1.address}:7000",
        # INFO: the coordinator's late subscriptions (READY again) are logged at INFO
        coordinator_args=("--log-level=INFO",),
        coordinator_prefix=lab.prefix(lab.head),
        ready_timeout=30.0,
        stall_timeout=60.0,
    )


def _lost(node: Node, socket: str = "engine (broadcast|output)") -> str:
    return rf"{socket} socket tcp://\S+ lost peer {re.escape(node.address)}:\d+"


async def _run(run: Run, config: ClusterConfig, faults: Callable[[Run], object]) -> ClusterReport:
    """Run the cluster in the head namespace with ``faults(run)`` (a coroutine function)
    alongside; the run's own bound is generous, a hang fails the test."""
    report: ClusterReport | None = None
    with inside(run.lab.head), trio.fail_after(150):
        async with trio.open_nursery() as nursery:

            async def cluster() -> None:
                nonlocal report
                report = await run_cluster(config, progress=run.on_progress, log_line=run.log_line)
                nursery.cancel_scope.cancel()

            nursery.start_soon(cluster)
            await faults(run)  # type: ignore[misc]
            await trio.sleep_forever()
    assert report is not None
    return report


def _tail(run: Run, n: int = 30) -> list[str]:
    return [line for _, line in run.lines[-n:]]


def _why(report: ClusterReport, run: Run) -> tuple[object, ...]:
    return (report.failures, report.engine_failures, report.to_json(), _tail(run))


async def test_a_long_partition_is_reported_and_heals_with_ready_again(lab: NetworkLab) -> None:
    """Node 2 cut off for twice the heartbeat timeout, mid-load: the coordinator drops
    both its engines within the timeout (their address in the log), nothing else; on
    heal they subscribe again and get READY; the collective survives (its timeout is
    longer), no wave goes backwards and every request completes."""
    node2 = lab.nodes[1]
    figures: dict[str, float] = {}

    async def faults(run: Run) -> None:
        await run.wait_progress(lambda p: p.completed >= 40)
        lab.partition(node2)
        cut = trio.current_time()
        noticed = await run.wait_line(_lost(node2, "engine broadcast"), count=2, after=cut)
        await trio.sleep(max(0.0, cut + 2 * HEARTBEAT_TIMEOUT - trio.current_time()))
        lab.heal(node2)
        healed = trio.current_time()
        assert run.progress is not None
        figures["completed_at_heal"] = run.progress.completed
        back = await run.wait_line(r"late engine subscription", count=2, after=healed)
        figures.update(cut=cut, back=back, notice=noticed - cut, recover=back - healed)

    run = Run(lab)
    report = await _run(run, _config(lab, requests=400), faults)
    assert report.ok, _why(report, run)
    assert report.requests == report.completed == 400
    assert figures["completed_at_heal"] < 300  # the load went on after the heal
    assert report.wave_regressions == report.wave_resets == 0
    window = {"after": figures["cut"], "before": figures["back"]}
    assert len(run.matching(_lost(node2, "engine broadcast"), **window)) == 2
    assert len(run.matching(_lost(node2, "engine output"), **window)) == 2
    assert run.matching(_lost(lab.nodes[0]), **window) == []
    assert len(run.matching(r"an engine unsubscribed", **window)) == 2
    assert run.matching(r"lost peer|unsubscribed", before=figures["cut"]) == []
    assert figures["notice"] <= NOTICE_WITHIN + 2.0
    print(
        f"FIGURE long partition (6 s): noticed after {figures['notice']:.1f} s, "
        f"READY again {figures['recover']:.1f} s after heal, "
        f"requests lost {report.requests - report.completed}"
    )


@pytest.mark.parametrize("restart", [False, True], ids=["fails-loudly", "restart-vanished"])
async def test_a_partition_longer_than_the_collective_timeout(
    lab: NetworkLab, restart: bool
) -> None:
    """Node 2 cut off mid-wave for 10 s, the collective's timeout is 4 s: the DP group
    cannot survive it. Without restart_vanished the run fails with the collective's
    named diagnostic (ranks 2 and 3 never arrived); with it, the whole group restarts,
    ranks 2 and 3 come back once the partition heals, and every request completes."""
    node2 = lab.nodes[1]
    figures: dict[str, float] = {}

    async def faults(run: Run) -> None:
        await run.wait_progress(lambda p: p.completed >= 40 and any(p.engine_running))
        lab.partition(node2)
        await trio.sleep(10.0)
        lab.heal(node2)
        healed = trio.current_time()
        assert run.progress is not None
        done = run.progress.completed
        await run.wait_progress(lambda p: p.completed > done)
        figures["recover"] = trio.current_time() - healed

    run = Run(lab)
    requests = 300
    config = _config(lab, requests=requests, collective_timeout=4.0, restart_vanished=restart)
    report = await _run(run, config, faults)
    named = report.group_restarts if restart else report.collective_timeouts
    assert named, (report.to_json(), _tail(run))
    assert all(re.search(r"ranks \[[23, ]+\] never arrived", line) for line in named), named
    if not restart:
        assert not report.ok and report.completed < requests
        return
    assert report.ok, _why(report, run)
    assert report.requests == report.completed == requests
    assert report.wave_regressions == 0 and report.collective_timeouts == []
    print(
        f"FIGURE partition beyond the collective timeout, restart-vanished: first request "
        f"completed {figures['recover']:.1f} s after heal, {report.resubmitted} resubmitted, "
        f"requests lost {report.requests - report.completed}"
    )


async def test_a_wave_started_during_a_partition_reaches_the_healed_node(
    lab: NetworkLab,
) -> None:
    """Node 2 cut off while idle until the coordinator dropped it; requests pinned to
    node 1's engines start a wave (START_DP_WAVE cannot reach node 2); on heal node 2's
    engines subscribe again and join that wave (the coordinator sends the running wave's
    START_DP_WAVE again after READY), so the pinned requests finish."""
    node2 = lab.nodes[1]
    run = Run(lab)
    outcome: list[bool] = []

    async def partition_then_pin(frontend: SimFrontend, progress: Progress) -> None:
        if outcome:
            return
        lab.partition(node2)
        await run.wait_line(_lost(node2, "engine broadcast"), count=2)
        for rank in (0, 1, 0, 1):
            await frontend.submit(max_tokens=4, engine=rank)
        lab.heal(node2)
        await run.wait_line(r"late engine subscription", count=2)
        with trio.move_on_after(8.0):
            await frontend.wait_for(lambda f: f.pending == 0)
        outcome.append(frontend.pending == 0)

    config = replace(
        _config(lab, requests=40, collective_timeout=20.0),
        load=LoadPlan(requests=40, burst=(10, 10), gap=(0.0, 0.05), pause_every=0),
        wake_path="engine",
    )
    with inside(lab.head), trio.fail_after(150):
        report = await run_cluster(config, log_line=run.log_line, between_bursts=partition_then_pin)
    assert outcome == [True], _why(report, run)
    assert report.ok, _why(report, run)
    assert report.requests == report.completed


async def test_a_short_partition_reports_nothing_and_loses_nothing(lab: NetworkLab) -> None:
    """Node 2 cut off for a third of the heartbeat timeout, mid-load: no peer is
    dropped, nobody unsubscribes, every request completes."""
    node2 = lab.nodes[1]

    async def faults(run: Run) -> None:
        await run.wait_progress(lambda p: p.completed >= 40 and any(p.engine_running))
        lab.partition(node2)
        await trio.sleep(HEARTBEAT_TIMEOUT / 3)
        lab.heal(node2)

    run = Run(lab)
    report = await _run(run, _config(lab, requests=160), faults)
    assert report.ok, _why(report, run)
    assert report.requests == report.completed == 160
    assert run.matching(r"lost peer|unsubscribed|lost the", before=run.load_done_at) == []
    print(
        f"FIGURE short partition (1 s): nothing reported, requests lost "
        f"{report.requests - report.completed}"
    )


async def test_a_frozen_node_is_noticed_within_the_timeout_and_named(lab: NetworkLab) -> None:
    """Node 2 dies as a node does when it loses power: its link goes down and all its
    processes freeze (SIGSTOP: their parent, the launcher, must not see them exit,
    as a launcher on another host would not). The coordinator names its address on
    both engine sockets within the heartbeat timeout; the DP group cannot survive it,
    and the collective fails loudly, naming ranks 2 and 3."""
    node2 = lab.nodes[1]
    figures: dict[str, float] = {}

    async def faults(run: Run) -> None:
        await run.wait_progress(lambda p: p.completed >= 40 and any(p.engine_running))
        lab.partition(node2)
        lab.signal_node(node2, signal.SIGSTOP)
        cut = trio.current_time()
        noticed = await run.wait_line(_lost(node2), count=4, after=cut)
        figures["notice"] = noticed - cut

    run = Run(lab)
    report = await _run(run, _config(lab, requests=100_000, collective_timeout=8.0), faults)
    assert not report.ok
    assert figures["notice"] <= NOTICE_WITHIN + 2.0
    assert report.collective_timeouts, (report.to_json(), _tail(run))
    named = {
        int(rank)
        for line in report.collective_timeouts
        for ranks in re.findall(r"ranks \[([\d, ]+)\] never arrived", line)
        for rank in ranks.split(", ")
    }
    assert named and named <= {2, 3}, report.collective_timeouts
    print(
        f"FIGURE node lost: noticed after {figures['notice']:.1f} s, named "
        f"({report.collective_timeouts[0]})"
    )


async def test_the_head_coordinator_killed_and_restarted(lab: NetworkLab) -> None:
    """SIGKILL the coordinator mid-load with restart_vanished: it is restarted on the
    same addresses, every engine on the nodes reconnects and gets READY, the new
    coordinator's wave moves past the old one from the engines' reports alone, and no
    request is stranded."""
    figures: dict[str, float] = {}

    async def faults(run: Run) -> None:
        progress = await run.wait_progress(lambda p: p.completed >= 40 and any(p.engine_running))
        assert progress.coordinator_pid is not None
        os.kill(progress.coordinator_pid, signal.SIGKILL)
        killed = trio.current_time()
        figures.update(killed=killed, completed=progress.completed, wave=progress.wave)
        ready = await run.wait_line(r"READY sent to 4 engines", after=killed)
        figures["recover"] = ready - killed
        await run.wait_progress(lambda p: p.wave > progress.wave)

    run = Run(lab)
    report = await _run(run, _config(lab, requests=300, restart_vanished=True), faults)
    assert len(report.coordinator_restarts) == 1, (report.to_json(), _tail(run))
    assert re.fullmatch(
        r"the coordinator \(pid \d+\) vanished: exited with status -9 \(SIGKILL\)",
        report.coordinator_restarts[0],
    )
    assert report.requests == report.completed == 300, (report.to_json(), _tail(run))
    assert report.ok, _why(report, run)
    assert figures["completed"] < 200  # the load went on after the restart
    reconnected = run.matching(
        r"rank (\d): reconnected to the coordinator", after=figures["killed"]
    )
    assert {re.findall(r"rank (\d):", line)[0] for _, line in reconnected} == {"0", "1", "2", "3"}
    print(
        f"FIGURE coordinator restarted: READY to all 4 engines {figures['recover']:.1f} s "
        f"after the kill, requests lost {report.requests - report.completed}"
    )
