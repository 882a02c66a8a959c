"""The simulated engines' prefix caches, their vLLM-format stats and KV events, over
real sockets; and a small cluster where prefix routing makes the engines hit more.

No timing assertions: the engines' step times only set how long a run takes.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import trio
import zmq

from tests.sim.test_cluster import engine_config
from trio_dpcoord import EngineChooser, PrefixRouting, Routing, open_coordinator, protocol
from trio_dpcoord.protocol import (
    IDLE_LOAD,
    BlockRemoved,
    BlockStored,
    PrefixCacheStats,
    SchedulerStats,
    decode_event_batch,
    decode_kv_event_frames,
)
from trio_dpcoord.routing import block_keys
from trio_dpcoord.sim import ClusterConfig, LoadPlan, SimEngine, open_sim_frontend, run_cluster
from trio_dpcoord.sim.engine import run_sim_engine
from trio_dpcoord.trio_zmq import AsyncSocket, open_context, open_socket

BLOCK = 16


def prompt(seed: int, tokens: int) -> tuple[int, ...]:
    return tuple(1000 * seed + i for i in range(tokens))


# --------------------------------------------------------------------------- codec

# vLLM's own MsgpackEncoder over EngineCoreOutputs(engine_index=1, scheduler_stats=
# SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, step_counter=7, current_wave=3,
# kv_cache_usage=0.25, prefix_cache_stats=PrefixCacheStats(requests=2, queries=160,
# hits=96))), timestamp as it set it; written once by the CPU build in the shared cache
# (vLLM 0.32.0, whose SchedulerStats and PrefixCacheStats fields are 0.33.0's).
VLLM_OUTPUTS_WITH_PREFIX_STATS = bytes.fromhex(
    "990190de0012b06e756d5f72756e6e696e675f7265717302b06e756d5f77616974696e675f726571"
    "7301b86e756d5f736b69707065645f77616974696e675f7265717300ba6e756d5f6b765f66657463"
    "685f726571735f62795f737461676580ac737465705f636f756e74657207ac63757272656e745f77"
    "61766503ae6b765f63616368655f7573616765cb3fd0000000000000b1697465726174696f6e5f64"
    "657461696c73c0b27072656669785f63616368655f737461747388a57265736574c2a87265717565"
    "73747302a771756572696573cca0a46869747360b2707265656d707465645f726571756573747300"
    "b1707265656d707465645f7175657269657300ae707265656d707465645f6869747300ae68697473"
    "5f62795f736f7572636580bc636f6e6e6563746f725f7072656669785f63616368655f7374617473"
    "c0b86b765f63616368655f6576696374696f6e5f6576656e747390b3737065635f6465636f64696e"
    "675f7374617473c0b26b765f636f6e6e6563746f725f7374617473c0b265635f636f6e6e6563746f"
    "725f7374617473c0b577616974696e675f6c6f72615f616461707465727380b572756e6e696e675f"
    "6c6f72615f616461707465727380af6375646167726170685f7374617473c0aa706572665f737461"
    "7473c0cb408cc6483d2b0c51c0c0c0c0c0"
)


def test_prefix_cache_stats_round_trip_as_vllm_writes_them() -> None:
    """The counters travel in vLLM's ``prefix_cache_stats`` map, in vLLM's field order,
    byte for byte as vLLM's encoder writes them, and decode back; an engine without
    lookups writes vLLM's all-zero map."""
    stats = SchedulerStats(
        num_running_reqs=2,
        num_waiting_reqs=1,
        step_counter=7,
        current_wave=3,
        kv_cache_usage=0.25,
        prefix_cache_stats=PrefixCacheStats(requests=2, queries=160, hits=96),
    )
    out = protocol.EngineCoreOutputs(engine_index=1, scheduler_stats=stats)
    frame = protocol.encode_engine_core_outputs(out)
    wire = msgpack.unpackb(frame)[2]["prefix_cache_stats"]
    assert list(wire.items()) == [
        ("reset", False),
        ("requests", 2),
        ("queries", 160),
        ("hits", 96),
        ("preempted_requests", 0),
        ("preempted_queries", 0),
        ("preempted_hits", 0),
        ("hits_by_source", {}),
    ]
    assert protocol.decode_engine_core_outputs(frame) == out
    theirs = protocol.decode_engine_core_outputs(VLLM_OUTPUTS_WITH_PREFIX_STATS)
    assert theirs.scheduler_stats == stats
    same = protocol.EngineCoreOutputs(
        engine_index=1, scheduler_stats=stats, timestamp=theirs.timestamp
    )
    assert protocol.encode_engine_core_outputs(same) == VLLM_OUTPUTS_WITH_PREFIX_STATS
    # A coordinator accepts any value under the key it does not read; so does this decoder.
    for odd in ([1, 2], {"requests": -1}, {"reset": 1}, {"hits": True}):
        wire_map = msgpack.unpackb(frame)
        wire_map[2]["prefix_cache_stats"] = odd
        decoded_odd = protocol.decode_engine_core_outputs(msgpack.packb(wire_map))
        assert decoded_odd.scheduler_stats is not None
        assert decoded_odd.scheduler_stats.prefix_cache_stats == PrefixCacheStats()
    plain = protocol.encode_engine_core_outputs(
        protocol.EngineCoreOutputs(scheduler_stats=SchedulerStats())
    )
    decoded = protocol.decode_engine_core_outputs(plain).scheduler_stats
    assert decoded is not None and decoded.prefix_cache_stats == PrefixCacheStats()


