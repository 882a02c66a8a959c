"""Front-ends telling each other their routes: the wire (``protocol._peer_routes``), the
router's side (``PrefixRouter.take_routed`` / ``receive_routed``), the model's front-ends
and the vLLM plugin's sockets (``vllm._peers``) over real ``ipc://`` ZeroMQ."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import msgpack
import pytest
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_dpcoord import PrefixRouting
from trio_dpcoord.protocol import (
    PEER_ROUTE_MAGIC,
    PeerRoute,
    ProtocolError,
    decode_peer_route,
    encode_peer_route,
)
from trio_dpcoord.routing import PrefixRouter, block_keys
from trio_dpcoord.sim.routing import FrontEnds, make_policy, run_policy
from trio_dpcoord.sim.traces import multi_turn_chat
from trio_dpcoord.vllm._peers import PeerRoutes, peer_endpoints

KEY = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(
    sender=st.integers(0, 2**32),
    block_size=st.integers(1, 4096),
    rank=st.integers(0, 2**16),
    keys=st.lists(KEY, max_size=300),
)
def test_a_route_comes_back_as_sent(
    sender: int, block_size: int, rank: int, keys: list[int]
) -> None:
    frame = encode_peer_route(sender, block_size, rank, keys)
    assert decode_peer_route(frame) == PeerRoute(sender, block_size, rank, tuple(keys))


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_the_protocol_error(data: bytes) -> None:
    try:
        route = decode_peer_route(data)
    except ProtocolError:
        return
    assert route.block_size >= 1 and route.engine_index >= 0  # only a well-formed frame gets here


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (["vllm", 1, 0, 16, 0, b""], "not a peer route"),
        ([PEER_ROUTE_MAGIC, 2, 0, 16, 0, b""], "version 2"),
        ([PEER_ROUTE_MAGIC, 1, 0, 0, 0, b""], "block_size must be >= 1"),
        ([PEER_ROUTE_MAGIC, 1, 0, 16, -1, b""], "rank must be >= 0"),
        ([PEER_ROUTE_MAGIC, 1, 0, 16, 0, b"1234567"], "8-byte ints, got bytes of 7 bytes"),
        ([PEER_ROUTE_MAGIC, 1, 0, 16, 0, [1, 2]], "got list"),
        ([PEER_ROUTE_MAGIC, 1, 0, 16, 0], "must have 6 elements"),
    ],
)
def test_a_malformed_route_says_what_is_wrong(fields: list[object], says: str) -> None:
    with pytest.raises(ProtocolError, match=says):
        decode_peer_route(msgpack.packb(fields, use_bin_type=True))


def test_keys_out_of_64_bits_are_refused_when_encoding() -> None:
    with pytest.raises(ProtocolError, match="signed 64-bit"):
        encode_peer_route(0, 16, 0, [2**63])


def _prompts(seed: int, count: int) -> list[list[int]]:
    """Conversations sharing a system prompt, each resending its history."""
    rng = random.Random(seed)
    system = [rng.randrange(100) for _ in range(48)]
    histories = [list(system) for _ in range(4)]
    prompts = []
    for _ in range(count):
        history = histories[rng.randrange(len(histories))]
        history.extend(rng.randrange(100) for _ in range(rng.randint(8, 40)))
        prompts.append(list(history))
    return prompts


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(4, 64), ranks=st.integers(2, 5))
def test_a_front_end_told_every_route_believes_what_the_router_does(
    seed: int, capacity: int, ranks: int
) -> None:
    """Told each route at once, a second front-end's index equals the router's, evictions
    included (the same stores in the same order)."""
    routing = PrefixRouting(block_size=4, capacity_blocks=capacity)
    router, listener = PrefixRouter(ranks, routing), PrefixRouter(ranks, routing)
    router.share_routes = True
    rng = random.Random(seed)
    for now, prompt in enumerate(_prompts(seed, 30)):
        loads = [float(rng.randrange(200)) for _ in range(ranks)]
        rank = router.choose(prompt, loads, float(now)).engine_index
        routed = router.take_routed()
        assert routed == [(rank, block_keys(prompt, 4))]
        for routed_rank, keys in routed:
            assert listener.receive_routed(routed_rank, keys, float(now))
        assert listener.block_owners() == router.block_owners()
    assert router.take_routed() == []  # taken once


def test_routes_are_kept_only_when_asked_and_refused_where_they_cannot_apply() -> None:
    router = PrefixRouter(2, PrefixRouting(block_size=4))
    router.choose(list(range(16)), [0.0, 0.0], 0.0)
    assert router.take_routed() == []  # share_routes is off by default
    assert not router.receive_routed(2, [1, 2], 0.0)  # no rank 2
    exact = PrefixRouter(2, PrefixRouting(block_size=4, feed="exact"))
    assert not exact.receive_routed(0, block_keys(list(range(16)), 4), 0.0)
    assert exact.block_owners() == {}  # its events say what is cached, not peers


def test_the_models_front_ends_sharing_routes_keep_one_index() -> None:
    trace = multi_turn_chat(3, sessions=12, turns=4, rate_per_s=40.0)
    policy = make_policy("approximate", 2, 256, front_ends=2, seed=1, share_routes=True)
    assert isinstance(policy, FrontEnds)
    run_policy(trace, 2, policy, 256)
    routers = [front.chooser.router for front in policy.front_ends]
    assert routers[0] is not None and routers[1] is not None
    owners = routers[0].block_owners()
    assert owners and owners == routers[1].block_owners()


def test_the_plugins_sockets_refuse_bad_frames_and_apply_good_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two servers' :class:`PeerRoutes` over real ipc sockets, in an asyncio loop as in
    vLLM's API server."""
    endpoints = peer_endpoints(f"ipc://{tmp_path}/stats", 2)
    assert endpoints == peer_endpoints(f"ipc://{tmp_path}/stats", 2)  # every server alike
    assert endpoints != peer_endpoints(f"ipc://{tmp_path}/other", 2)  # another deployment
    caplog.set_level(logging.WARNING)
    routing = PrefixRouting(block_size=4)
    routers = [PrefixRouter(2, routing), PrefixRouter(2, routing)]
    prompt = list(range(40))
    keys = block_keys(prompt, 4)

    async def scenario() -> int:
        context = zmq.asyncio.Context()
        sides = [PeerRoutes(routers[i], context, endpoints, i) for i in range(2)]
        try:
            for side in sides:
                side.ensure_started()
            assert not sides[1].receive(b"\x93junk")
            assert not sides[1].receive(encode_peer_route(0, 8, 0, [1]))  # another block size
            assert not sides[1].receive(encode_peer_route(0, 4, 5, [1]))  # no engine 5
            routers[0].share_routes = True
            for _ in range(200):  # the SUB connects asynchronously: until one arrives
                rank = routers[0].choose(prompt, [0.0, 0.0], 0.0).engine_index
                sides[0].publish(routers[0].take_routed())
                try:
                    await asyncio.wait_for(sides[1].wait_received(1), 0.05)
                except asyncio.TimeoutError:
                    continue
                break
            assert sides[0].sent >= 1 and sides[1].received >= 1, (sides[0].sent, sides[1].received)
            assert sides[1].rejected == 3
            return rank
        finally:
            for side in sides:
                side.stop()
            await asyncio.sleep(0)  # the cancelled reader closes its socket
            context.destroy(linger=0)  # as vLLM's shutdown ends its context

    rank = asyncio.run(scenario())
    # each refusal counted; logged once per kind within RejectLog.INTERVAL
    assert "[shared routes: frame]: refused: " in caplog.text
    assert "route to engine 0 (block size 8) refused" in caplog.text
    assert "route to engine 5" not in caplog.text
    assert routers[1].prefix_groups(keys)[-1] == (len(keys), 1 << rank)
    assert not any(Path(e.removeprefix("ipc://")).exists() for e in endpoints)
