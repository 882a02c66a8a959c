"""Tests for the trio shim over pyzmq (real sockets, real clock; assertions on content and
order, never on timings)."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing
import zmq

from trio_dpcoord.trio_zmq import (
    AsyncSocket,
    open_context,
    open_monitor,
    open_socket,
    parse_monitor_event,
)

Context = zmq.Context[zmq.Socket[bytes]]
TIMEOUT = 30  # generous guard against hangs; no test is expected to come close

_inproc_names = itertools.count()


@pytest.fixture
async def ctx() -> AsyncIterator[Context]:
    async with open_context() as context:
        yield context


@pytest.fixture(params=["inproc", "ipc", "tcp"])
def address(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "inproc":
        return f"inproc://trio-zmq-test-{next(_inproc_names)}"
    if request.param == "ipc":
        path = tmp_path / "s.ipc"
        assert len(str(path)) < 100, "unix socket path too long"
        return f"ipc://{path}"
    return "tcp://127.0.0.1:0"


@asynccontextmanager
async def pair(
    ctx: Context,
    address: str,
    bind_type: int,
    connect_type: int,
    *,
    bind_options: Mapping[int, int | bytes] | None = None,
    connect_options: Mapping[int, int | bytes] | None = None,
) -> AsyncIterator[tuple[AsyncSocket, AsyncSocket]]:
    async with open_socket(ctx, bind_type, bind=address, options=bind_options) as bound:
        assert bound.last_endpoint is not None
        async with open_socket(
            ctx, connect_type, connect=bound.last_endpoint, options=connect_options
        ) as connected:
            yield bound, connected


def events(sock: AsyncSocket) -> int:
    """``zmq.EVENTS`` through the wrapper (which re-checks readiness for waiting tasks)."""
    return cast(int, sock.getsockopt(zmq.EVENTS))


async def wait_for_pollin(sock: AsyncSocket) -> None:
    """Until a message is queued on ``sock`` (so the receive path without waiting runs)."""
    with trio.fail_after(TIMEOUT):
        while not events(sock) & zmq.POLLIN:  # noqa: ASYNC110
            await trio.sleep(0.001)


# -- basics -----------------------------------------------------------------------------


async def test_bind_resolves_tcp_port(ctx: Context) -> None:
    async with open_socket(ctx, zmq.PULL) as pull:
        endpoint = pull.bind("tcp://127.0.0.1:0")
        assert endpoint.startswith("tcp://127.0.0.1:")
        assert int(endpoint.rsplit(":", 1)[1]) > 0
        assert pull.last_endpoint == endpoint
        async with open_socket(ctx, zmq.PUSH, connect=endpoint) as push:
            with trio.fail_after(TIMEOUT):
                await push.send(b"hello")
                assert await pull.recv() == b"hello"


async def test_options_applied_before_bind(ctx: Context) -> None:
    opts: dict[int, int | bytes] = {zmq.SNDHWM: 7, zmq.IDENTITY: b"\x01\x00"}
    async with open_socket(ctx, zmq.DEALER, bind="inproc://opts", options=opts) as dealer:
        assert dealer.zmq_socket.getsockopt(zmq.SNDHWM) == 7
        assert dealer.zmq_socket.getsockopt(zmq.IDENTITY) == b"\x01\x00"
        assert dealer.zmq_socket.getsockopt(zmq.LINGER) == 0


# -- throughput / ordering / integrity --------------------------------------------------


async def test_ordered_delivery_100k(ctx: Context, address: str) -> None:
    n = 100_000
    expected = [b"%d" % i for i in range(n)]
    received: list[bytes] = []
    async with pair(ctx, address, zmq.PULL, zmq.PUSH) as (pull, push):

        async def sender() -> None:
            for frame in expected:
                await push.send(frame)

        with trio.fail_after(TIMEOUT * 2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                while len(received) < n:
                    batch = await pull.recv_batch(max_messages=500)
                    assert 1 <= len(batch) <= 500
                    received.extend(batch)
    assert received == expected


async def test_a_receive_says_whether_it_had_to_wait(ctx: Context) -> None:
    """``receive_waited``: False when messages were queued as the receive began, True
    when it waited for one (how the coordinator's listener tells it keeps up). Over
    inproc, a message sent is in the receiver's pipe when the send returns."""
    async with pair(ctx, "inproc://receive-waited", zmq.PULL, zmq.PUSH) as (pull, push):
        with trio.fail_after(TIMEOUT):
            for n in range(3):
                await push.send(b"%d" % n)
            assert await pull.recv_multipart_batch(10) == [[b"0"], [b"1"], [b"2"]]
            assert not pull.receive_waited
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull.recv_multipart_batch, 10)
                await trio.testing.wait_all_tasks_blocked()  # it waits on the FD
                await push.send(b"late")
            assert pull.receive_waited


