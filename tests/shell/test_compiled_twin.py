"""The compiled twins of the shim's batch receive and send against their pure-Python spec.

``trio_zmq/_socket.py`` takes ``receive_queued`` (the engine-output listener's batch
receive) and ``send_frames`` (the broadcaster's send of one message) from its compiled
twin (``trio_zmq/_socket_kernel.pyx``, libzmq called directly) where it was built. Here
the pure functions (loaded from source by :func:`tests.pure_twin.pure_twin_modules`)
and the package's own work on real sockets (inproc and ipc, single and multipart, empty
and large frames). The receive: the same queued messages in batches of random sizes,
the same batches, the same ``zmq.Again`` when drained, the same error on a closed
socket; ``take_messages`` (the batch receive's whole attempt) also the same EVENTS each
batch ended on. The send: the same messages arrive, the same count taken before a full queue
refuses, the same errors (closed socket, a ``str`` frame, no frames). ``read_events``
(``zmq.EVENTS``): the same readiness after every step of random sends and receives.
With ``TRIO_DPCOORD_PURE_PYTHON=1`` (or no compiler at install) both sides are pure and
this checks the loader and the switch; CI runs it both ways.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.pure_twin import (
    PURE_PYTHON,
    PURE_TWIN_PACKAGE,
    REQUIRE_COMPILED,
    kernel_state,
    package_module,
    pure_twin_modules,
)

MODULE = "trio_zmq._socket"
FAST = package_module(MODULE)
PURE = pure_twin_modules([MODULE])[MODULE]

BUILT, IN_USE = kernel_state(MODULE)

Receive = Callable[[Any, list[list[bytes]], int], None]


def test_the_build_asked_for_runs() -> None:
    if REQUIRE_COMPILED and not PURE_PYTHON:
        assert BUILT, "the compiled twin was not built"
    assert (BUILT and not PURE_PYTHON) == IN_USE
    for name in ("receive_queued", "take_messages", "send_frames", "read_events"):
        assert getattr(FAST, name).__module__.endswith("_kernel") == IN_USE
        assert getattr(PURE, name).__module__.startswith(PURE_TWIN_PACKAGE)


@contextlib.contextmanager
def connected(address: str, hwm: int | None = None) -> Iterator[tuple[Any, Any]]:
    """A PUSH socket connected to a PULL one bound at ``address``, on a context of their
    own (destroyed on the way out); ``hwm``: both ends' high-water mark, else zmq's."""
    context = zmq.Context()
    try:
        pull = context.socket(zmq.PULL)
        push = context.socket(zmq.PUSH)
        if hwm is not None:
            pull.setsockopt(zmq.RCVHWM, hwm)
            push.setsockopt(zmq.SNDHWM, hwm)
        pull.bind(address)
        push.connect(address)
        yield push, pull
    finally:
        context.destroy(linger=0)


@pytest.fixture(params=["inproc", "ipc"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """A PUSH socket connected to a PULL one (no high-water marks)."""
    address = "inproc://twin" if request.param == "inproc" else f"ipc://{tmp_path}/twin"
    with connected(address, hwm=0) as sockets:
        yield sockets


def read_all(receive: Receive, pull: Any, sizes: list[int], expected: int) -> list[Any]:
    """Batches of ``sizes`` (cycled) until ``expected`` messages are taken; what each
    call gave: its batch, and the error it ended with."""
    calls: list[Any] = []
    taken = 0
    turn = 0
    while taken < expected:
        batch: list[list[bytes]] = []
        try:
            receive(pull, batch, sizes[turn % len(sizes)])
            error = None
        except zmq.Again:
            error = "Again"
            if not batch:
                pull.poll(5000)  # the ipc transport still moving bytes
                continue
        calls.append((batch, error))
        taken += len(batch)
        turn += 1
    return calls


frames_st = st.binary(max_size=40) | st.sampled_from([b"", bytes(70_000)])
messages_st = st.lists(st.lists(frames_st, min_size=1, max_size=4), min_size=1, max_size=30)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=messages_st, sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4))
def test_the_twins_take_the_same_batches(
    pair: tuple[Any, Any], messages: list[list[bytes]], sizes: list[int]
) -> None:
    push, pull = pair
    results = []
    for receive in (FAST.receive_queued, PURE.receive_queued):
        for message in messages:
            push.send_multipart(message)
        calls = read_all(receive, pull, sizes, len(messages))
        assert [m for batch, _ in calls for m in batch] == messages
        assert all(type(f) is bytes for batch, _ in calls for m in batch for f in m)
        results.append(calls)
        drained: list[list[bytes]] = []
        with pytest.raises(zmq.Again):
            receive(pull, drained, 5)
        assert drained == []
    assert results[0] == results[1] or "ipc" in pull.getsockopt(zmq.LAST_ENDPOINT).decode()


def take_all(take: Any, pull: Any, sizes: list[int], expected: int) -> list[Any]:
    """``take(pull, size)`` with ``sizes`` cycled until ``expected`` messages are taken,
    then once more on the drained socket; what each call returned, or its error."""
    calls: list[Any] = []
    taken = 0
    turn = 0
    while taken < expected:
        try:
            batch, events = take(pull, sizes[turn % len(sizes)])
        except zmq.Again:
            pull.poll(5000)  # the ipc transport still moving bytes
            continue
        turn += 1
        assert batch, "a take returns at least one message"
        assert events is None or type(events) is int
        calls.append((batch, events))
        taken += len(batch)
    with pytest.raises(zmq.Again):
        take(pull, 3)
    calls.append("Again")
    return calls


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=messages_st, sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4))
def test_the_twins_take_the_same_batch_and_events(
    pair: tuple[Any, Any], messages: list[list[bytes]], sizes: list[int]
) -> None:
    """``take_messages``, the batch receive's attempt: the same messages in the same
    batches, each ending on the same EVENTS (POLLIN clear: the next receive's hint) or
    None (the batch was full, or more may be queued), then the same ``zmq.Again``."""
    push, pull = pair
    results = []
    for take in (FAST.take_messages, PURE.take_messages):
        for message in messages:
            push.send_multipart(message)
        calls = take_all(take, pull, sizes, len(messages))
        assert [m for batch, _ in calls[:-1] for m in batch] == messages
        for batch, events in calls[:-1]:
            assert all(type(f) is bytes for m in batch for f in m)
            assert events is None or not events & zmq.POLLIN
        results.append(calls)
    # over ipc the I/O thread may hand messages over between two reads: same content only
    assert results[0] == results[1] or "ipc" in pull.getsockopt(zmq.LAST_ENDPOINT).decode()


def test_a_lone_message_ends_on_the_events_read() -> None:
    """One queued message (every wave report): both twins return it with the EVENTS that
    says nothing more is queued, and a batch of one reads no EVENTS at all."""
    with connected("inproc://lone") as (push, pull):
        for take in (FAST.take_messages, PURE.take_messages):
            push.send(b"report")
            assert take(pull, 64) == ([[b"report"]], FAST.read_events(pull))
            assert not FAST.read_events(pull) & zmq.POLLIN
            push.send_multipart([b"a", b"b"])
            push.send(b"c")
            assert take(pull, 1) == ([[b"a", b"b"]], None)
            assert take(pull, 1) == ([[b"c"]], None)


def test_a_closed_socket_raises_the_same_error() -> None:
    context = zmq.Context()
    try:
        outcomes = []
        for receive in (FAST.receive_queued, PURE.receive_queued):
            pull = context.socket(zmq.PULL)
            pull.close()
            batch: list[list[bytes]] = []
            with pytest.raises(zmq.ZMQError) as caught:
                receive(pull, batch, 3)
            outcomes.append((type(caught.value), caught.value.errno, batch))
        for take in (FAST.take_messages, PURE.take_messages):
            pull = context.socket(zmq.PULL)
            pull.close()
            with pytest.raises(zmq.ZMQError) as caught:
                take(pull, 3)
            outcomes.append((type(caught.value), caught.value.errno, []))
        assert outcomes[0] == outcomes[1] == outcomes[2] == outcomes[3]
    finally:
        context.term()


def receive_messages(pull: Any, count: int) -> list[list[bytes]]:
    """``count`` messages from ``pull``, waiting up to 5 s for each."""
    received = []
    for _ in range(count):
        assert pull.poll(5000), "a sent message did not arrive"
        received.append(pull.recv_multipart(zmq.NOBLOCK))
    return received


buffers_st = frames_st.flatmap(
    lambda frame: st.sampled_from([frame, bytearray(frame), memoryview(frame)])
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(st.lists(buffers_st, min_size=1, max_size=4), min_size=1, max_size=20))
def test_the_twins_send_the_same_messages(pair: tuple[Any, Any], messages: list[list[Any]]) -> None:
    push, pull = pair
    expected = [[bytes(frame) for frame in message] for message in messages]
    for send in (FAST.send_frames, PURE.send_frames):
        taken = [send(push, message) for message in messages]
        assert taken == [len(message) for message in messages]
        assert receive_messages(pull, len(messages)) == expected
        assert pull.poll(0) == 0


@settings(max_examples=30)
@given(messages=st.lists(st.lists(frames_st, min_size=1, max_size=3), min_size=1, max_size=8))
def test_a_full_queue_refuses_the_same_message(messages: list[list[bytes]]) -> None:
    """inproc's queue holds SNDHWM + RCVHWM messages: both twins fill it alike, then
    take none of the next message's frames (0: nothing committed)."""
    outcomes = []
    for send in (FAST.send_frames, PURE.send_frames):
        with connected("inproc://full", hwm=2) as (push, pull):
            taken = [send(push, message) for message in messages * 5]
            received = []
            while pull.poll(0):
                received.append(pull.recv_multipart(zmq.NOBLOCK))
            outcomes.append((taken, received))
    assert outcomes[0] == outcomes[1]
    taken, received = outcomes[0]
    assert taken[len(received)] == 0
    assert received == (messages * 5)[: len(received)]
    assert 0 < len(received) < len(taken)


def test_a_peerless_socket_refuses_the_message_alike() -> None:
    context = zmq.Context()
    try:
        push = context.socket(zmq.PUSH)  # no peer: nothing can be queued
        assert [send(push, [b"a", b"b"]) for send in (FAST.send_frames, PURE.send_frames)] == [0, 0]
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize(
    ("frames", "error"),
    [([], ValueError), (["text"], TypeError), ([b"a", "text"], TypeError), ([b"a", 3], TypeError)],
)
def test_the_twins_reject_the_same_frames(frames: list[Any], error: type[Exception]) -> None:
    with connected("inproc://rejects") as (push, _):
        for send in (FAST.send_frames, PURE.send_frames):
            with pytest.raises(error):
                send(push, frames)


def test_a_closed_socket_refuses_a_send_with_the_same_error() -> None:
    context = zmq.Context()
    try:
        outcomes = []
        for send in (FAST.send_frames, PURE.send_frames):
            push = context.socket(zmq.PUSH)
            push.close()
            with pytest.raises(zmq.ZMQError) as caught:
                send(push, [b"a"])
            outcomes.append((type(caught.value), caught.value.errno))
        assert outcomes[0] == outcomes[1]
    finally:
        context.term()


@settings(max_examples=40)
@given(steps=st.lists(st.sampled_from(["send", "receive", "fill"]), max_size=25))
def test_the_twins_read_the_same_events(steps: list[str]) -> None:
    """inproc (no I/O thread between the two reads): after each step both twins read
    the same EVENTS on both ends, the receiver's POLLIN and the sender's POLLOUT."""
    with connected("inproc://events", hwm=2) as (push, pull):
        for step in steps:
            if step == "receive":
                with contextlib.suppress(zmq.Again):
                    pull.recv(zmq.NOBLOCK)
            else:
                for _ in range(5 if step == "fill" else 1):
                    with contextlib.suppress(zmq.Again):
                        push.send(b"x", zmq.NOBLOCK)
            for sock in (pull, push):
                fast, pure = FAST.read_events(sock), PURE.read_events(sock)
                assert (fast, type(fast)) == (pure, int)
        closed = pull.context.socket(zmq.PULL)
        closed.close()
        errors = []
        for read in (FAST.read_events, PURE.read_events):
            with pytest.raises(zmq.ZMQError) as caught:
                read(closed)
            errors.append(caught.value.errno)
        assert errors[0] == errors[1]