# --------------------------------------------------------------------------- one engine


async def test_engine_prefix_cache_hits_computes_only_uncached_and_stays_bounded(
    tmp_path: Path,
) -> None:
    """A repeated prompt hits all its full blocks but the last token's; only the uncached
    tokens are computed; the cache never holds more than its blocks (LRU)."""
    first, other = prompt(1, 4 * BLOCK), prompt(2, 8 * BLOCK)
    with trio.fail_after(30):
        async with open_coordinator(1) as coordinator:
            async with open_sim_frontend(coordinator, 1) as fe:
                engine = SimEngine(
                    engine_config(0, 1, coordinator, fe, tmp_path, prefix_cache_blocks=8)
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run_sim_engine, engine)
                    await fe.wait_for(lambda f: all(f.engine_ready))

                    async def send(tokens: tuple[int, ...]) -> None:
                        done = fe.completed
                        await fe.submit(max_tokens=2, prompt_token_ids=tokens)
                        await fe.wait_for(lambda f: f.completed == done + 1)

                    await send(first)
                    assert (fe.prefix_queries, fe.prefix_hits) == ([64], [0])
                    await send(first)
                    # 4 full blocks, but the last prompt token is always computed: 3 hit.
                    assert (fe.prefix_queries, fe.prefix_hits) == ([128], [48])
                    assert fe.prefix_requests == [2]
                    # prefill 64 + 1 decode, then prefill 16 + 1 decode
                    assert engine.counters.computed_tokens == 65 + 17
                    await send(other)  # 8 new blocks evict the first prompt's 4
                    cache = engine.prefix_cache
                    assert cache is not None and len(cache.blocks) == 8
                    await send(first)
                    assert fe.prefix_hits == [48]
                    assert engine.counters.prefix_hits == 48
                    nursery.cancel_scope.cancel()


async def _next_batch(sub: AsyncSocket, within: float) -> tuple[int, bytes] | None:
    """The next KV-event message, if one comes within ``within`` seconds."""
    with trio.move_on_after(within):
        return decode_kv_event_frames(await sub.recv_multipart())
    return None