@pytest.mark.parametrize("exclusive", [True, False])
async def test_a_wake_with_nothing_queued_waits_again(
    ctx: Context, tmp_path: Path, exclusive: bool
) -> None:
    """Woken by the FD, a receive makes its attempt at once (no EVENTS read first). A peer
    connecting or leaving wakes it with nothing queued (a command in the socket's
    mailbox, not a message): the attempt fails and it waits again, spinning never (else
    ``wait_all_tasks_blocked`` would not return) and losing nothing."""
    address = f"ipc://{tmp_path}/wake.ipc"
    got: list[list[bytes]] = []
    to_test, received = trio.open_memory_channel[list[list[bytes]]](math.inf)
    async with open_socket(ctx, zmq.PULL, bind=address, exclusive=exclusive) as pull:

        async def receiver() -> None:
            while True:
                batch = await pull.recv_multipart_batch(10)
                assert pull.receive_waited
                to_test.send_nowait(batch)

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                for n in range(3):
                    async with open_socket(ctx, zmq.PUSH, connect=address) as push:
                        await trio.sleep(0.05)  # the connection's commands reach the PULL
                        await trio.testing.wait_all_tasks_blocked()
                        await push.send(b"%d" % n)
                        got.extend(await received.receive())
                    await trio.sleep(0.05)  # the peer's departure reaches the PULL
                    await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
    assert got == [[b"0"], [b"1"], [b"2"]]


def _random_message(rng: random.Random, tag: bytes, seq: int) -> list[bytes]:
    sizes = [0, 1, 7, 300, 4096, 70_000]
    parts = [tag + b":%d" % seq]
    for _ in range(rng.randrange(0, 7)):
        size = rng.choice(sizes)
        parts.append(rng.randbytes(size))
    return parts


async def test_multipart_integrity_two_senders(ctx: Context, address: str) -> None:
    rng = random.Random(1234)
    per_sender = 800
    msgs = {tag: [_random_message(rng, tag, i) for i in range(per_sender)] for tag in (b"a", b"b")}
    got: dict[bytes, list[list[bytes]]] = {b"a": [], b"b": []}
    opts: dict[int, int | bytes] = {zmq.SNDHWM: 5}
    async with pair(ctx, address, zmq.PULL, zmq.PUSH, connect_options=opts) as (pull, push):

        async def sender(tag: bytes) -> None:
            for i, m in enumerate(msgs[tag]):
                if i % 3 == 0 and push.send_nowait(m):
                    continue
                await push.send_multipart(m)

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender, b"a")
                nursery.start_soon(sender, b"b")
                total = 0
                use_batch = False
                while total < 2 * per_sender:
                    if use_batch:
                        batch = await pull.recv_multipart_batch(max_messages=7)
                    else:
                        batch = [await pull.recv_multipart()]
                    use_batch = not use_batch
                    for m in batch:
                        got[m[0].split(b":")[0]].append(m)
                    total += len(batch)
    # Each message intact (no interleaving between the two senders), per-sender order kept.
    assert got == msgs


