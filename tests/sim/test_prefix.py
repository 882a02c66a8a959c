"""The lock-step prefix model: deterministic, bounded caches, affinity beats round robin."""

import dataclasses
import itertools

from trio_dpcoord import PrefixRouting
from trio_dpcoord.protocol import EngineLoad
from trio_dpcoord.sim.prefix import RankCache, RankModel, run_fleet
from trio_dpcoord.sim.routing import (
    POLICIES,
    ChooserPolicy,
    FrontEnds,
    RoundRobin,
    make_policy,
    model_loads,
    run_policy,
)
from trio_dpcoord.sim.traces import Request, multi_turn_chat, no_reuse, reuse_bound


def test_cache_never_exceeds_capacity_and_only_uncached_is_computed() -> None:
    rank = RankModel(RankCache(capacity_blocks=3))
    rank.admit(Request(0.0, tuple(range(40)), 1, 0), block_size=16)
    assert len(rank.cache.blocks) <= 3
    rank.admit(Request(0.0, (*range(40), 7), 1, 0), block_size=16)
    assert rank.computed_prompt_tokens == 40 + (41 - 32)
    rank.admit(Request(0.0, tuple(range(500, 600)), 1, 1), block_size=16)
    assert len(rank.cache.blocks) == 3


def test_deterministic_and_affinity_beats_round_robin() -> None:
    trace = multi_turn_chat(1, sessions=16, turns=4)
    counter = itertools.count()

    def round_robin(request: Request, fleet: list[RankModel]) -> int:
        return next(counter) % len(fleet)

    def affinity(request: Request, fleet: list[RankModel]) -> int:
        return request.session_id % len(fleet)

    first = run_fleet(trace, 4, affinity, capacity_blocks=200)
    assert first == run_fleet(trace, 4, affinity, capacity_blocks=200)
    scattered = run_fleet(trace, 4, round_robin, capacity_blocks=200)
    assert first.hit_rate > scattered.hit_rate


def test_prefix_policies_beat_round_robin_and_vllm_on_multi_turn_and_are_deterministic() -> None:
    trace = multi_turn_chat(2, sessions=64, turns=6, rate_per_s=600.0)
    ranks, capacity = 8, 400  # 64 sessions x ~100 blocks: the caches hold about half
    results = {name: run_policy(trace, ranks, name, capacity) for name in POLICIES}
    assert run_policy(trace, ranks, "approximate", capacity) == results["approximate"]
    assert run_policy(trace, ranks, "exact", capacity) == results["exact"]
    for ours in ("approximate", "exact"):
        assert results[ours].hit_rate > results["round-robin"].hit_rate + 0.05
        assert results[ours].hit_rate > results["vllm"].hit_rate + 0.05
    assert results["approximate"].hit_rate <= reuse_bound(trace)


def test_exact_feed_mirrors_the_model_caches_through_vllm_event_batches() -> None:
    trace = multi_turn_chat(5, sessions=32, turns=4, rate_per_s=300.0)
    policy = make_policy("exact", 4, 150)
    assert isinstance(policy, ChooserPolicy)
    seen: list[list[RankModel]] = []
    report = policy.report

    def capture(now: float, fleet: list[RankModel]) -> None:
        if not seen:
            seen.append(fleet)
        report(now, fleet)

    policy.report = capture  # type: ignore[method-assign]
    run_policy(trace, 4, policy, 150)
    router = policy.chooser.router
    assert router is not None
    counters = router.counters
    assert counters.event_batches > 0
    assert counters.rejected_event_batches == 0 and counters.event_gaps == 0
    for rank, model in enumerate(seen[0]):
        assert len(model.cache.blocks) == 150  # evictions happened: BlockRemoved was sent
        assert set(model.cache.blocks) == set(router.indexes[rank].blocks())


def test_model_loads_count_waiting_running_and_blocks_in_use() -> None:
    rank = RankModel(RankCache(capacity_blocks=10))
    rank.admit(Request(0.0, tuple(range(40)), 4, 0), block_size=16)
    rank.admit(Request(0.0, tuple(range(100, 116)), 4, 1), block_size=16)
    rank.queue[0].started = True
    (load,) = model_loads([rank], block_size=16)
    assert (load.waiting, load.running) == (1, 1)
    assert load.kv_cache_usage == 3 / 10  # the running 40 tokens: 3 blocks; waiting: none


