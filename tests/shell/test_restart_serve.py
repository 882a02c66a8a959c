"""``trio-dpcoord serve --supervised``: the coordinator worker killed with SIGKILL, again
and again, under engines and a front-end that stay connected (docs/protocol.md §16).

Real processes and sockets: the supervisor starts the worker, the engine peers
(``trio_dpcoord.testing``) and a trio front-end connect once; each kill -9 makes the
supervisor start the next worker on the same addresses, the peers' sockets reconnect
by themselves and subscribe again, and the new coordinator takes over at the wave the
dead one had reached: READY to every engine, then its one recovery wake, nobody
excluded; waves then go on from there, never back, for engines and front-end alike.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from trio_dpcoord import Frontend, open_frontend, protocol
from trio_dpcoord.testing import (
    EnginePeer,
    ServeProcess,
    connect_engines,
    expect_broadcast,
    open_serve,
    serve_command,
)

CRASH_VARIABLE = "TRIO_DPCOORD_INJECT_CRASH"
"""The injected-crash hook (trio_dpcoord/_shell/supervision.py), off when unset."""

pytestmark = pytest.mark.trio

GUARD = 60.0
STARTED = "coordinator worker (pid "
RESTARTED = "coordinator worker restarted as pid "


def start(wave: int, exclude: int | None) -> list[bytes]:
    return protocol.encode_start_dp_wave(wave, exclude)


def worker_pid(serve: ServeProcess) -> int:
    """The serving worker: the one the supervisor last said it started."""
    pids = re.findall(r"coordinator worker (?:\(pid |restarted as pid )(\d+)", serve.stderr)
    assert pids, serve.stderr
    return int(pids[-1])


async def kill_worker(serve: ServeProcess, restarts: int) -> int:
    """SIGKILL the serving worker; return once its successor has bound the addresses."""
    pid = worker_pid(serve)
    os.kill(pid, signal.SIGKILL)
    await serve.logged(RESTARTED, restarts)
    assert worker_pid(serve) != pid
    return pid


async def expect_everywhere(engines: list[EnginePeer], *broadcasts: list[bytes]) -> None:
    """Every engine receives ``broadcasts`` next, in order, all engines read at once.

    At once, not one after the other: libzmq sends a reconnected XSUB's subscriptions
    again only when its socket is used (it processes the reconnection in the caller's
    thread), so an engine nobody reads would not subscribe again and the gate would wait
    for it. vLLM's engines poll their XSUB all the time; a test must too."""
    async with trio.open_nursery() as nursery:
        for engine in engines:
            nursery.start_soon(expect_broadcasts, engine, broadcasts)


async def expect_broadcasts(engine: EnginePeer, broadcasts: tuple[list[bytes], ...]) -> None:
    for frames in broadcasts:
        await expect_broadcast([engine], frames)


def at_wave(wave: int) -> Callable[[Frontend], bool]:
    return lambda frontend: frontend.snapshot().current_wave == wave


async def one_wave(engines: list[EnginePeer], frontend: Frontend, wave: int) -> None:
    """Engine 1 gets a request at ``wave``: its peers are woken; rank 0 then ends it."""
    await engines[1].start_wave(wave)
    await expect_broadcast(engines, start(wave, 1))
    await engines[0].wave_complete(wave)
    await frontend.wait_for(at_wave(wave + 1))