async def test_many_receivers_one_socket(ctx: Context, address: str) -> None:
    n = 20_000
    received: list[bytes] = []
    all_received = trio.Event()
    async with pair(ctx, address, zmq.PULL, zmq.PUSH) as (pull, push):

        async def receiver(kind: int) -> None:
            while True:
                if kind == 0:
                    batch = await pull.recv_batch(max_messages=50)
                elif kind == 1:
                    batch = [await pull.recv()]
                else:
                    batch = [m[0] for m in await pull.recv_multipart_batch(max_messages=3)]
                received.extend(batch)
                if len(received) == n:
                    all_received.set()

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                for kind in range(3):
                    nursery.start_soon(receiver, kind)
                for i in range(n):
                    await push.send(b"%d" % i)
                await all_received.wait()
                nursery.cancel_scope.cancel()
    assert sorted(received, key=int) == [b"%d" % i for i in range(n)]


# -- one socket, two directions at once --------------------------------------------------


async def test_dealer_router_both_directions_small_hwm(ctx: Context, address: str) -> None:
    n = 3000
    hwm: dict[int, int | bytes] = {zmq.SNDHWM: 10, zmq.RCVHWM: 10}
    ident = b"\x01\x00"
    router_opts = {**hwm, zmq.ROUTER_MANDATORY: 1}
    dealer_opts = {**hwm, zmq.IDENTITY: ident}
    at_router: list[bytes] = []
    at_dealer: list[bytes] = []
    async with pair(
        ctx,
        address,
        zmq.ROUTER,
        zmq.DEALER,
        bind_options=router_opts,
        connect_options=dealer_opts,
    ) as (router, dealer):
        peer_known = trio.Event()

        async def router_recv() -> None:
            while len(at_router) < n:
                for who, payload in await router.recv_multipart_batch(max_messages=4):
                    assert who == ident
                    at_router.append(payload)
                    peer_known.set()

        async def router_send() -> None:
            await peer_known.wait()
            for i in range(n):
                await router.send_multipart([ident, b"r%d" % i])

        async def dealer_recv() -> None:
            while len(at_dealer) < n:
                if len(at_dealer) % 2:
                    at_dealer.extend(await dealer.recv_batch(max_messages=3))
                else:
                    at_dealer.append(await dealer.recv())

        async def dealer_send() -> None:
            for i in range(n):
                await dealer.send(b"d%d" % i)

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                for task in (router_recv, router_send, dealer_recv, dealer_send):
                    nursery.start_soon(task)
    assert at_router == [b"d%d" % i for i in range(n)]
    assert at_dealer == [b"r%d" % i for i in range(n)]