def test_round_robin_spreads_requests_evenly() -> None:
    trace = no_reuse(0, requests=64, prompt_tokens=64)
    result = run_policy(trace, 8, RoundRobin(), 100)
    assert result.per_rank_queries == [8 * 64] * 8


def test_prefill_share_and_busiest_work_tally_the_busiest_ranks_tokens() -> None:
    # one rank, one request: 64 prompt tokens in one step (budget 2048), then 2 decode
    # steps of 1 token each (the first token comes with the prefill step's end)
    trace = [Request(0.0, tuple(range(64)), 3, 0)]
    a, b = 0.005, 1e-4
    result = run_fleet(
        trace, 1, lambda r, f: 0, capacity_blocks=10, step_fixed_s=a, step_per_token_s=b
    )
    steps = [a + b * 64, a + b * 1, a + b * 1]
    assert result.prefill_time_share == (b * 64) / sum(steps)
    assert result.busiest_tokens == 64 + 1 + 1
    no_prompt_cost = run_fleet(
        trace, 1, lambda r, f: 0, capacity_blocks=10, step_fixed_s=a, step_per_token_s=0.0
    )
    assert no_prompt_cost.prefill_time_share == 0.0


def test_the_model_policy_keeps_the_callers_prefix_settings_whole() -> None:
    """``make_policy``'s ``prefix``: every field the caller set reaches the chooser's
    router (the reuse weight and rendezvous slack among them), but the model's block
    size and cache size and the policy's own feed."""
    given = PrefixRouting(
        block_size=64,
        capacity_blocks=7,
        reuse_weight=3.0,
        rendezvous_slack=1.0,
        imbalance_abs=100.0,
        imbalance_rel=2.0,
        max_age=50.0,
        provisional_age=2.0,
        feed="exact",
    )
    policy = make_policy("approximate", 4, 150, block_size=16, prefix=given)
    assert isinstance(policy, ChooserPolicy)
    router = policy.chooser.router
    assert router is not None
    assert router.routing == dataclasses.replace(
        given, block_size=16, capacity_blocks=150, feed="approximate"
    )
    # and the weight is the one that decides: with 0, a busier holder loses its prompt
    tokens = tuple(range(64))
    for weight, stays in ((3.0, True), (0.0, False)):
        policy = make_policy(
            "approximate", 2, 150, block_size=16, prefix=PrefixRouting(reuse_weight=weight)
        )
        assert isinstance(policy, ChooserPolicy)
        chooser = policy.chooser
        assert chooser.observe(1, tokens, now=0.0)
        # the report: rank 1 busier by 1 request (64 tokens) than rank 0
        loads = [EngineLoad(0, 0, 0.0), EngineLoad(1, 1, 0.0)]
        assert (chooser.choose(loads, (*tokens, *range(100, 116)), now=0.0) == 1) == stays


def test_two_front_ends_share_the_requests_and_each_hears_of_its_own_finishing() -> None:
    trace = multi_turn_chat(3, sessions=16, turns=3, rate_per_s=200.0)
    for name in ("vllm", "approximate", "exact"):
        policy = make_policy(name, 4, 150, front_ends=2, seed=1)
        assert isinstance(policy, FrontEnds)
        result = run_policy(trace, 4, policy, 150)
        assert result == run_policy(trace, 4, make_policy(name, 4, 150, front_ends=2, seed=1), 150)
        # the run ends at the last finish, before a report would tell of it: a report of
        # empty queues releases every front-end's requests still counted in flight
        assert sum(sum(f.chooser.statistics().inflight) for f in policy.front_ends) > 0
        policy.report(1e9, [RankModel(RankCache(capacity_blocks=150)) for _ in range(4)])
        routed = [front.chooser.statistics() for front in policy.front_ends]
        assert all(sum(stats.inflight) == 0 for stats in routed)
        if name != "vllm":
            decisions = [stats.router.decisions for stats in routed if stats.router is not None]
            assert sum(decisions) == len(trace) and min(decisions) > 0
        if name == "exact":  # both front-ends follow every rank's events
            counters = [stats.router for stats in routed]
            assert all(c is not None and c.event_batches > 0 for c in counters)
