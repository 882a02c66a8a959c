"""examples/launch_cluster.py as a user runs it: exit status, JSON summary, Ctrl-C, no orphans."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import trio

LAUNCHER = Path(__file__).resolve().parents[2] / "examples" / "launch_cluster.py"
SUMMARY_KEYS = {"requests", "completed", "waves", "errors", "wake_latency_ms"}


def _state(pid: int) -> str | None:
    """The process state letter (R, S, Z, ...) or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rpartition(")")[2].split()[0]


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.add(int(entry.name))
    return found


def _alive(pids: set[int]) -> set[int]:
    """Processes still running (zombies waiting for a reaper count as gone)."""
    return {pid for pid in pids if _state(pid) not in (None, "Z")}


async def _launch(*args: str) -> tuple[int, str, str]:
    result = await trio.run_process(
        [sys.executable, str(LAUNCHER), *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def _summary(stdout: str) -> dict[str, object]:
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert isinstance(summary, dict)
    assert set(summary) >= SUMMARY_KEYS
    return summary


async def test_inproc_run_succeeds_with_a_json_summary() -> None:
    with trio.fail_after(90):
        code, out, err = await _launch(
            "--engines", "2", "--requests", "40", "--seed", "3", "--pause-every", "2", "--json"
        )
    assert code == 0, err
    summary = _summary(out)
    assert (summary["requests"], summary["completed"], summary["errors"]) == (40, 40, 0)
    assert isinstance(summary["waves"], int) and summary["waves"] >= 2
    latency = summary["wake_latency_ms"]
    assert isinstance(latency, dict) and latency["p50"] is not None
    assert latency["p50"] <= latency["p99"]
    assert summary["collective_timeouts"] == []
    assert "result: OK" in out


async def test_prefix_routing_run_completes_and_reuses_the_history() -> None:
    with trio.fail_after(90):
        code, out, err = await _launch(
            "--engines", "2", "--requests", "60", "--routing", "prefix", "--sessions", "6",
            "--mode", "standalone", "--json",
        )  # fmt: skip
    assert code == 0, err
    summary = _summary(out)
    assert (summary["routing"], summary["requests"], summary["completed"]) == ("prefix", 60, 60)
    assert summary["errors"] == 0
    counters = summary["routing_counters"]
    assert isinstance(counters, dict) and counters["decisions"] == 60
    # Turns resend their history: most of it was believed cached where each one went.
    assert counters["prompt_tokens"] > counters["cached_tokens"] > counters["prompt_tokens"] // 2
    assert "routing prefix" in out


async def test_standalone_run_with_legacy_engines_succeeds() -> None:
    with trio.fail_after(90):
        code, out, err = await _launch(
            "--mode", "standalone", "--engines", "4", "--wake-path", "frontend",
            "--requests", "40", "--json",
        )  # fmt: skip
    assert code == 0, err
    summary = _summary(out)
    assert (summary["mode"], summary["wake_path"], summary["engines"]) == (
        "standalone",
        "frontend",
        4,
    )
    assert (summary["requests"], summary["completed"], summary["errors"]) == (40, 40, 0)
    assert isinstance(summary["frontend_notifications"], int)
    assert summary["frontend_notifications"] > 0


async def test_a_collective_timeout_fails_the_run_with_the_diagnostic() -> None:
    # A timeout shorter than any rendezvous: the first round cannot complete in time.
    with trio.fail_after(90):
        code, out, err = await _launch(
            "--engines", "2", "--requests", "5", "--collective-timeout", "0.000001", "--json"
        )
    assert code == 1
    summary = _summary(out)
    timeouts = summary["collective_timeouts"]
    assert isinstance(timeouts, list) and timeouts
    assert "collective timeout at wave 0 step 1: ranks [" in timeouts[0]
    assert "never arrived" in err
    assert "result: FAILED" in out


async def _start_and_wait_for_engines(engines: int) -> tuple[trio.Process, set[int]]:
    process = await trio.lowlevel.open_process(
        [sys.executable, str(LAUNCHER), "--engines", str(engines), "--requests", "1000000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children: set[int] = set()
    while len(children) < engines:
        await trio.sleep(0.1)
        children = _children(process.pid)
    await trio.sleep(1.5)  # let it run waves for a while
    return process, children


async def test_ctrl_c_stops_everything_cleanly() -> None:
    with trio.fail_after(60):
        process, children = await _start_and_wait_for_engines(3)
        try:
            process.send_signal(signal.SIGINT)
            code = await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert code == 130
    assert _alive(children) == set()


async def test_engines_exit_on_their_own_when_the_launcher_is_killed() -> None:
    with trio.fail_after(60):
        process, children = await _start_and_wait_for_engines(2)
        process.kill()  # no cleanup at all: the engines notice their stdin closing
        await process.wait()
        while _alive(children):  # noqa: ASYNC110 - other processes: no event to wait on
            await trio.sleep(0.1)


async def test_run_through_the_engine_client_succeeds() -> None:
    """--engine-protocol vllm: simulated engine-core processes behind open_engine_client."""
    with trio.fail_after(90):
        code, out, err = await _launch(
            "--engine-protocol=vllm",
            "--engines=3",
            "--requests=60",
            "--pause-every=2",
            "--burst",
            "10",
            "20",
            "--gap",
            "0.1",
            "0.2",
            "--json",
        )
    assert code == 0, err
    summary = _summary(out)
    assert (summary["requests"], summary["completed"], summary["errors"]) == (60, 60, 0)
    assert isinstance(summary["waves"], int) and summary["waves"] >= 2
    assert isinstance(summary["pauses"], int) and summary["pauses"] >= 1
    assert "coordinator inside open_engine_client" in out and "result: OK" in out
    with trio.fail_after(30):
        code, _, err = await _launch("--engine-protocol=vllm", "--mode=standalone")
    assert code == 2 and "--mode standalone" in err
