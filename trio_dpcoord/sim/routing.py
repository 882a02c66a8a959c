"""Routing policies for the lock-step prefix model (:func:`~trio_dpcoord.sim.prefix.run_fleet`).

Each policy is what one front-end would do, fed what it would see:

- :class:`RoundRobin`: rank ``k mod N`` for the k-th request, blind to loads and caches;
- :class:`ChooserPolicy` with ``routing="vllm"``: :class:`~trio_dpcoord.EngineChooser`'s
  byte-for-byte vLLM 0.33.0 score, fed once per step the loads the coordinator would
  report (per rank: waiting = queued requests not yet scheduled, running = the others,
  KV usage = blocks the running requests occupy over the cache's size, at most 1) and told of
  finished requests;
- ``routing="prefix"``, approximate feed: the same loads; the router learns from its own
  decisions;
- ``routing="prefix"``, exact feed: the same loads, and every step each rank's cache
  stores and evictions as vLLM ``EventBatch`` msgpack payloads (``BlockStored`` with
  the blocks' tokens and parent hash, ``BlockRemoved``), one batch per rank per step,
  with a per-rank sequence number, through :meth:`EngineChooser.receive_kv_events`.
  Events of requests admitted in a step arrive at the next step's report, as real
  events lag the engine's scheduler.

A policy is a callable ``(request, fleet) -> rank`` with a ``report(now, fleet)`` method;
pass ``policy`` and ``report=policy.report`` (and ``kv_events=policy.wants_kv_events``)
to ``run_fleet``, or use :func:`run_policy`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgpack

from trio_dpcoord import EngineChooser, PrefixRouting, Routing, block_keys
from trio_dpcoord.protocol import EngineLoad
from trio_dpcoord.sim.prefix import DEFAULT_BLOCK_SIZE, FleetResult, RankModel, run_fleet
from trio_dpcoord.sim.traces import Request

logger = logging.getLogger(__name__)

__all__ = [
    "POLICIES",
    "ChooserPolicy",
    "Policy",
    "RoundRobin",
    "make_policy",
    "model_loads",
    "run_policy",
]

_HASH_MASK = (1 << 64) - 1
"""Our block keys are unbounded ints; the stand-in for vLLM's block hash is their low
64 bits (msgpack's widest int). The router indexes by its own hash of the tokens, so
these only have to name blocks consistently."""


def model_loads(fleet: list[RankModel], block_size: int) -> list[EngineLoad]:
    """The loads the coordinator would report for the model's ranks right now."""
    loads = []
    for rank in fleet:
        waiting = running = 0
        blocks = 0
        for job in rank.queue:
            if job.started:
                running += 1
                done = job.request.output_len - job.decode_left
                blocks += -(-(len(job.request.token_ids) + done) // block_size)
            else:
                waiting += 1  # holds no KV blocks until scheduled
        usage = min(1.0, blocks / rank.cache.capacity_blocks)
        loads.append(EngineLoad(waiting=waiting, running=running, kv_cache_usage=usage))
    return loads


class Policy:
    """A front-end's engine choice in the model: see the module docstring."""

    name = "policy"
    wants_kv_events = False

    def __call__(self, request: Request, fleet: list[RankModel]) -> int:
        raise NotImplementedError

    def report(self, now: float, fleet: list[RankModel]) -> None:
        """The coordinator's load report at the start of a step (default: ignored)."""


class RoundRobin(Policy):
    """Rank ``k mod N`` for the k-th request."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def __call__(self, request: Request, fleet: list[RankModel]) -> int:
        rank = self._next % len(fleet)
        self._next += 1
        return rank


class ChooserPolicy(Policy):
    """An :class:`EngineChooser` fed the model's loads, finished requests and (with
    ``exact``) its caches' KV events."""

    def __init__(
        self,
        ranks: int,
        routing: Routing,
        *,
        capacity_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        exact: bool = False,
        prefix: PrefixRouting | None = None,
    ) -> None:
        self.block_size = block_size
        self.exact = exact
        self.wants_kv_events = exact
        if routing == "prefix":
            base = prefix if prefix is not None else PrefixRouting()
            prefix = PrefixRouting(
                block_size=block_size,
                capacity_blocks=capacity_blocks,
                max_age=base.max_age,
                imbalance_abs=base.imbalance_abs,
                imbalance_rel=base.imbalance_rel,
                feed="exact" if exact else "approximate",
            )
            self.name = "ours exact" if exact else "ours approximate"
        else:
            self.name = "vLLM 0.33.0 score"
        self.chooser = EngineChooser(ranks, routing=routing, prefix=prefix)
        self._loads: list[EngineLoad] = []
        self._finished_seen = [0] * ranks
        self._seq = [0] * ranks
        self._blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        """Exact feed: block key -> (parent key, the block's tokens), for BlockStored."""

    def report(self, now: float, fleet: list[RankModel]) -> None:
        chooser = self.chooser
        for index, rank in enumerate(fleet):
            for _ in range(rank.finished - self._finished_seen[index]):
                chooser.finished(index)
            self._finished_seen[index] = rank.finished
        if self.exact:
            for index, rank in enumerate(fleet):
                changes = rank.cache.changes
                if changes:
                    payload = self._event_batch(now, index, changes)
                    changes.clear()
                    chooser.receive_kv_events(index, self._seq[index], payload, now=now)
                    self._seq[index] += 1
        self._loads = model_loads(fleet, self.block_size)

    def _event_batch(self, now: float, rank: int, changes: list[tuple[bool, int]]) -> bytes:
        """vLLM's ``EventBatch`` ``[ts, events, data_parallel_rank]``: runs of chained
        stored blocks as one ``BlockStored`` each, runs of evictions as ``BlockRemoved``."""
        events: list[dict[str, Any]] = []
        run: list[int] = []

        def flush_stored() -> None:
            if run:
                parent = self._blocks[run[0]][0]
                tokens: list[int] = []
                for key in run:
                    tokens.extend(self._blocks[key][1])
                events.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": [key & _HASH_MASK for key in run],
                        "parent_block_hash": None if parent is None else parent & _HASH_MASK,
                        "token_ids": tokens,
                        "block_size": self.block_size,
                        "lora_id": None,
                        "medium": "GPU",
                    }
                )
                run.clear()

        for stored, key in changes:
            if stored:
                if run and self._blocks[key][0] != run[-1]:
                    flush_stored()
                run.append(key)
            else:
                flush_stored()
                if events and events[-1]["type"] == "BlockRemoved":
                    events[-1]["block_hashes"].append(key & _HASH_MASK)
                else:
                    events.append(
                        {
                            "type": "BlockRemoved",
                            "block_hashes": [key & _HASH_MASK],
                            "medium": "GPU",
                        }
                    )
        flush_stored()
        payload: bytes = msgpack.packb([now, events, rank])
        return payload

    def __call__(self, request: Request, fleet: list[RankModel]) -> int:
        tokens = request.token_ids
        if self.exact:
            size = self.block_size
            parent: int | None = None
            for offset, key in enumerate(block_keys(tokens, size)):
                if key not in self._blocks:
                    self._blocks[key] = (parent, tokens[offset * size : (offset + 1) * size])
                parent = key
        return self.chooser.choose(self._loads, tokens, now=request.arrival_s)