async def test_every_kill_9_of_the_worker_is_survived() -> None:
    seen: list[int] = []

    def watch(frontend: Frontend) -> bool:  # every wave the front-end holds, in order
        seen.append(frontend.snapshot().current_wave)
        return False

    with trio.fail_after(GUARD):
        async with open_serve("--engines", "2", "--supervised") as serve:
            endpoints = serve.endpoints
            assert set(endpoints) == {"front", "back_pub", "back_out"}
            await serve.logged(STARTED)
            async with (
                connect_engines(endpoints["back_pub"], endpoints["back_out"], 2) as engines,
                open_frontend(endpoints["front"], engine_count=2) as frontend,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(frontend.wait_for, watch)
                await expect_broadcast(engines, [protocol.READY])
                await one_wave(engines, frontend, 0)
                await one_wave(engines, frontend, 1)
                for restart in (1, 2, 3):
                    wave = restart + 1  # the wave the dead worker had reached
                    await kill_worker(serve, restart)
                    # the engines reconnect and subscribe again: READY, then the wake
                    await expect_everywhere(engines, [protocol.READY], start(wave, None))
                    # idle engines run the woken wave: rank 0 mirrors it and ends it
                    await engines[0].start_wave(wave)
                    await engines[0].wave_complete(wave)
                    await frontend.wait_for(at_wave(wave + 1))
                    assert not frontend.snapshot().engines_running
                await one_wave(engines, frontend, 5)
                await engines[0].stats(3, 2, 0.5, wave=6, step=0)
                await frontend.wait_for(lambda f: f.engine_loads()[0].waiting == 3)
                nursery.cancel_scope.cancel()
            assert await serve.stop() == 0
    assert seen == sorted(seen), seen  # the front-end never saw the wave go back
    assert seen[-1] == 6
    assert serve.stderr.count("killed by SIGKILL") == 3
    assert serve.stderr.count("taking over from a coordinator process that died") == 3
    counters = serve.final_counters
    assert counters is not None and counters["errors"] == 0
    assert '"process_restarts": 3' in serve.stdout_lines[-1]


async def test_a_crash_loop_makes_the_supervisor_give_up() -> None:
    """Workers killed before they served (no engine ever subscribes, so no gate opens):
    the third in a row ends the supervisor, the error naming how the last one died."""
    with trio.fail_after(GUARD):
        async with open_serve("--engines", "1", "--supervised") as serve:
            await serve.logged(STARTED)
            for restart in range(1, 3):
                await kill_worker(serve, restart)
            os.kill(worker_pid(serve), signal.SIGKILL)
            assert await serve.process.wait() == 1
    assert "killed by SIGKILL before it served (2 of 3 in a row)" in serve.stderr
    assert "killed by SIGKILL before it served, 3 workers in a row: a crash loop" in serve.stderr


async def serving(serve: ServeProcess, workers: int) -> None:
    """The supervisor saw the last worker's gate open (its heartbeat said so)."""
    await serve.logged("serving: its gate opened", workers)


async def test_workers_that_served_are_replaced_every_time() -> None:
    """Seven kills of workers that had served, more than the three failed starts that
    end the supervisor: each is replaced, the wave goes on where the dead one left it."""
    with trio.fail_after(2 * GUARD):
        async with open_serve("--engines", "2", "--supervised") as serve:
            endpoints = serve.endpoints
            async with connect_engines(endpoints["back_pub"], endpoints["back_out"], 2) as engines:
                await expect_broadcast(engines, [protocol.READY])
                await serving(serve, 1)
                for restart in range(1, 8):
                    await kill_worker(serve, restart)
                    # READY and the recovery wake (the peers never run it: wave 0 stays)
                    await expect_everywhere(engines, [protocol.READY], start(0, None))
                    await serving(serve, restart + 1)
            assert await serve.stop() == 0
    assert serve.stderr.count("killed by SIGKILL after serving") == 7
    assert "crash loop" not in serve.stderr


async def test_a_hung_worker_is_killed_and_its_lost_wake_rebuilt() -> None:
    """SIGSTOP: the worker is alive and deaf. A request reaches a paused engine, which
    tells the hung worker (its start_wave is lost with it); the watchdog kills the worker
    for its silence, the next one wakes every engine at the wave, as after a kill."""
    with trio.fail_after(GUARD):
        async with open_serve("--engines", "2", "--supervised", "--watchdog-timeout", "1") as serve:
            endpoints = serve.endpoints
            async with (
                connect_engines(endpoints["back_pub"], endpoints["back_out"], 2) as engines,
                open_frontend(endpoints["front"], engine_count=2) as frontend,
            ):
                await expect_broadcast(engines, [protocol.READY])
                await one_wave(engines, frontend, 0)  # applied: the wave file holds 1
                hung = worker_pid(serve)
                os.kill(hung, signal.SIGSTOP)
                await engines[1].start_wave(1)  # a request on rank 1: only rank 1 woke
                await expect_everywhere(engines, [protocol.READY], start(1, None))
                assert worker_pid(serve) != hung
            assert await serve.stop() == 0
    assert re.search(rf"\(pid {hung}\): its event loop was silent for 1\.\d s", serve.stderr)
    assert f"(pid {hung}) killed by SIGKILL (the watchdog: its event loop was silent" in (
        serve.stderr
    )
    assert "watchdog: the longest silence of a worker's event loop seen was" in serve.stderr


async def one_engine_wave(engines: list[EnginePeer], wave: int) -> None:
    await engines[1].start_wave(wave)
    await expect_broadcast(engines, start(wave, 1))
    await engines[0].wave_complete(wave)


async def test_an_injected_crash_is_survived_and_named() -> None:
    env = {**os.environ, CRASH_VARIABLE: "worker:0.3"}
    with trio.fail_after(GUARD):
        async with open_serve("--engines", "2", "--supervised", env=env) as serve:
            endpoints = serve.endpoints
            async with connect_engines(endpoints["back_pub"], endpoints["back_out"], 2) as engines:
                await expect_broadcast(engines, [protocol.READY])
                first = worker_pid(serve)
                await one_engine_wave(engines, 0)
                # it crashes 0.3 s after its gate opened; the next one (a second process
                # on the wave file: no crash) takes over at wave 1
                await expect_everywhere(engines, [protocol.READY], start(1, None))
                await serving(serve, 2)
                await one_engine_wave(engines, 2)
            assert await serve.stop() == 0
    assert re.search(
        rf"\(pid {first}\) exited with status 1; its stderr said: .*InjectedCrash\('a broken "
        r"invariant injected \(TRIO_DPCOORD_INJECT_CRASH\)'.*; after serving",
        serve.stderr,
    ), serve.stderr
    assert serve.stderr.count("InjectedCrash") >= 2  # the traceback, and the supervisor's line


async def test_an_injected_crash_in_a_pump_is_restarted_in_place() -> None:
    env = {**os.environ, CRASH_VARIABLE: "pump:0"}
    with trio.fail_after(GUARD):
        async with open_serve("--engines", "2", "--supervised", env=env) as serve:
            endpoints = serve.endpoints
            async with connect_engines(endpoints["back_pub"], endpoints["back_out"], 2) as engines:
                await expect_broadcast(engines, [protocol.READY])
                await serve.logged("injecting a crash in the pump now")
                await engines[0].stats(1, 0, 0.0, wave=0, step=0)  # the failing batch
                await serve.logged("restarting it in place")
                await expect_broadcast(engines, start(0, None))  # the recovery wake
            assert await serve.stop() == 0
    assert "AssertionError: a failure injected in the coordinator's engine_output pump" in (
        serve.stderr
    )
    assert "restarted as pid" not in serve.stderr  # the process lived on


async def test_a_worker_that_cannot_bind_ends_the_supervisor_with_the_cause() -> None:
    command = serve_command(
        "--engines", "1", "--supervised", "--allow-remote", "--back-pub", "tcp://192.0.2.1:5555"
    )
    with trio.fail_after(10):
        result = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False
        )
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert re.search(
        r"coordinator worker \(pid \d+\) exited with status 2 before it bound its "
        r"addresses: giving up; its stderr said: .*192\.0\.2\.1",
        stderr,
    ), stderr