async def test_xpub_broadcast_while_subscriptions_arrive(ctx: Context, address: str) -> None:
    peers = 3
    subs_per_peer = 300
    broadcasts = 2000
    # Broadcasts: small HWMs and XPUB_NODROP, so the XPUB's sender really waits (instead of
    # dropping) while its receiver waits for subscriptions.  Subscriptions: an XSUB drops
    # them silently beyond its HWM, so those HWMs stay at the default (> subs_per_peer).
    xpub_opts: dict[int, int | bytes] = {zmq.XPUB_VERBOSE: 1, zmq.XPUB_NODROP: 1, zmq.SNDHWM: 10}
    xsub_opts: dict[int, int | bytes] = {zmq.RCVHWM: 10}
    subscriptions: list[bytes] = []
    seen: list[list[bytes]] = [[] for _ in range(peers)]
    async with open_socket(ctx, zmq.XPUB, bind=address, options=xpub_opts) as xpub:
        assert xpub.last_endpoint is not None
        async with (
            open_socket(ctx, zmq.XSUB, connect=xpub.last_endpoint, options=xsub_opts) as x0,
            open_socket(ctx, zmq.XSUB, connect=xpub.last_endpoint, options=xsub_opts) as x1,
            open_socket(ctx, zmq.XSUB, connect=xpub.last_endpoint, options=xsub_opts) as x2,
        ):
            xsubs = [x0, x1, x2]
            all_subscribed = trio.Event()

            async def xpub_recv() -> None:
                while len(subscriptions) < peers * subs_per_peer:
                    subscriptions.extend(await xpub.recv_batch(max_messages=8))
                all_subscribed.set()

            async def xpub_send() -> None:
                for i in range(broadcasts):
                    await xpub.send(b"t%d" % i)
                await all_subscribed.wait()
                await xpub.send(b"tEND")

            async def peer_send(sock: AsyncSocket) -> None:
                for _ in range(subs_per_peer):
                    await sock.send(b"\x01t")

            async def peer_recv(k: int) -> None:
                while True:
                    frame = await xsubs[k].recv()
                    if frame == b"tEND":
                        return
                    seen[k].append(frame)

            with trio.fail_after(TIMEOUT):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(xpub_recv)
                    nursery.start_soon(xpub_send)
                    for k, sock in enumerate(xsubs):
                        nursery.start_soon(peer_send, sock)
                        nursery.start_soon(peer_recv, k)
    assert subscriptions == [b"\x01t"] * (peers * subs_per_peer)
    for frames in seen:
        # Once subscribed a peer gets every later broadcast (NODROP), in order.
        nums = [int(f[1:]) for f in frames]
        if nums:
            assert nums == list(range(nums[0], broadcasts))


async def test_xpub_verbose_subscriptions_from_several_xsubs(ctx: Context, address: str) -> None:
    peers = 4
    opts: dict[int, int | bytes] = {zmq.XPUB_VERBOSE: 1}
    async with open_socket(ctx, zmq.XPUB, bind=address, options=opts) as xpub:
        assert xpub.last_endpoint is not None
        endpoint = xpub.last_endpoint
        async with (
            open_socket(ctx, zmq.XSUB, connect=endpoint) as a,
            open_socket(ctx, zmq.XSUB, connect=endpoint) as b,
            open_socket(ctx, zmq.XSUB, connect=endpoint) as c,
            open_socket(ctx, zmq.XSUB, connect=endpoint) as d,
        ):
            with trio.fail_after(TIMEOUT):
                got: list[bytes] = []

                async def collect() -> None:
                    while len(got) < peers:
                        got.append(await xpub.recv())

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(collect)
                    await trio.testing.wait_all_tasks_blocked()
                    for sock in (a, b, c, d):
                        await sock.send(b"\x01")
                assert got == [b"\x01"] * peers
                # Every peer is subscribed to everything now.
                await xpub.send_multipart([b"wave", b"7"])
                for sock in (a, b, c, d):
                    assert await sock.recv_multipart() == [b"wave", b"7"]


@pytest.mark.parametrize("fill_hwm", [False, True], ids=["send-succeeds", "send-waits"])
async def test_edge_consumed_by_other_task_still_wakes_receiver(
    ctx: Context, fill_hwm: bool
) -> None:
    """pyzmq #199-style hang: a message's wake-up edge is consumed by another task's
    operation on the same socket (a successful send, or a send that gets Again and checks
    EVENTS before waiting) before the FD waiter ever sees it.  inproc makes it
    deterministic: the router's send signals the dealer's FD synchronously, and the
    dealer's send processes (eats) that signal before trio polls again."""
    async with (
        open_socket(ctx, zmq.ROUTER, bind="inproc://edge", options={zmq.RCVHWM: 1}) as router,
        open_socket(
            ctx, zmq.DEALER, connect="inproc://edge", options={zmq.IDENTITY: b"D", zmq.SNDHWM: 1}
        ) as dealer,
    ):
        with trio.fail_after(TIMEOUT):
            await dealer.send(b"hello")
            assert await router.recv_multipart() == [b"D", b"hello"]
            while fill_hwm:
                while dealer.send_nowait([b"fill"]):
                    pass
                if not events(dealer) & zmq.POLLOUT:
                    break
            got: list[bytes] = []
            async with trio.open_nursery() as nursery:
                send_scope = trio.CancelScope()

                async def receive() -> None:
                    got.append(await dealer.recv())
                    send_scope.cancel()

                nursery.start_soon(receive)
                await trio.testing.wait_all_tasks_blocked()
                # From here on no checkpoint until the dealer has processed the signal.
                assert router.send_nowait([b"D", b"wake-up"])
                if fill_hwm:
                    with send_scope:
                        await dealer.send(b"x")  # Again, then EVENTS eats the edge; parks
                    assert send_scope.cancelled_caught
                else:
                    time.sleep(0.01)  # noqa: ASYNC251 -- libzmq's send skips command processing for ~1 ms
                    assert dealer.send_nowait([b"x"])
            assert got == [b"wake-up"]


