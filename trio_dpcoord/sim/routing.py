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
  with a per-rank sequence number (:class:`~trio_dpcoord.sim.kv_events.EventBatchEncoder`,
  as the simulated engines publish them), through :meth:`EngineChooser.receive_kv_events`.
  Events of requests admitted in a step arrive at the next step's report, as real
  events lag the engine's scheduler.

A policy is a callable ``(request, fleet) -> rank`` with a ``report(now, fleet)`` method;
pass ``policy`` and ``report=policy.report`` (and ``kv_events=policy.wants_kv_events``)
to ``run_fleet``, or use :func:`run_policy`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from typing import Any

from trio_dpcoord import EngineChooser, PrefixRouting, Routing
from trio_dpcoord.protocol import EngineLoad
from trio_dpcoord.sim.kv_events import EventBatchEncoder
from trio_dpcoord.sim.prefix import DEFAULT_BLOCK_SIZE, FleetResult, RankModel, run_fleet
from trio_dpcoord.sim.traces import Request

logger = logging.getLogger(__name__)

__all__ = [
    "POLICIES",
    "ChooserPolicy",
    "FrontEnds",
    "Policy",
    "RoundRobin",
    "make_policy",
    "model_loads",
    "run_policy",
]


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
        client_index: int = 0,
        client_count: int = 1,
    ) -> None:
        self.block_size = block_size
        self.exact = exact
        self.wants_kv_events = exact
        if routing == "prefix":
            # the caller's settings whole (reuse weight, rendezvous slack, guard, ages),
            # but the model's block size and cache, and the feed this policy is for
            prefix = dataclasses.replace(
                prefix if prefix is not None else PrefixRouting(),
                block_size=block_size,
                capacity_blocks=capacity_blocks,
                feed="exact" if exact else "approximate",
            )
            self.name = "ours exact" if exact else "ours approximate"
        else:
            self.name = "vLLM 0.33.0 score"
        self.chooser = EngineChooser(
            ranks,
            client_index=client_index,
            client_count=client_count,
            routing=routing,
            prefix_routing=prefix,
        )
        self._loads: list[EngineLoad] = []
        self._finished_seen = [0] * ranks
        self._seq = [0] * ranks
        self._events = EventBatchEncoder(block_size)
        """Exact feed: every prompt's blocks, for the caches' BlockStored events."""

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
                    payload = self._events.encode(now, index, changes)
                    changes.clear()
                    chooser.receive_kv_events(index, self._seq[index], payload, now=now)
                    self._seq[index] += 1
        self._loads = model_loads(fleet, self.block_size)

    def __call__(self, request: Request, fleet: list[RankModel]) -> int:
        tokens = request.token_ids
        if self.exact:
            self._events.remember(tokens)
        return self.chooser.choose(self._loads, tokens, now=request.arrival_s)


class FrontEnds(Policy):
    """Several front-ends (vLLM's ``--api-server-count``), each an :class:`EngineChooser`
    with its own index (``client_index`` of ``client_count``), all fed the same loads and
    (exact feed) every rank's KV events; each request goes to one front-end drawn at
    random (seeded), as the kernel spreads connections over API servers sharing a port,
    and each front-end hears only of its own requests finishing. With ``share_routes``
    (approximate feed) every front-end tells the others each prompt it routes at once
    (:meth:`~trio_dpcoord.routing.PrefixRouter.take_routed` /
    :meth:`~trio_dpcoord.routing.PrefixRouter.receive_routed`), as the vLLM plugin's
    API servers do."""

    def __init__(
        self, front_ends: list[ChooserPolicy], seed: int = 0, *, share_routes: bool = False
    ) -> None:
        if not front_ends:
            raise ValueError("need at least one front-end")
        self.front_ends = front_ends
        self._routers = [
            router
            for router in (front.chooser.router for front in front_ends)
            if share_routes and router is not None and router.feed == "approximate"
        ]
        for router in self._routers:
            router.share_routes = True
        self.wants_kv_events = front_ends[0].exact
        self.name = f"{front_ends[0].name} x{len(front_ends)}"
        self._rng = random.Random(seed)
        self._outstanding: list[dict[int, int]] = [{} for _ in front_ends]
        """Per front-end: id of a request it routed -> its rank, until it finishes."""
        self._seq: list[int] = []

    def report(self, now: float, fleet: list[RankModel]) -> None:
        queued = [{id(job.request) for job in rank.queue} for rank in fleet]
        for front, outstanding in zip(self.front_ends, self._outstanding, strict=True):
            for key, where in list(outstanding.items()):
                if key not in queued[where]:
                    del outstanding[key]
                    front.chooser.finished(where)
        lead = self.front_ends[0]
        if lead.exact:
            if not self._seq:
                self._seq = [0] * len(fleet)
            for index, rank in enumerate(fleet):
                changes = rank.cache.changes
                if changes:
                    payload = lead._events.encode(now, index, changes)
                    changes.clear()
                    for front in self.front_ends:
                        front.chooser.receive_kv_events(index, self._seq[index], payload, now=now)
                    self._seq[index] += 1
        loads = model_loads(fleet, lead.block_size)
        for front in self.front_ends:
            front._loads = loads

    def __call__(self, request: Request, fleet: list[RankModel]) -> int:
        number = self._rng.randrange(len(self.front_ends))
        front = self.front_ends[number]
        if front.exact:
            self.front_ends[0]._events.remember(request.token_ids)
        rank = front.chooser.choose(front._loads, request.token_ids, now=request.arrival_s)
        self._outstanding[number][id(request)] = rank
        if self._routers:
            sender = self._routers[number]
            for routed_rank, keys in sender.take_routed():
                for router in self._routers:
                    if router is not sender:
                        router.receive_routed(routed_rank, keys, request.arrival_s)
        return rank


POLICIES = ("round-robin", "vllm", "approximate", "exact")
"""The policies :func:`make_policy` builds, in the order the benchmark shows them."""


def make_policy(
    name: str,
    ranks: int,
    capacity_blocks: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    prefix: PrefixRouting | None = None,
    front_ends: int = 1,
    seed: int = 0,
    share_routes: bool = False,
) -> Policy:
    """One of :data:`POLICIES`, fresh (policies keep state: one per run). With
    ``front_ends`` > 1 (not round-robin), that many :class:`FrontEnds` share the
    requests (drawn with ``seed``), telling each other their routes with
    ``share_routes``."""
    if name == "round-robin":
        return RoundRobin()
    if name in ("vllm", "approximate", "exact"):
        fronts = [
            ChooserPolicy(
                ranks,
                "vllm" if name == "vllm" else "prefix",
                capacity_blocks=capacity_blocks,
                block_size=block_size,
                exact=name == "exact",
                prefix=prefix if name != "vllm" else None,
                client_index=index,
                client_count=front_ends,
            )
            for index in range(front_ends)
        ]
        if front_ends == 1:
            return fronts[0]
        return FrontEnds(fronts, seed, share_routes=share_routes)
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