POLICIES = ("round-robin", "vllm", "approximate", "exact")
"""The policies :func:`make_policy` builds, in the order the benchmark shows them."""


def make_policy(
    name: str,
    ranks: int,
    capacity_blocks: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    prefix: PrefixRouting | None = None,
) -> Policy:
    """One of :data:`POLICIES`, fresh (policies keep state: one per run)."""
    if name == "round-robin":
        return RoundRobin()
    if name == "vllm":
        return ChooserPolicy(ranks, "vllm", capacity_blocks=capacity_blocks, block_size=block_size)
    if name in ("approximate", "exact"):
        return ChooserPolicy(
            ranks,
            "prefix",
            capacity_blocks=capacity_blocks,
            block_size=block_size,
            exact=name == "exact",
            prefix=prefix,
        )
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}")


def run_policy(
    trace: list[Request],
    ranks: int,
    policy: Policy | str,
    capacity_blocks: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    **model: Any,
) -> FleetResult:
    """``run_fleet`` under ``policy`` (a :class:`Policy` or one of :data:`POLICIES`)."""
    chosen = (
        make_policy(policy, ranks, capacity_blocks, block_size)
        if isinstance(policy, str)
        else policy
    )
    choose: Callable[[Request, list[RankModel]], int] = chosen
    return run_fleet(
        trace,
        ranks,
        choose,
        capacity_blocks,
        block_size=block_size,
        report=chosen.report,
        kv_events=chosen.wants_kv_events,
        **model,
    )