async def test_sigterm_stops_worker_and_standby() -> None:
    with trio.fail_after(GUARD):
        async with open_serve("--engines", "1", "--supervised") as serve:
            await serve.logged(STARTED)
            children: list[int] = []
            while len(children) < 2:  # the worker, and the standby started after it
                await trio.sleep(0.05)
                children = _children(serve.process.pid)
            assert worker_pid(serve) in children
            assert await serve.stop() == 0
    assert serve.final_counters is not None
    # nothing of it is left: the worker stopped, the standby saw its stdin close
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


async def test_successors_that_cannot_bind_end_the_supervisor_with_the_cause(
    tmp_path: Path,
) -> None:
    """After a death the address is blocked (a non-empty directory where the front
    socket's ipc file was): three successors in a row fail to bind, without pauses, and
    the supervisor ends with status 1 and the bind error."""
    front = tmp_path / "front"
    with trio.fail_after(GUARD):
        async with open_serve(
            "--engines", "1", "--supervised", "--front", f"ipc://{front}"
        ) as serve:
            await serve.logged(STARTED)
            front.unlink()
            (front / "blocked").mkdir(parents=True)
            os.kill(worker_pid(serve), signal.SIGKILL)
            assert await serve.process.wait() == 1
    assert re.search(
        r"exited with status 2; its stderr said: trio-dpcoord: error: cannot bind the front "
        rf"socket to 'ipc://{re.escape(str(front))}': Address already in use.* before it "
        r"served, 3 workers in a row: a crash loop, giving up",
        serve.stderr,
    ), serve.stderr