async def test_own_send_between_batch_receives_voids_the_remembered_events(
    ctx: Context,
) -> None:
    """A batch receive remembers the EVENTS read that ended it (the socket was empty), so
    that the next receive need not read it again. Any zmq call in between voids that:
    here the socket's own send, which eats the wake-up edge of a message that arrived
    meanwhile. Trusting the stale "empty" would wait on the FD for an edge already gone."""
    async with (
        open_socket(ctx, zmq.ROUTER, bind="inproc://hint") as router,
        open_socket(
            ctx, zmq.DEALER, connect="inproc://hint", options={zmq.IDENTITY: b"D"}
        ) as dealer,
    ):
        with trio.fail_after(TIMEOUT):
            await dealer.send(b"hello")
            assert await router.recv_multipart() == [b"D", b"hello"]
            assert router.send_nowait([b"D", b"first"])
            assert await dealer.recv_batch() == [b"first"]
            assert router.send_nowait([b"D", b"second"])  # signals the dealer's FD
            time.sleep(0.01)  # noqa: ASYNC251 -- libzmq's send skips command processing for ~1 ms
            assert dealer.send_nowait([b"x"])  # processes (eats) that signal
            assert await dealer.recv_batch() == [b"second"]
            assert await router.recv_multipart() == [b"D", b"x"]


# -- cancellation --------------------------------------------------------------------------


async def test_cancelled_recv_then_send_then_recv(ctx: Context, address: str) -> None:
    async with pair(ctx, address, zmq.PULL, zmq.PUSH) as (pull, push):
        with trio.fail_after(TIMEOUT):
            # Cancelled while waiting (deadline) ...
            with trio.move_on_after(0.02) as cs:
                await pull.recv()
            assert cs.cancelled_caught
            # ... and cancelled from outside while parked on the FD.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull.recv_batch)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
            await push.send(b"exactly-this")
            assert await pull.recv() == b"exactly-this"
            # A receive cancelled before it starts must not take a queued message.
            await push.send(b"queued")
            await wait_for_pollin(pull)
            with trio.CancelScope() as cs:
                cs.cancel()
                await pull.recv_multipart()
            assert cs.cancelled_caught
            assert await pull.recv_batch() == [b"queued"]


async def test_cancelled_receives_lose_nothing(ctx: Context, address: str) -> None:
    n = 20_000
    rng = random.Random(99)
    received: list[bytes] = []
    cancelled = 0
    async with pair(ctx, address, zmq.PULL, zmq.PUSH) as (pull, push):

        async def sender() -> None:
            for i in range(n):
                await push.send(b"%d" % i)

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                while len(received) < n:
                    delay = rng.choice([0.0, 0.0, 1e-5, 1e-4, 1e-3])
                    with trio.move_on_after(delay) as cs:
                        kind = rng.randrange(3)
                        if kind == 0:
                            received.extend(await pull.recv_batch(max_messages=64))
                        elif kind == 1:
                            received.append(await pull.recv())
                        else:
                            received.extend(m[0] for m in await pull.recv_multipart_batch())
                    cancelled += cs.cancelled_caught
    assert received == [b"%d" % i for i in range(n)]
    assert cancelled > 0  # the zero-delay scopes are always cancelled