async def test_kv_events_route_a_sessions_next_turn_to_the_rank_that_holds_it(
    tmp_path: Path,
) -> None:
    """Rank 1 publishes vLLM ``EventBatch``es that ``decode_event_batch`` reads; fed to an
    exact-feed chooser, they send the session's next turn to rank 1 (rotation alone
    would pick rank 0)."""
    turn1 = prompt(7, 6 * BLOCK)
    turn2 = turn1 + prompt(8, 3 * BLOCK)
    address = f"ipc://{tmp_path}/kv-events-1"
    batches: list[tuple[int, bytes]] = []
    with trio.fail_after(30):
        async with open_context() as context, open_coordinator(2) as coordinator:
            async with (
                open_sim_frontend(coordinator, 2) as fe,
                open_socket(context, zmq.SUB, connect=address, options={zmq.SUBSCRIBE: b""}) as sub,
            ):
                configs = [
                    engine_config(r, 2, coordinator, fe, tmp_path, prefix_cache_blocks=6)
                    for r in range(2)
                ]
                configs[1] = engine_config(
                    1,
                    2,
                    coordinator,
                    fe,
                    tmp_path,
                    prefix_cache_blocks=6,
                    kv_events_address=address,
                )
                async with trio.open_nursery() as nursery:
                    for config in configs:
                        nursery.start_soon(run_sim_engine, SimEngine(config))
                    await fe.wait_for(lambda f: all(f.engine_ready))
                    # PUB drops what it sends before the subscription reached it: warm up
                    # with throw-away prompts until a batch arrives.
                    warm = 100
                    while not batches:
                        warm += 1
                        await fe.submit(max_tokens=1, engine=1, prompt_token_ids=prompt(warm, 32))
                        got = await _next_batch(sub, 0.5)
                        if got is not None:
                            batches.append(got)
                    await fe.wait_for(lambda f: f.pending == 0)
                    await fe.submit(max_tokens=1, engine=1, prompt_token_ids=turn1)
                    while True:
                        got = await _next_batch(sub, 10.0)
                        assert got is not None
                        batches.append(got)
                        stored = [
                            e
                            for e in decode_event_batch(got[1]).events
                            if isinstance(e, BlockStored)
                        ]
                        if any(e.token_ids[: 6 * BLOCK] == list(turn1) for e in stored):
                            break
                    nursery.cancel_scope.cancel()

    decoded = [decode_event_batch(payload) for _, payload in batches]
    assert all(batch.data_parallel_rank == 1 for batch in decoded)
    seqs = [seq for seq, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    # 6 blocks of cache, 6-block prompt: every warm-up block was evicted on the way.
    assert any(isinstance(e, BlockRemoved) for b in decoded for e in b.events)

    chooser = EngineChooser(
        2, routing="prefix", prefix_routing=PrefixRouting(feed="exact", capacity_blocks=6)
    )
    for seq, payload in batches:
        assert chooser.receive_kv_events(1, seq, payload, now=1.0)
    assert chooser.router is not None
    assert chooser.router.cached_tokens(1, turn2, 1.0) == 6 * BLOCK
    assert chooser.choose([IDLE_LOAD, IDLE_LOAD], turn2, now=1.0) == 1
    assert block_keys(turn2, BLOCK)[:6] == block_keys(turn1, BLOCK)


# --------------------------------------------------------------------------- cluster


async def test_prefix_routing_makes_the_engines_hit_more_than_vllms_choice() -> None:
    """Multi-turn chat on 4 engine processes with prefix caches: the engines themselves
    report more prefix-cache hits under prefix routing (exact feed, KV events over
    ZeroMQ) than under vLLM's score, every request completing in both."""
    hits = {}
    routings: tuple[Routing, ...] = ("vllm", "prefix")
    for routing in routings:
        config = ClusterConfig(
            engines=4,
            load=LoadPlan(requests=150, sessions=16, pause_every=0, gap=(0.0, 0.02)),
            routing=routing,
            prefix_cache_blocks=128,
            step_per_token=2e-6,
            kv_events=routing == "prefix",
        )
        lines: list[str] = []
        with trio.fail_after(60):
            report = await run_cluster(config, log_line=lines.append)
        assert report.ok, (report.to_json(), lines)
        assert len(report.prefix_queries) == 4 and all(report.prefix_queries)
        if routing == "prefix":
            assert report.kv_event_batches > 0
        hits[routing] = sum(report.prefix_hits)
    assert hits["prefix"] > hits["vllm"]
