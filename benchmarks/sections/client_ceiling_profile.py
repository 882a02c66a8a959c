"""Where the ``client_ceiling`` section's CPU goes: py-spy's raw stacks sorted into the
parts of the request path (:func:`breakdown`), and the parts timed alone in tight loops
(:func:`parts`); ``python -m benchmarks.sections.client_ceiling --breakdown RAW...`` and
``--parts`` print them."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

# --- where the CPU goes: py-spy's raw stacks, sorted into the request path's parts -----

STARTUP = "start-up, imports, other threads (left out)"
SCHEDULER = "scheduler: run loop, epoll, waking tasks"
_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (category, substrings of a frame): the first rule any frame of the task matches
    ("embedded coordinator (its ingest of stats, waves)", ("Pumps.", "coordinator.py")),
    ("vLLM client's link to its coordinator", ("run_engine_stats_update_task",)),
    (
        "decode engine outputs",
        ("_client_decoder", "protocol/_outputs", "decode_engine_frames", "MsgpackDecoder"),
    ),
    ("encode ADD", ("encode_add", "_add_frames", "to_wire", "MsgpackEncoder", "EngineCoreRequest")),
    ("send (zmq)", ("Outbox", "_input_sender", "send_multipart", "Socket.send", "_add_send_event")),
    ("receive (zmq)", ("recv_multipart", "_add_recv_event", "_handle_recv")),
    ("read a stream (per token)", ("__anext__", "MemoryReceiveChannel", "_Collector.get")),
    (
        "hand each output to its request (per token)",
        ("_push", "_deliver", "_request_output", "MemorySendChannel", "dispatch", "Future"),
    ),
    ("choose the engine", ("_choose", "EngineChooser", "engine_loads", "get_core_engine")),
    (
        "per-request bookkeeping",
        (
            "_add ",
            "_release",
            "_finish",
            "RequestTable",
            "__aenter__",
            "__aexit__",
            "generate",
            "RequestStream.__init__",
            "_work_for",
            "snapshot",
            "notify_first_request",
            "add_request_async",
        ),
    ),
    ("output bookkeeping (per message)", ("_receive_outputs", "process_outputs_socket")),
    ("the benchmark's caller code", ("load.<locals>.worker", "_run.<locals>.one")),
)


_IDLE = ("EpollIOManager.get_events", "_PollLikeSelector.select", "EpollSelector.select")


def _task_frames(frames: list[str]) -> list[str] | None:
    """The frames of the loop's task (from its coroutine on), [] for the loop's own
    code, None for what runs outside the loop (start-up, other threads)."""
    for marker in ("unrolled_run (trio/", "Handle._run (asyncio/events.py"):
        found = [i for i, frame in enumerate(frames) if frame.startswith(marker)]
        if found:
            return frames[found[-1] + 1 :]
    if any(frame.startswith("BaseEventLoop._run_once") for frame in frames):
        return []
    return None


def breakdown(raw: Path) -> dict[str, float]:
    """Shares of the samples in ``raw`` (``py-spy record --format raw``), by part of the
    request path, start-up left out; the shares of what is left sum to 1."""
    counts: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():  # a line cut short (the profile of a killed process)
            continue
        frames = [f for f in stack.split(";") if f]
        task = _task_frames(frames) if frames else None
        if frames and frames[-1].startswith(_IDLE):
            continue  # py-spy takes trio's wait in epoll for work at times: idle, left out
        if task is None or any("importlib" in f or "open_engine_client" in f for f in frames):
            category = STARTUP
        elif not task or task[0].startswith("_run ("):  # the worker's own start-up code
            category = SCHEDULER if not task else STARTUP
        else:
            category = next(
                (name for name, keys in _RULES if any(k in f for f in task for k in keys)),
                "other client tasks" if "trio_dpcoord" in task[0] else SCHEDULER,
            )
        counts[category] = counts.get(category, 0) + int(count)
    counts.pop(STARTUP, None)
    total = sum(counts.values()) or 1
    return {name: n / total for name, n in sorted(counts.items(), key=lambda kv: -kv[1])}


def parts(repeat: int = 5) -> dict[str, float]:
    """Microseconds per call of the request path's parts that can be timed alone, the
    best of ``repeat`` loops: per output token, the decoders of one engine step's
    ``EngineCoreOutputs`` (128 requests, as the stand-in engines send it: the full
    decoder the client used before, the client decoder's two paths); per request,
    ``encode_add`` (msgspec's path when installed)."""
    import timeit

    from benchmarks.programs.stand_in_engine import outputs_frame
    from trio_dpcoord import SamplingParams, protocol

    rows = [(f"trio-0123456789ab-{i}", i, 1 if i % 16 == 0 else None) for i in range(128)]
    frames = [outputs_frame(1, rows, 12.5)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, seed=0)

    def add() -> object:
        return protocol.encode_add(
            "trio-0123456789ab-17", [3, 4, 5, 6, 7, 8, 9], params, arrival_time=1.5, current_wave=3
        )

    timed = {
        "decode, full decoder (before), per output": (
            lambda: protocol.decode_engine_frames(frames),
            len(rows),
        ),
        "decode, client decoder msgpack path, per output": (
            lambda: protocol.decode_client_output_with_msgpack(frames[0]),
            len(rows),
        ),
        "decode, client decoder msgspec path, per output": (
            lambda: protocol.decode_client_output_with_msgspec(frames[0]),
            len(rows),
        ),
        f"encode_add ({'msgspec' if protocol.CLIENT_OUTPUT_DECODER == 'msgspec' else 'msgpack'})": (
            add,
            1,
        ),
    }
    timed.update(_floor_parts(params))
    out = {}
    for name, (call, per) in timed.items():
        number = max(1, 20_000 // per)
        best = min(timeit.repeat(call, number=number, repeat=repeat)) / number
        out[name] = best / per * 1e6
    for reading in (False, True):
        name = (
            "floor: a request's 16 outputs decoded and delivered, "
            + ("each read by its task (async for)" if reading else "gathered (complete)")
            + ", per request"
        )
        out[name] = min(_delivery_floor(params, reading) for _ in range(repeat))
    return out


def _delivery_floor(params: Any, reading: bool, size: int = 1024, tokens: int = 16) -> float:
    """Microseconds of CPU per request for the client's receive path alone, in one trio
    run without sockets or engines: ``size`` streams open (as ``generate`` leaves them,
    a task each reading its stream with ``async for`` when ``reading``, else gathering
    tokens as ``complete`` does, woken once at the end), ``tokens`` engine steps of one
    output per stream each decoded by the client's decoder and handed to the streams
    (``RequestStream._push``), the readers run after each step."""
    import trio
    import trio.testing

    from benchmarks.programs.stand_in_engine import TOKEN, outputs_frame
    from trio_dpcoord import RequestStream, protocol

    rids = [f"trio-0123456789ab-{i}" for i in range(size)]
    frames = [
        outputs_frame(0, [(rid, TOKEN, None if step < tokens - 1 else 1) for rid in rids], 1.0)
        for step in range(tokens)
    ]
    reasons = protocol.FINISH_REASONS
    elapsed = 0.0

    async def main() -> None:
        nonlocal elapsed
        streams: dict[str, RequestStream] = {}
        for rid in rids:
            stream = RequestStream(None, rid, [1], params, None, 0, 1 << 20)  # type: ignore[arg-type]
            stream._entered = True
            if not reading:
                stream._collected = []
            streams[rid] = stream

        async def read(stream: RequestStream) -> None:
            if reading:
                async for _ in stream:
                    pass
            else:
                await stream._until_ended()

        async with trio.open_nursery() as nursery:
            for stream in streams.values():
                nursery.start_soon(read, stream)
            await trio.testing.wait_all_tasks_blocked()
            began = time.process_time()
            get = streams.get
            for frame in frames:
                message = protocol.decode_client_frames([frame])
                for out in message[0]:  # type: ignore[index]
                    found = get(out.request_id)
                    if found is not None:
                        finish = out.finish_reason
                        found._push(out.new_token_ids, None if finish is None else reasons[finish])
                await trio.lowlevel.checkpoint()  # the readers woken run
        elapsed = time.process_time() - began  # once every reader ended

    trio.run(main)
    return elapsed / size * 1e6


def _floor_parts(params: Any) -> dict[str, tuple[Any, int]]:
    """The floor of the client's receive path, per output: one stand-in step of 1024
    outputs (their requests' streams open, as the client holds them) decoded by the
    client's decoder and each output handed to its stream (``RequestStream._push``) with
    no reader waiting, as in the ``whole`` shape (tokens gathered) and the streams shape
    (an output object buffered); and an ADD onto a zmq socket (``send_multipart`` of
    the three frames the client sends, a thread of this process reading them: its
    share of the GIL is in the figure, an upper bound)."""
    import zmq

    from benchmarks.programs.stand_in_engine import TOKEN, outputs_frame
    from trio_dpcoord import RequestStream, protocol

    size = 1024
    rids = [f"trio-0123456789ab-{i}" for i in range(size)]
    frame = outputs_frame(0, [(rid, TOKEN, None) for rid in rids], 1.0)

    def streams(collect: bool) -> dict[str, RequestStream]:
        out = {}
        for rid in rids:
            stream = RequestStream(None, rid, [1], params, None, 0, 1 << 30)  # type: ignore[arg-type]
            stream._entered = True
            if collect:
                stream._collected = []
            out[rid] = stream
        return out

    def deliver(table: dict[str, RequestStream]) -> Any:
        def run() -> None:
            message = protocol.decode_client_frames([frame])
            get = table.get
            for out in message[0]:  # type: ignore[index]
                stream = get(out.request_id)
                if stream is not None:
                    stream._push(out.new_token_ids, None)
            if not collected:
                for stream in table.values():
                    stream._buffer.clear()

        collected = next(iter(table.values()))._collected is not None
        return run

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.setsockopt(zmq.LINGER, 0)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.connect(f"tcp://127.0.0.1:{port}")
    threading.Thread(
        target=lambda: [pull.recv_multipart() for _ in iter(int, 1)], daemon=True
    ).start()
    add = protocol.encode_add(
        "trio-0123456789ab-17", [3, 4, 5, 6], params, arrival_time=1.5, current_wave=0
    )
    message = [b"\x00\x00", *add]

    def send() -> None:
        push.send_multipart(message)

    return {
        "floor: decode + hand to a stream, whole (tokens gathered), per output": (
            deliver(streams(True)),
            size,
        ),
        "floor: decode + hand to a stream, streams (output buffered), per output": (
            deliver(streams(False)),
            size,
        ),
        "floor: an ADD's three frames onto a zmq socket (send_multipart), per request": (
            send,
            1,
        ),
    }