async def test_cancelled_send_sends_nothing(ctx: Context) -> None:
    async with open_socket(ctx, zmq.DEALER, options={zmq.SNDHWM: 1}) as dealer:
        assert not dealer.send_nowait([b"no", b"peer"])
        with trio.fail_after(TIMEOUT):
            with trio.move_on_after(0.02) as cs:
                await dealer.send(b"never")  # no peer: blocks
            assert cs.cancelled_caught
            async with open_socket(ctx, zmq.ROUTER, bind="inproc://cancel-send") as router:
                dealer.connect("inproc://cancel-send")
                await dealer.send(b"first")
                assert dealer.send_nowait([b"second", b"2"])
                assert (await router.recv_multipart())[1:] == [b"first"]
                assert (await router.recv_multipart())[1:] == [b"second", b"2"]


# -- backpressure -----------------------------------------------------------------------------


async def test_send_blocked_by_hwm_completes_when_peer_reads(ctx: Context, address: str) -> None:
    n = 300
    payload = b"x" * 200_000  # 60 MB in total: more than HWMs and kernel buffers can hold
    sent = 0
    async with pair(
        ctx,
        address,
        zmq.PULL,
        zmq.PUSH,
        bind_options={zmq.RCVHWM: 1},
        connect_options={zmq.SNDHWM: 1},
    ) as (pull, push):

        async def sender() -> None:
            nonlocal sent
            for i in range(n):
                await push.send_multipart([b"%d" % i, payload])
                sent += 1

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                assert sent < n  # blocked by HWM, not dropping
                for i in range(n):
                    seq, body = await pull.recv_multipart()
                    assert seq == b"%d" % i
                    assert body == payload
    assert sent == n


async def test_dealer_send_waits_for_connect(ctx: Context, address: str) -> None:
    async with (
        open_socket(ctx, zmq.ROUTER, bind=address) as router,
        open_socket(ctx, zmq.DEALER, options={zmq.IDENTITY: b"D"}) as dealer,
    ):
        assert router.last_endpoint is not None
        done = trio.Event()

        async def sender() -> None:
            await dealer.send_multipart([b"hello", b"world"])
            done.set()

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                # A receiving task waits on the same socket at the same time.
                nursery.start_soon(dealer.recv)
                await trio.testing.wait_all_tasks_blocked()
                assert not done.is_set()
                dealer.connect(router.last_endpoint)
                assert await router.recv_multipart() == [b"D", b"hello", b"world"]
                await done.wait()
                await router.send_multipart([b"D", b"reply"])
        # The nursery exits only once dealer.recv() got the reply.


# -- checkpoints ----------------------------------------------------------------------------


async def test_checkpoints(ctx: Context, address: str) -> None:
    async with pair(ctx, address, zmq.PULL, zmq.PUSH) as (pull, push):
        with trio.fail_after(TIMEOUT):
            with trio.testing.assert_checkpoints():
                await push.send(b"1")
            with trio.testing.assert_checkpoints():
                await push.send_multipart([b"2", b"2"])
            await push.send(b"3")
            await push.send(b"4")
            await push.send(b"5")
            for expected in ([b"1"], [b"2", b"2"]):
                await wait_for_pollin(pull)
                with trio.testing.assert_checkpoints():
                    assert await pull.recv_multipart() == expected
            await wait_for_pollin(pull)
            with trio.testing.assert_checkpoints():
                assert await pull.recv() == b"3"
            await wait_for_pollin(pull)
            with trio.testing.assert_checkpoints():
                assert await pull.recv_batch(max_messages=1) == [b"4"]
            await wait_for_pollin(pull)
            with trio.testing.assert_checkpoints():
                assert await pull.recv_multipart_batch() == [[b"5"]]
            with trio.testing.assert_checkpoints():
                await pull.aclose()
            with trio.testing.assert_checkpoints():
                await pull.aclose()


