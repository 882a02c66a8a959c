"""Helper processes of the benchmarks: ``python -m benchmarks.programs.procs ROLE ...``.

* ``coordinator``: the embedded coordinator, i.e. :func:`open_coordinator` in a trio
  program (front socket on, so figures read the same as the standalone process). Prints
  the endpoints as one JSON line, like ``trio-dpcoord serve``; then takes commands on
  stdin (``nfr WAVES GAP_S``: trigger that many waves with ``notify_first_request`` and
  print their CLOCK_MONOTONIC start times); EOF stops it.
* ``forwarder``: the baseline, a plain blocking pyzmq PULL -> ``msgpack.unpackb`` ->
  XPUB loop in one thread, no trio: it turns every ``start_wave`` into START_DP_WAVE.
  With ``--ingest N`` it also times how fast it took in the last 95% of N messages.
* ``trio-floor``: the least a trio program does per wave in the coordinator's shape: the
  engine-output socket read by one task, the wave state under a ``threading.Lock``, a
  memory channel, a second task that sends START_DP_WAVE and the front publishes, a
  third waiting on the front socket as the command receiver does; READY once
  ``--engines`` have subscribed. No validation, no load table, no counters: what is left
  is trio's run loop, the task hop and the socket waits. ``--raw`` waits with
  ``trio.lowlevel.wait_readable`` on the engine-output socket's FD directly instead of
  through our shim (``trio_zmq``, an exclusive socket).
* ``pusher``: one engine's PUSH socket sending pre-encoded stats-only frames, as fast
  as it can (``--count``, optionally between two ``start_wave`` markers: ``--markers``)
  or paced (``--rate``) until SIGTERM. ``--fleet N``: the ``--count`` frames are a
  lock-stepped fleet of N engines' (``benchmarks.programs.fleet.fleet_stream``), no send limit.
* ``exec``: set the parent-death signal, then exec the given command line.
* ``serve-msgpack``: ``trio-dpcoord serve`` with msgspec made unimportable, as on a
  machine without the ``fast`` extra (the decoder's msgpack path, msgpack-python's
  encoder for front publishes).
* ``serve-pure``: the same with ``TRIO_DPCOORD_PURE_PYTHON=1``: the default install's
  pure-Python twin (no compiled module runs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, cast

import msgpack
import zmq

from benchmarks.shared.util import now_ns, set_parent_death_signal, start_wave_frame, stats_frame

if TYPE_CHECKING:
    from trio_dpcoord import Coordinator

# trio and trio_dpcoord are imported only by the roles that use them: the baseline
# forwarder's memory and start-up must not include them.

logger = logging.getLogger(__name__)


def _emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


# --- the embedded coordinator ------------------------------------------------------------


async def _stdin_lines() -> AsyncIterator[str]:
    import trio

    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stream:
        buffer = b""
        while True:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                yield line.decode()


def _paused(coordinator: Coordinator) -> bool:
    return not coordinator.snapshot().engines_running


async def _coordinator_main(args: argparse.Namespace) -> None:
    import trio

    from trio_dpcoord import open_coordinator

    async with open_coordinator(
        args.engines,
        back_publish_address=args.back_pub,
        back_output_address=args.back_out,
        front_address=args.front or None,
        ready_timeout=None,
    ) as coordinator:
        _emit(
            {
                "front": coordinator.front_address,
                "back_pub": coordinator.back_publish_address,
                "back_out": coordinator.back_output_address,
            }
        )
        async for line in _stdin_lines():
            words = line.split()
            if words and words[0] == "nfr":
                waves, gap = int(words[1]), float(words[2])
                starts: list[int] = []
                for _ in range(waves):
                    await coordinator.wait_for(_paused)
                    await trio.sleep(gap)
                    starts.append(now_ns())
                    coordinator.notify_first_request(0)
                _emit({"t0_ns": starts})
            elif words and words[0] == "counters":
                counters = coordinator.statistics()
                _emit(
                    {
                        "engine_messages": counters.engine_messages,
                        "stats_applied": counters.stats_applied,
                        "wave_starts": counters.wave_starts,
                        "rejected": counters.rejected,
                    }
                )


# --- the baseline forwarder --------------------------------------------------------------


def _forwarder_main(args: argparse.Namespace) -> None:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(args.back_out)
    xpub = context.socket(zmq.XPUB)
    xpub.bind(args.back_pub)
    _emit({"front": None, "back_pub": args.back_pub, "back_out": args.back_out})
    unpackb = msgpack.unpackb
    packb = msgpack.packb
    recv = pull.recv
    send_multipart = xpub.send_multipart
    start_frame = b"\x02"
    total = args.ingest
    mark = max(1, total // 20) if total else -1
    count = 0
    t_mark = 0
    while True:
        message = unpackb(recv())
        count += 1
        start = message[7]
        if start is not None:
            send_multipart([start_frame, packb([start, message[0]])])
        if count == mark:
            t_mark = now_ns()
        elif count == total:
            seconds = (now_ns() - t_mark) / 1e9
            _emit({"messages": total - mark, "seconds": seconds})


# --- the trio floor -----------------------------------------------------------------------


async def _trio_floor_main(args: argparse.Namespace) -> None:
    import math

    import trio

    from trio_dpcoord.trio_zmq import open_context, open_socket

    async with (
        open_context() as context,
        open_socket(
            context, zmq.XPUB, bind=args.back_pub, options={zmq.XPUB_VERBOSE: 1}
        ) as back_pub,
        open_socket(
            context, zmq.PULL, bind=args.back_out, options={zmq.RCVHWM: 0}, exclusive=True
        ) as back_out,
        open_socket(context, zmq.XPUB, bind=args.front) as front,
    ):
        _emit({"front": args.front, "back_pub": args.back_pub, "back_out": args.back_out})
        subscribed = 0
        while subscribed < args.engines:
            subscribed += (await back_pub.recv())[:1] == b"\x01"
        await back_pub.send(b"READY")
        to_broadcaster, broadcasts = trio.open_memory_channel[tuple[int, bytes]](math.inf)
        unpackb = msgpack.unpackb
        packb = msgpack.packb
        wave = 0
        running = False
        lock = threading.Lock()  # the snapshot's, as the card's shape has it

        def apply(frame: bytes) -> None:
            # EngineCoreOutputs as an array: [6] wave_complete, [7] start_wave
            nonlocal wave, running
            message = unpackb(frame)
            with lock:
                if message[6] is not None:
                    wave, running = message[6] + 1, False
                    to_broadcaster.send_nowait((-1, packb((None, wave, False))))
                elif message[7] is not None and not running:
                    running = True
                    to_broadcaster.send_nowait((message[7], packb((message[7], message[0]))))
                    to_broadcaster.send_nowait((-1, packb((None, wave, True))))

        async def command_receiver() -> None:
            # the front socket's reader (front-ends' subscriptions and commands): its wait
            # is why each send on that socket re-reads EVENTS (the shim's rule)
            while True:
                await front.recv_batch()

        def send(item: tuple[int, bytes]) -> None:
            if item[0] >= 0:
                back_pub.send_nowait((b"\x02", item[1]))
            else:
                front.send_nowait((item[1],))

        async def broadcaster() -> None:
            async for item in broadcasts:
                send(item)
                while True:
                    try:
                        send(broadcasts.receive_nowait())
                    except trio.WouldBlock:
                        break

        async with trio.open_nursery() as nursery:
            nursery.start_soon(broadcaster)
            nursery.start_soon(command_receiver)
            if args.raw:
                pull = back_out.zmq_socket
                fd = cast(int, pull.getsockopt(zmq.FD))
                while True:
                    if not cast(int, pull.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        await trio.lowlevel.wait_readable(fd)
                        continue
                    apply(pull.recv(zmq.NOBLOCK))
            while True:
                for frames in await back_out.recv_multipart_batch():
                    apply(frames[0])


# --- engine pushers ----------------------------------------------------------------------


_stop_requested = False


def _request_stop(signum: int, frame: FrameType | None) -> None:
    global _stop_requested
    _stop_requested = True


def _pusher_main(args: argparse.Namespace) -> None:
    if args.fleet:
        from benchmarks.programs.fleet import fleet_stream

        frames = fleet_stream(args.fleet, args.count)
    elif args.count:
        # waiting = messages sent so far, so a front publish tells how many were applied
        frames = [stats_frame(args.engine, i + 1, i + 1) for i in range(args.count)]
    else:
        frames = [stats_frame(args.engine, i % 64, i + 1) for i in range(2000)]
    frame_bytes, messages = len(frames[0]), len(frames)
    if args.markers is not None:
        # start_wave(W) before and start_wave(W + 1) after: every coordinator (and the
        # forwarder) broadcasts both, so the engines' clock brackets the stats in between
        frames = [
            start_wave_frame(args.engine, args.markers),
            *frames,
            start_wave_frame(args.engine, args.markers + 1),
        ]
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 10_000)
    if args.fleet:  # queued in advance while the subject is stopped: no limit
        push.setsockopt(zmq.SNDHWM, 0)
    push.connect(args.address)
    signal.signal(signal.SIGTERM, _request_stop)
    _emit({"ready": True, "frame_bytes": frame_bytes, "messages": messages})
    if sys.stdin.readline().strip() != "go":
        return
    send = push.send
    start = time.monotonic()
    sent = 0
    if args.count:
        for frame in frames:
            send(frame)
        sent = len(frames)
    else:
        pool = len(frames)
        rate = args.rate
        while not _stop_requested:
            due = int((time.monotonic() - start) * rate)
            while sent < due:
                send(frames[sent % pool])
                sent += 1
            time.sleep(0.0005)
    _emit({"sent": sent, "seconds": time.monotonic() - start})
    if args.count:
        sys.stdin.read()  # keep the socket (and its queue) until the runner is done
    push.close()
    context.term()


def _exec_main(argv: Sequence[str]) -> None:
    os.execvp(argv[0], list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    set_parent_death_signal()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.programs.procs")
    roles = parser.add_subparsers(dest="role", required=True)
    coordinator = roles.add_parser("coordinator")
    coordinator.add_argument("--engines", type=int, required=True)
    forwarder = roles.add_parser("forwarder")
    forwarder.add_argument("--ingest", type=int, default=0)
    trio_floor = roles.add_parser("trio-floor")
    trio_floor.add_argument("--engines", type=int, required=True)
    trio_floor.add_argument("--raw", action="store_true", help="no shim: wait on the FD")
    for role in (coordinator, forwarder, trio_floor):
        role.add_argument("--back-pub", required=True)
        role.add_argument("--back-out", required=True)
        role.add_argument("--front")
    pusher = roles.add_parser("pusher")
    pusher.add_argument("--address", required=True)
    pusher.add_argument("--engine", type=int, default=0)
    pusher.add_argument("--count", type=int, default=0)
    pusher.add_argument("--rate", type=float, default=1000.0)
    pusher.add_argument("--markers", type=int, help="bracket --count frames with start_wave")
    pusher.add_argument("--fleet", type=int, default=0, help="--count frames of N engines")
    runner = roles.add_parser("exec")
    runner.add_argument("command", nargs=argparse.REMAINDER)
    serve_msgpack = roles.add_parser("serve-msgpack")
    serve_msgpack.add_argument("options", nargs=argparse.REMAINDER)
    serve_pure = roles.add_parser("serve-pure")
    serve_pure.add_argument("options", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        if args.role == "coordinator":
            import trio

            trio.run(_coordinator_main, args)
        elif args.role == "trio-floor":
            import trio

            trio.run(_trio_floor_main, args)
        elif args.role == "forwarder":
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            _forwarder_main(args)
        elif args.role == "pusher":
            _pusher_main(args)
        elif args.role in ("serve-msgpack", "serve-pure"):
            if args.role == "serve-pure":
                os.environ["TRIO_DPCOORD_PURE_PYTHON"] = "1"  # read at trio_dpcoord's import
            sys.modules["msgspec"] = None  # type: ignore[assignment]  # import fails
            from trio_dpcoord import cli

            options = args.options[1:] if args.options[:1] == ["--"] else args.options
            return cli.main(["serve", *options])
        else:
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            _exec_main(command)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
