"""The measuring side of wake latency: N engine sockets driven with blocking pyzmq.

One process pushes ``start_wave`` (engine 0's PUSH) and receives on all N XSUB
sockets, so start and end times come from one clock. For ``notify_first_request`` the
start time is taken inside the coordinator's process with the same system-wide
``CLOCK_MONOTONIC``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgpack
import zmq

from benchmarks.shared.util import now_ns, start_wave_frame, stats_frame, wave_complete_frame
from trio_dpcoord.protocol import engine_identity

_START = b"\x02"
_READY = b"READY"


class WakeProbe:
    """N simulated engines (XSUB + PUSH each, or one shared PUSH) on one zmq context."""

    def __init__(
        self, back_pub: str, back_out: str, engines: int, *, push_per_engine: bool = False
    ) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # libzmq's default limit is 1023 sockets per context; N = 1024 needs 2N + a few
        self.context.set(zmq.MAX_SOCKETS, 2 * engines + 64)
        self.engines = engines
        self.subs: list[zmq.Socket[bytes]] = []
        self.pushes: list[zmq.Socket[bytes]] = []
        self.poller = zmq.Poller()
        self.wave = 0
        for index in range(engines):
            sub = self.context.socket(zmq.XSUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.IDENTITY, engine_identity(index))
            sub.connect(back_pub)
            sub.send(b"\x01")
            self.subs.append(sub)
            self.poller.register(sub, zmq.POLLIN)
        for _ in range(engines if push_per_engine else 1):
            push = self.context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(back_out)
            self.pushes.append(push)
        self.control = self.pushes[0]

    def close(self) -> None:
        self.context.destroy(linger=0)

    def __enter__(self) -> WakeProbe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- helpers ----------------------------------------------------------------------

    def _collect(self, accept: Callable[[list[bytes]], bool], timeout_ms: int) -> int | None:
        """Poll until every engine received a message ``accept`` likes; time of the last.

        Returns ``None`` on timeout.
        """
        pending = set(range(self.engines))
        index_of = {sock: i for i, sock in enumerate(self.subs)}
        last = 0
        deadline = time.monotonic() + timeout_ms / 1000
        while pending:
            remaining = int((deadline - time.monotonic()) * 1000)
            if remaining <= 0:
                return None
            ready = self.poller.poll(remaining)
            arrived = now_ns()
            for sock, _ in ready:
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    i = index_of[sock]
                    if i in pending and accept(frames):
                        pending.discard(i)
                        last = arrived
        return last

    def _is_start(self, wave: int) -> Callable[[list[bytes]], bool]:
        def accept(frames: list[bytes]) -> bool:
            return frames[0] == _START and msgpack.unpackb(frames[1])[0] == wave

        return accept

    # -- phases -------------------------------------------------------------------------

    def wait_ready(self, *, expect_ready: bool, timeout_s: float = 30.0) -> None:
        """Until every engine is reachable: READY from a coordinator, or (for the
        forwarder, which has no start-up gate) one wave that reaches all of them."""
        if expect_ready:
            if self._collect(lambda f: f[0] == _READY, int(timeout_s * 1000)) is None:
                raise TimeoutError(f"READY did not reach all {self.engines} engines")
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.control.send(start_wave_frame(0, self.wave))
            reached = self._collect(self._is_start(self.wave), 100)
            self.control.send(wave_complete_frame(self.wave))
            self.wave += 1
            if reached is not None:
                return
        raise TimeoutError(f"subscriptions of {self.engines} engines never took effect")

    def send_stats_from_all(self) -> None:
        """One stats report per engine (fills the coordinator's load table)."""
        for index, push in enumerate(self.pushes):
            push.send(stats_frame(index, 1, 1))

    def start_wave_latencies(self, waves: int, gap_s: float) -> list[int]:
        """Engine 0 pushes ``start_wave``; time until the last engine has START_DP_WAVE."""
        latencies: list[int] = []
        for _ in range(waves):
            time.sleep(gap_s)
            frame = start_wave_frame(0, self.wave)
            t0 = now_ns()
            self.control.send(frame)
            last = self._collect(self._is_start(self.wave), 10_000)
            if last is None:
                raise TimeoutError(f"START_DP_WAVE for wave {self.wave} never reached all")
            latencies.append(last - t0)
            self.control.send(wave_complete_frame(self.wave))
            self.wave += 1
        return latencies

    def wave_arrival(self, wave: int, timeout_ms: int) -> int | None:
        """When START_DP_WAVE(``wave``) reached the last engine (None: timed out)."""
        return self._collect(self._is_start(wave), timeout_ms)

    def answer_waves(self, waves: int) -> list[int]:
        """Someone else starts each wave: record when it reached the last engine, then
        complete it (engine 0's ``wave_complete``)."""
        arrivals: list[int] = []
        for _ in range(waves):
            last = self._collect(self._is_start(self.wave), 10_000)
            if last is None:
                raise TimeoutError(f"START_DP_WAVE for wave {self.wave} never reached all")
            arrivals.append(last)
            self.control.send(wave_complete_frame(self.wave))
            self.wave += 1
        return arrivals