# -- exclusive sockets -------------------------------------------------------------------


async def test_exclusive_socket_refuses_a_second_task_and_loses_nothing(
    ctx: Context, address: str
) -> None:
    """One task at a time: while it waits, another operation raises BusyResourceError and
    changes nothing; the waiter still gets every message, in order, and a cancelled
    receive takes none."""
    async with (
        open_socket(ctx, zmq.PULL, bind=address, exclusive=True) as pull,
        open_socket(ctx, zmq.PUSH, connect=cast(str, pull.last_endpoint)) as push,
    ):
        got: list[list[bytes]] = []
        with trio.fail_after(TIMEOUT):
            with trio.move_on_after(0.05):
                await pull.recv_multipart_batch()  # cancelled while waiting: takes nothing
            async with trio.open_nursery() as nursery:

                async def owner() -> None:
                    while len(got) < 3:
                        got.extend(await pull.recv_multipart_batch())

                nursery.start_soon(owner)
                await trio.testing.wait_all_tasks_blocked()
                for intruder in (pull.recv, pull.recv_batch, pull.recv_multipart_batch):
                    with pytest.raises(trio.BusyResourceError):
                        await intruder()
                with pytest.raises(trio.BusyResourceError):
                    pull.notify_touched()
                for frame in (b"1", b"2", b"3"):
                    await push.send(frame)
        assert got == [[b"1"], [b"2"], [b"3"]]
        with trio.fail_after(TIMEOUT):
            await push.send(b"4")  # nobody waits now: any task may use it
            assert await pull.recv() == b"4"


async def test_closing_an_exclusive_socket_wakes_its_waiter(ctx: Context) -> None:
    async with open_socket(ctx, zmq.PULL, bind="inproc://exclusive-close", exclusive=True) as pull:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:

                async def waiter() -> None:
                    with pytest.raises(trio.ClosedResourceError):
                        await pull.recv_multipart_batch()

                nursery.start_soon(waiter)
                await trio.testing.wait_all_tasks_blocked()
                await pull.aclose()


async def test_monitor_events_decoded_and_garbage_refused(ctx: Context, tmp_path: Path) -> None:
    """libzmq's own monitor frames decode (here: LISTENING on the bound endpoint); frames
    that are not a monitor event raise ValueError, whatever is wrong with them."""
    address = f"ipc://{tmp_path / 'monitored.ipc'}"
    async with open_socket(ctx, zmq.PULL) as pull:
        async with open_monitor(ctx, pull, zmq.EVENT_LISTENING) as monitor:
            pull.bind(address)
            with trio.fail_after(TIMEOUT):
                event = parse_monitor_event(await monitor.recv_multipart())
    assert (event.event, event.endpoint) == (zmq.EVENT_LISTENING, address)
    for garbage in (
        [b"\x08\x00\x00\x00\x00"],  # one frame
        [b"\x08\x00\x00\x00\x00", address.encode()],  # a 5-byte head
        [b"\x08\x00\x00\x00\x00\x00", b"\xff\xfe"],  # an endpoint that is not UTF-8
        [b"\x08\x00\x00\x00\x00\x00", address.encode(), b"extra"],
    ):
        with pytest.raises(ValueError, match="unreadable socket monitor event"):
            parse_monitor_event(garbage)


# -- closing ----------------------------------------------------------------------------------


async def expect_closed(outcomes: list[str], op: Any, *args: Any) -> None:
    """Await ``op(*args)``, which must fail with ClosedResourceError (the socket closed
    under it); then record its name in ``outcomes``."""
    with pytest.raises(trio.ClosedResourceError):
        await op(*args)
    outcomes.append(op.__name__)


