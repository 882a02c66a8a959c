"""A fast deterministic model of lock-step DP ranks with prefix caches (plain objects, no I/O).

Each rank keeps an LRU prefix cache of ``capacity_blocks`` blocks and computes only
the uncached prompt tokens, in chunks of at most ``token_budget`` tokens per step
(chunked prefill, decodes first).  All ranks step together; a step lasts as long as
the busiest rank's: ``step_s = a + b * tokens``.  This is a model: ``token_budget``
is of the order of vLLM's ``max_num_batched_tokens`` defaults (2048/8192), and the
linear per-token cost is an assumed order of magnitude, not a measurement.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from trio_dpcoord import PrefixRouting
from trio_dpcoord.routing import block_keys
from trio_dpcoord.sim.traces import Request

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = PrefixRouting().block_size
"""The router's default block size (vLLM's default ``--block-size``, 16)."""
STEP_FIXED_S = 0.005
"""The model's fixed cost of a lock-step step (``a``): the order of a decode step's
weight reads and launch overhead for an 8B-class model on one GPU; assumed."""
STEP_PER_TOKEN_S = 2e-5
"""The model's cost per token processed in a step (``b``): 50k tokens/s of prefill, the
order of an 8B-class model on one data-centre GPU; assumed. The routing benchmark sweeps
it (``benchmarks/sections/routing.py``, ``PREFILL_SWEEP_PER_TOKEN_S``)."""


@dataclass
class RankCache:
    """An LRU set of block keys that never holds more than ``capacity_blocks``."""

    capacity_blocks: int
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)
    changes: list[tuple[bool, int]] | None = None
    """When a list: every newly stored key as ``(True, key)`` and every evicted one as
    ``(False, key)``, in order (what an engine's KV events report)."""

    def match(self, keys: list[int]) -> int:
        """Number of leading keys cached (touching them)."""
        matched = 0
        for key in keys:
            if key not in self.blocks:
                break
            self.blocks.move_to_end(key)
            matched += 1
        return matched

    def store(self, keys: list[int]) -> None:
        """Cache one prompt's blocks (root first): touch those already cached, evict the
        least recently used to make room, then store the new ones (at most the whole
        cache, the leading ones). vLLM frees blocks (``BlockRemoved``) before it caches
        new contents in them (one ``BlockStored`` per request), and so does the log."""
        blocks, changes = self.blocks, self.changes
        new = [key for key in keys if key not in blocks]
        for key in keys:
            if key in blocks:
                blocks.move_to_end(key)
        del new[self.capacity_blocks :]
        for _ in range(len(blocks) + len(new) - self.capacity_blocks):
            evicted = blocks.popitem(last=False)[0]
            if changes is not None:
                changes.append((False, evicted))
        for key in new:
            blocks[key] = None
            if changes is not None:
                changes.append((True, key))


@dataclass
class _Job:
    request: Request
    prefill_left: int
    decode_left: int
    first_token_s: float | None = None
    started: bool = False
    """Scheduled at least once: vLLM counts it as running, before that as waiting."""


@dataclass
class RankModel:
    """One rank: its cache, its queue, and vLLM-style prefix-cache query/hit counters."""

    cache: RankCache
    queue: list[_Job] = field(default_factory=list)
    queries: int = 0
    hits: int = 0
    computed_prompt_tokens: int = 0
    finished: int = 0
    """Requests completed so far (what a front-end learns as ``finished_requests``)."""

    @property
    def waiting(self) -> int:
        return sum(1 for job in self.queue if not job.started)

    @property
    def running(self) -> int:
        return sum(1 for job in self.queue if job.started)

    def admit(self, request: Request, block_size: int) -> None:
        keys = block_keys(request.token_ids, block_size)
        usable = len(keys) if len(request.token_ids) % block_size else max(len(keys) - 1, 0)
        hit_tokens = self.cache.match(keys[:usable]) * block_size
        self.queries += len(request.token_ids)
        self.hits += hit_tokens
        self.cache.store(keys)
        uncached = len(request.token_ids) - hit_tokens
        self.computed_prompt_tokens += uncached
        self.queue.append(_Job(request, uncached, request.output_len))

    def schedule_step(self, token_budget: int) -> tuple[int, int]:
        """Spend one step's ``token_budget`` (decodes first, then prompt chunks in queue
        order, as vLLM's chunked prefill): the tokens computed, and how many of them are
        prompt tokens."""
        budget = token_budget
        done = 0
        for job in self.queue:
            if job.prefill_left == 0 and budget > 0:
                budget -= 1
                done += 1
        decodes = done
        for job in self.queue:
            if job.prefill_left > 0 and budget > 0:
                job.started = True
                chunk = min(job.prefill_left, budget)
                job.prefill_left -= chunk
                budget -= chunk
                done += chunk
        return done, done - decodes

    def finish_step(self, now: float, ttft: list[float]) -> int:
        """End the step at ``now``: every job past its prompt emits one token (its first
        one's latency appended to ``ttft``), finished jobs leave the queue. Returns the
        tokens emitted."""
        emitted = 0
        for job in self.queue:
            if job.prefill_left == 0:
                if job.first_token_s is None:
                    job.first_token_s = now
                    ttft.append(now - job.request.arrival_s)
                job.decode_left -= 1
                emitted += 1
        before = len(self.queue)
        self.queue = [job for job in self.queue if job.decode_left > 0]
        self.finished += before - len(self.queue)
        return emitted


@dataclass(frozen=True)
class FleetResult:
    hit_rate: float
    throughput_tokens_per_s: float
    ttft_s: list[float]
    busiest_over_mean: float
    per_rank_queries: list[int]
    per_rank_hits: list[int]
    busiest_tokens: float = 0.0
    """The busiest rank's tokens, summed over the steps: what the lock-step time grows
    with (``busiest_over_mean`` also rises when the other ranks compute less)."""
    prefill_time_share: float = 0.0
    """The share of the run's step time spent on prompt tokens: per step, the busiest
    rank's prefill tokens times ``step_per_token_s``, over the step time."""


Chooser = Callable[[Request, list[RankModel]], int]
Reporter = Callable[[float, list[RankModel]], None]
"""Called once per step, before that step's arrivals are routed: the load report."""


def run_fleet(
    trace: list[Request],
    ranks: int,
    choose: Chooser,
    capacity_blocks: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    token_budget: int = 2048,
    step_fixed_s: float = STEP_FIXED_S,
    step_per_token_s: float = STEP_PER_TOKEN_S,
    report: Reporter | None = None,
    kv_events: bool = False,
) -> FleetResult:
    """Run ``trace`` to completion on ``ranks`` lock-step ranks; deterministic for a trace.

    ``report``, if given, sees the fleet at the start of every step (the coordinator's
    load report); ``kv_events`` makes every rank log its cache's stores and evictions
    (:attr:`RankCache.changes`) for an exact-feed policy to turn into KV events.
    """
    fleet = [RankModel(RankCache(capacity_blocks)) for _ in range(ranks)]
    if kv_events:
        for model in fleet:
            model.cache.changes = []
    pending = sorted(trace, key=lambda r: r.arrival_s)
    tally = _RunTally()
    index = 0
    while index < len(pending) or any(rank.queue for rank in fleet):
        if report is not None:
            report(tally.now, fleet)
        while index < len(pending) and pending[index].arrival_s <= tally.now:
            request = pending[index]
            fleet[choose(request, fleet)].admit(request, block_size)
            index += 1
        if not any(rank.queue for rank in fleet):
            tally.now = pending[index].arrival_s
            continue
        tally.step(fleet, token_budget, step_fixed_s, step_per_token_s)
    return tally.result(fleet)


@dataclass
class _RunTally:
    """One :func:`run_fleet` run's clock and its sums over the steps so far."""

    now: float = 0.0
    ttft: list[float] = field(default_factory=list)
    busiest_sum: float = 0.0
    mean_sum: float = 0.0
    prefill_s: float = 0.0
    busy_s: float = 0.0
    output_tokens: int = 0

    def step(
        self,
        fleet: list[RankModel],
        token_budget: int,
        step_fixed_s: float,
        step_per_token_s: float,
    ) -> None:
        """One lock-step step of every rank: it lasts as long as the busiest rank's work."""
        work = []
        prefill_work = []
        for rank in fleet:
            done, prefill = rank.schedule_step(token_budget)
            prefill_work.append(prefill)
            work.append(done)
        busiest = max(work)
        step = step_fixed_s + step_per_token_s * busiest
        self.busy_s += step
        self.prefill_s += step_per_token_s * prefill_work[work.index(busiest)]
        self.now += step
        self.busiest_sum += busiest
        self.mean_sum += sum(work) / len(fleet)
        for rank in fleet:
            self.output_tokens += rank.finish_step(self.now, self.ttft)

    def result(self, fleet: list[RankModel]) -> FleetResult:
        """The run's figures, once every request of the trace has finished."""
        queries = sum(rank.queries for rank in fleet)
        return FleetResult(
            hit_rate=sum(rank.hits for rank in fleet) / queries if queries else 0.0,
            throughput_tokens_per_s=self.output_tokens / self.now if self.now else 0.0,
            ttft_s=self.ttft,
            busiest_over_mean=self.busiest_sum / self.mean_sum if self.mean_sum else 1.0,
            per_rank_queries=[rank.queries for rank in fleet],
            per_rank_hits=[rank.hits for rank in fleet],
            busiest_tokens=self.busiest_sum,
            prefill_time_share=self.prefill_s / self.busy_s if self.busy_s else 0.0,
        )
