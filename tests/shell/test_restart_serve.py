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

import pytest
import trio

from trio_dpcoord import Frontend, open_frontend, protocol
from trio_dpcoord.testing import (
    EnginePeer,
    ServeProcess,
    connect_engines,
    expect_broadcast,
    open_serve,
)

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
    with trio.fail_after(GUARD):
        async with open_serve("--engines", "1", "--supervised") as serve:
            await serve.logged(STARTED)
            for restart in range(1, 6):
                await kill_worker(serve, restart)
            os.kill(worker_pid(serve), signal.SIGKILL)
            assert await serve.process.wait() == 1
    assert "died 6 times within 60 s: giving up" in serve.stderr


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