async def test_close_wakes_fd_waiter_and_parked_tasks(ctx: Context, address: str) -> None:
    outcomes: list[str] = []
    async with pair(ctx, address, zmq.DEALER, zmq.DEALER) as (a, b):
        assert not b.closed

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(expect_closed, outcomes, a.recv)  # becomes the FD waiter
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(expect_closed, outcomes, a.recv_batch)  # parked
                nursery.start_soon(expect_closed, outcomes, a.recv_multipart)  # parked
                await trio.testing.wait_all_tasks_blocked()
                await a.aclose()
            assert sorted(outcomes) == ["recv", "recv_batch", "recv_multipart"]
            assert a.closed

            # Operations after close.
            ops: list[tuple[Callable[..., Awaitable[object]], tuple[object, ...]]] = [
                (a.recv, ()),
                (a.recv_batch, ()),
                (a.recv_multipart, ()),
                (a.recv_multipart_batch, ()),
                (a.send, (b"x",)),
                (a.send_multipart, ([b"x"],)),
            ]
            for op, args in ops:
                with pytest.raises(trio.ClosedResourceError):
                    await op(*args)
            with pytest.raises(trio.ClosedResourceError):
                a.send_nowait([b"x"])
            with pytest.raises(trio.ClosedResourceError):
                a.bind("inproc://closed")
            with pytest.raises(trio.ClosedResourceError):
                a.connect("inproc://closed")
            await a.aclose()  # idempotent


async def test_close_wakes_sender_and_receiver_on_one_socket(ctx: Context) -> None:
    outcomes: list[str] = []
    async with open_socket(ctx, zmq.DEALER) as dealer:  # no peer: send and recv both wait
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(expect_closed, outcomes, dealer.send, b"x")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(expect_closed, outcomes, dealer.recv)
                await trio.testing.wait_all_tasks_blocked()
                await dealer.aclose()
    assert sorted(outcomes) == ["recv", "send"]


# -- a continuation frame refused (defensive path; libzmq does not do this) ----------------


class _RefuseSecondFrameOnce(zmq.Socket[bytes]):
    refused = False

    def send(self, data: Any, flags: int = 0, **kwargs: Any) -> Any:  # type: ignore[override]
        if data == b"part2" and not self.refused:
            self.refused = True
            raise zmq.Again()
        return super().send(data, flags, **kwargs)


async def test_refused_continuation_frame_is_finished(ctx: Context) -> None:
    raw = _RefuseSecondFrameOnce(ctx, zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    async with (
        open_socket(ctx, zmq.PULL, bind="inproc://tail") as pull,
        AsyncSocket(raw) as push,
    ):
        push.connect("inproc://tail")
        with trio.fail_after(TIMEOUT):
            await push.send_multipart([b"part1", b"part2", b"part3"])
            await push.send(b"next")
            assert await pull.recv_multipart() == [b"part1", b"part2", b"part3"]
            assert await pull.recv_multipart() == [b"next"]


async def test_context_exit_closes_leftover_sockets(caplog: pytest.LogCaptureFixture) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_context() as context:
            leftover = context.socket(zmq.DEALER)
            leftover.connect("tcp://127.0.0.1:9")  # pending messages must not block term
            leftover.send(b"queued")
        assert leftover.closed
    assert "still open" in caplog.text


def test_monitor_flood_neither_stalls_the_io_thread_nor_its_stop(tmp_path: Path) -> None:
    """800 peers connect and disconnect while the monitor is not read (about 2,400 events,
    more than the ~2,000 an inproc pipe of default high-water marks holds). libzmq sends
    monitor events with blocking sends from its I/O thread: with a bounded pipe, another
    socket of the same context would stop moving, and stopping the monitor would block for
    ever. Run in a child process, since a blocked libzmq call cannot be cancelled."""
    script = Path(__file__).parent / "scripts" / "monitor_flood.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "800"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == {"peers": 800, "other_socket": "still moving", "monitor_stopped": True}
