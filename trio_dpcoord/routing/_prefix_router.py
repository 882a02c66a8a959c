"""The prefix policy's router: it picks a rank from the ranks' prefix indexes.

Its settings and what it returns and counts are in ``_settings.py``, the exact feed's
KV events in ``_kv_feed.py``, the rendezvous of front-ends in ``_rendezvous.py``.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Sequence
from itertools import chain, islice, takewhile

from .._compiled import accelerate
from .._reject_log import RejectLog
from ..protocol import (
    KVEventError,
    decode_event_batch,
)
from ._decision import RouteDecision, RouterStatistics
from ._kv_feed import ExactRank
from ._prefix_index import (
    CHUNK_BLOCKS,
    ChunkedKeys,
    ChunkKeys,
    Feed,
    RankPrefixIndex,
    block_keys,
)
from ._rendezvous import BranchPoints, rendezvous_rank
from ._settings import PrefixRouting
from ._walk import bisect_holders

logger = logging.getLogger(__name__)


def first_from(values: Sequence[float], value: float, start: int) -> int:
    """The first index of ``value`` at or after ``start``, wrapping around."""
    try:
        return values.index(value, start)
    except ValueError:
        return values.index(value)


_FEW_RANKS = 1
"""The walk counts the runs of this many ranks or fewer in their own indexes. With the
keys out of the CPU's caches (a large fleet), a C-level lookup in one rank's index costs
about half a Python-level step in the shared map, which answers for every rank at once
(measured at 256 ranks, 240 blocks matched: a lone rank's run 37 us in its index, 75 us
in the map; two ranks' runs about 75 us either way)."""


class PrefixRouter:
    """Chooses the rank of least cost: its work once it takes the request, plus what
    choosing it throws away.

    A rank's work is its queued work (``queued_work``, in tokens, passed in) plus the
    request's uncached prompt tokens there; what it throws away is ``reuse_weight``
    times the tokens of the deepest prefix known anywhere that it lacks (see
    :class:`PrefixRouting`): a request stays where its history is until that rank's
    queue is busier than another's by more than ``1 + reuse_weight`` times what it
    holds. Ties go to the most cached tokens, then to rotation (a start that advances by
    one per decision). With nothing cached anywhere that is exactly the least loaded
    rank, or ``unshared_choice`` if the caller gives it (with ``rendezvous_slack``, a
    rank all front-ends agree on, near it). When the
    ranks' queued work is imbalanced beyond both thresholds (see
    :class:`PrefixRouting`) the guard chooses the least loaded rank. A pinned rank is
    returned as is. Every routed or pinned prompt is learnt on its rank with
    ``feed="approximate"``; ``feed="exact"`` learns from :meth:`receive_kv_events`
    (and, until they are due, believes its own decisions provisionally).

    With :attr:`defer_store` set, :meth:`choose` returns before the routed prompt is
    learnt, which :meth:`settle` does (a front-end calls it once the request is sent;
    anything that reads or changes the indexes does it first): the same choices and
    indexes, the store (and hashing the prompt past what the walk read) off the
    decision's latency.

    ``indexes`` are the router's own: outside code may store whole prompts in them
    (``store(block_keys(tokens, block_size), now)``, as the vLLM plugin does for pinned
    requests) and nothing else, since with the approximate feed the walk relies on every
    index holding a prompt's blocks from the first one on (it bisects the prompt).
    """

    def __init__(
        self, engine_count: int, routing: PrefixRouting | None = None, *, start: int = 0
    ) -> None:
        if engine_count < 1:
            raise ValueError(f"engine_count must be >= 1, got {engine_count}")
        self.routing = routing if routing is not None else PrefixRouting()
        self.block_size = self.routing.block_size
        self.feed: Feed = self.routing.feed
        self._owners: dict[int, int] = {}
        """Block key -> bit mask of the ranks believed to hold it."""
        self._all = 0
        self._byte_ranks: list[list[tuple[int, ...]]] = []
        self._indexes: list[RankPrefixIndex] = []
        self._pending: tuple[int, Sequence[int], int, float] | None = None
        """The routed prompt :meth:`settle` stores: (rank, keys, blocks held, now)."""
        self.defer_store = False
        """Leave each routed prompt's store to :meth:`settle` (or to whatever comes next);
        the prompt's token list must not change until then (it is read then)."""
        self.share_routes = False
        """Keep each routed prompt (approximate feed) for :meth:`take_routed`, so that a
        front-end can tell the others (:meth:`receive_routed` on theirs)."""
        self._routed: list[tuple[int, Sequence[int]]] = []
        self._exact: list[ExactRank] = []
        self._keys = ChunkKeys(self.block_size, 0)
        self._closed = self.feed == "approximate"
        """Every rank's index is prefix-closed: a rank holding a prompt's block holds the
        blocks before it. True while the indexes learn only the router's own decisions
        (every one a prompt's whole chain, root first, stored deepest first so that a
        parent is always more recent than its child: evictions and expiry take the child
        first); KV events (a chain continued from a reported parent, evictions of the
        engine's choosing) end it. :meth:`_walk` bisects while it holds."""
        self.engine_count = 0
        self.resize(engine_count)
        self._rotation = start % engine_count
        self._next_sweep = -float("inf")
        self._next_belief_sweep = -float("inf")
        self.counters = RouterStatistics()
        self._reject = RejectLog(logger)
        self._branches = BranchPoints()
        """``rendezvous_home``: where the prompts routed part (``_rendezvous.py``)."""

    def resize(self, engine_count: int) -> None:
        """Elastic EP: follow a new engine count (engines beyond it are forgotten)."""
        if engine_count < 1:
            raise ValueError(f"engine_count must be >= 1, got {engine_count}")
        ranks = engine_count
        self.settle()
        for index in self._indexes[ranks:]:
            index.clear()
        del self._indexes[ranks:], self._exact[ranks:]
        routing = self.routing
        for rank in range(len(self._indexes), ranks):
            index = RankPrefixIndex(
                routing.capacity_blocks, routing.max_age, bit=1 << rank, owners=self._owners
            )
            if self._closed:
                index._chain_mode()  # every store a prompt's chain: the order in pieces
            self._indexes.append(index)
            self._exact.append(ExactRank())
        self.engine_count = engine_count
        self._all = (1 << ranks) - 1
        # At most half the chunks the indexes can hold (about 15 bytes a block at most).
        self._keys.max_chunks = max(64, ranks * routing.capacity_blocks // (2 * CHUNK_BLOCKS))
        width = (ranks + 7) // 8
        self._byte_ranks = [
            [tuple(8 * offset + i for i in range(8) if byte >> i & 1) for byte in range(256)]
            for offset in range(width)
        ]
        self._rotation = getattr(self, "_rotation", 0) % ranks

    @property
    def indexes(self) -> list[RankPrefixIndex]:
        """The ranks' indexes (see the class docstring), the last routed prompt stored."""
        self.settle()
        return self._indexes

    @property
    def stored_blocks(self) -> int:
        """Blocks remembered over all ranks (each at most ``capacity_blocks``)."""
        return sum(len(index) for index in self.indexes)

    def cached_tokens(self, engine_index: int, token_ids: Sequence[int], now: float) -> int:
        """The leading tokens of ``token_ids`` believed cached on ``engine_index`` at
        ``now``."""
        keys = block_keys(token_ids, self.block_size)
        return self.indexes[engine_index].matched_blocks(keys, now) * self.block_size

    def choose(
        self,
        token_ids: Sequence[int],
        queued_work: Sequence[float],
        now: float,
        *,
        unshared_choice: int | Callable[[], int] | None = None,
    ) -> RouteDecision:
        """The engine for a prompt of ``token_ids`` given each engine's queued work
        (tokens), with how much was cached there and whether the guard chose.

        ``unshared_choice``: the rank to take when no rank is believed to hold any of the
        prompt (the caller's load balancer's choice, e.g. vLLM's score): with nothing to
        reuse, affinity has nothing to weigh and the load balancer's own count of the
        engines' queues is the better judge (the rendezvous of ``rendezvous_slack``
        aside); a callable is called only then (a rank out of range: ignored)."""
        if len(queued_work) != self.engine_count:
            raise ValueError(
                f"queued_work has {len(queued_work)} engines, expected {self.engine_count}"
            )
        return self._decide(token_ids, queued_work, now, None, unshared_choice)

    def observe(self, engine_index: int, token_ids: Sequence[int], now: float) -> RouteDecision:
        """A request of ``token_ids`` went to ``engine_index`` without :meth:`choose`
        (pinned): counted and learnt there as a choice is; the decision says how much
        was believed cached there."""
        if not 0 <= engine_index < self.engine_count:
            raise ValueError(f"engine index {engine_index} out of range 0..{self.engine_count - 1}")
        return self._decide(token_ids, (), now, engine_index, None)

    def _decide(
        self,
        token_ids: Sequence[int],
        queued_work: Sequence[float],
        now: float,
        pinned: int | None,
        unshared_choice: int | Callable[[], int] | None,
    ) -> RouteDecision:
        self.counters.decisions += 1
        if self._pending is not None:
            self.settle()
        # Closed indexes: the rest of the keys as the walk needs them; else a list (the
        # plain indexes and the walk block by block take one).
        keys: Sequence[int] = (
            self._keys.lookup(token_ids) if self._closed else list(self._keys(token_ids))
        )
        if now >= self._next_sweep:
            for index in self._indexes:
                index.expire(now)
            self._next_sweep = now + self.routing.max_age / 8
        if self.feed == "exact" and self.routing.provisional_age and now >= self._next_belief_sweep:
            # Every rank's due beliefs end, not only the chosen rank's: a rank no
            # request went to since must not keep a belief no event confirmed.
            for index in self._indexes:
                index.expire_provisional(now)
            self._next_belief_sweep = now + self.routing.provisional_age / 8
        groups = self._walk(keys)
        if pinned is not None:
            depth = self._depth_of(groups, pinned)
            decision = RouteDecision(pinned, depth * self.block_size, False)
        else:
            decision = self._pick(groups, keys, len(token_ids), queued_work, unshared_choice)
        if self.routing.rendezvous_home and keys:
            self._branches.learn(keys, self.engine_count * self.routing.capacity_blocks)
        self.counters.prompt_tokens += len(token_ids)
        self.counters.cached_tokens += decision.cached_tokens
        if keys:
            if self.feed == "approximate":
                # learnt now, or by :meth:`settle` (``defer_store``): before anything reads
                # or changes the indexes again
                held = decision.cached_tokens // self.block_size
                self._pending = (decision.engine_index, keys, held, now)
                if not self.defer_store:
                    self.settle()
            elif self.routing.provisional_age > 0:
                # the exact feed's belief in a prompt just routed, until events are due
                until = now + min(self.routing.provisional_age, self.routing.max_age)
                self._indexes[decision.engine_index].store_provisionally(keys, now, until)
        return decision

    def settle(self) -> None:
        """Learn the last routed prompt on its rank (approximate feed), if not yet done.

        With :attr:`defer_store` set, :meth:`choose` returns its choice before storing the
        prompt (the store, and hashing the prompt's blocks past what the walk read, are
        most of a decision's work): call this once the request is on its way, off the
        decision's latency. It is done anyway before anything reads or changes the
        indexes (the next decision, KV events, :attr:`indexes`, the views), so the
        choices and the indexes are the same either way."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        rank, keys, held, now = pending
        if isinstance(keys, ChunkedKeys):
            keys.complete()
        index = self._indexes[rank]
        if index._held is not None:  # chain mode: the held prefix is the walk's
            index._store_chain(keys, held, now)
        else:
            index.store(keys, now)
        if self.share_routes:
            self._routed.append((rank, list(keys)))

    def take_routed(self) -> list[tuple[int, Sequence[int]]]:
        """The prompts routed since the last call, as (rank, block keys), with
        :attr:`share_routes` set (approximate feed; pinned ones included): what this
        front-end tells the others, each of which calls :meth:`receive_routed`."""
        self.settle()
        routed, self._routed = self._routed, []
        return routed

    def receive_routed(self, engine_index: int, keys: Sequence[int], now: float) -> bool:
        """Another front-end routed a prompt of these block keys (:func:`block_keys` of
        this router's block size, root first) to ``engine_index``: believed cached there, as this
        router's own choices are (approximate feed; ignored with the exact one, whose
        events are every front-end's already). False, and nothing changed, for a rank out
        of range or with the exact feed."""
        if self.feed != "approximate" or not 0 <= engine_index < self.engine_count:
            return False
        self.settle()
        if keys:
            self._indexes[engine_index].store(keys, now)
        return True

    def _home(
        self,
        groups: list[tuple[int, int]],
        keys: Sequence[int],
        prompt_len: int,
        queued: Sequence[float],
    ) -> RouteDecision:
        """``rendezvous_home``: of the ranks whose cost is within ``rendezvous_slack``
        prompts of the best and that hold the prompt up to its last branch point (all
        ranks if none does), the one rendezvous hashing of the prompt's first block past
        that point ranks first; the least cost if none is within."""
        ranks, block = self.engine_count, self.block_size
        depth_of = [0] * ranks
        for depth, mask in groups:
            for rank in self._members(mask):
                depth_of[rank] = depth
        most = max(depth_of) * block
        weight = self.routing.reuse_weight
        costs = [
            queued[r] + prompt_len - (1 + weight) * depth_of[r] * block + weight * most
            for r in range(ranks)
        ]
        best = min(costs)
        within = best + self.routing.rendezvous_slack * prompt_len
        point = self._branches.point(keys)
        # the ranks holding the prompt up to its branch point (a shared document), if any
        eligible = [r for r in range(ranks) if depth_of[r] >= point] or range(ranks)
        key = keys[min(point, len(keys) - 1)]
        winner = rendezvous_rank(key, (r for r in eligible if costs[r] <= within))
        if winner is None:
            winner = costs.index(best)
        return RouteDecision(winner, depth_of[winner] * block, False)

    def _walk(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """The ranks holding a prefix of ``keys``, as (leading blocks held, bit mask of
        the ranks holding exactly that many), deepest last; ranks holding none omitted."""
        if self._closed:
            return self._bisect(keys)
        return self._walk_blocks(keys)

    def _bisect(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """:meth:`_walk` over prefix-closed indexes (:attr:`_closed`): the ranks holding
        block ``k`` then hold every block before it, so the holders' mask can only shrink
        along the prompt, and a stretch whose two ends have the same holders has them
        throughout. Bisecting the stretches whose ends differ finds every depth where
        ranks drop out in about (depths where some do) x log2(blocks) lookups instead of
        one a block: 2 for a prompt held whole by the same ranks.

        Keys from :meth:`ChunkKeys.lookup` may be known only for the prompt's leading
        chunks: while some rank holding the last known block holds the next one (its key
        alone, :meth:`ChunkedKeys.probe`), the next chunk is keyed
        (:meth:`ChunkedKeys.extend`); then the walk ends, and the rest of the prompt is
        hashed only when it is stored (a follow-up turn: its new tokens past the chunk
        where it leaves its history; no reuse: all but one block)."""
        count = len(keys)
        if not count:
            return []
        owners = self._owners.get
        everyone = self._all
        # keys[k] is chunks[k // span][k % span], without a Python-level call per key
        chunks: Sequence[Sequence[int]] = [keys]
        span = count
        if isinstance(keys, ChunkedKeys):
            chunks, span = keys.chunks, CHUNK_BLOCKS  # (the list extend() appends to)
            if keys.known < count:
                if not keys.known:
                    if not owners(keys.probe(), 0) & everyone:
                        return []
                    keys.extend()
                first = owners(chunks[0][0], 0) & everyone
                if not first:
                    return []
                while True:  # a chunk more while ranks hold the block past the known ones
                    known = keys.known
                    end = known - 1
                    last = owners(chunks[end // span][end % span], 0) & first
                    if known == count or not last or not owners(keys.probe(), 0) & last:
                        return bisect_holders(self._owners, chunks, span, known, first, last)
                    keys.extend()
        first = owners(chunks[0][0], 0) & everyone
        if not first:
            return []
        end = count - 1
        last = owners(chunks[end // span][end % span], 0) & first
        return bisect_holders(self._owners, chunks, span, count, first, last)

    def _walk_blocks(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """:meth:`_walk` block by block, from the first block to the first no rank holds.

        Once one rank is left (:data:`_FEW_RANKS`), the rest of its run is counted in its
        own index (a small dict, C-level) rather than key by key in the shared map of
        every rank's blocks.
        """
        owners = self._owners.get
        alive = self._all
        groups: list[tuple[int, int]] = []
        depth = 0
        for key in keys:
            mask = owners(key, 0) & alive
            if mask != alive:
                if depth:
                    groups.append((depth, alive ^ mask))
                alive = mask
                if not alive:
                    return groups
                if alive.bit_count() <= _FEW_RANKS:
                    return self._runs(groups, keys, depth + 1, alive)
            depth += 1
        if depth:
            groups.append((depth, alive))
        return groups

    def _runs(
        self, groups: list[tuple[int, int]], keys: Sequence[int], held: int, ranks: int
    ) -> list[tuple[int, int]]:
        """``groups`` and then the ranks of the mask ``ranks`` by their runs in their own
        indexes (each holds the first ``held`` of ``keys``)."""
        rest = keys[held:]
        masks: dict[int, int] = {}
        for rank in self._members(ranks):
            index = self._indexes[rank]
            contains = index._seen.__contains__ if index._held is None else index.__contains__
            depth = held + len(list(takewhile(contains, rest)))
            masks[depth] = masks.get(depth, 0) | 1 << rank
        groups.extend(sorted(masks.items()))
        return groups

    def _depth_of(self, groups: list[tuple[int, int]], rank: int) -> int:
        bit = 1 << rank
        for depth, mask in groups:
            if mask & bit:
                return depth
        return 0

    def _members(self, mask: int) -> list[int]:
        """The ranks of ``mask``, ascending (a byte at a time, through a table)."""
        if not mask & (mask - 1):
            return [mask.bit_length() - 1]
        table = self._byte_ranks
        members: list[int] = []
        for offset, byte in enumerate(mask.to_bytes(len(table), "little")):
            if byte:
                members.extend(table[offset][byte])
        return members

    def _pick(
        self,
        groups: list[tuple[int, int]],
        keys: Sequence[int],
        prompt_len: int,
        queued: Sequence[float],
        unshared_choice: int | Callable[[], int] | None = None,
    ) -> RouteDecision:
        ranks = self.engine_count
        start = self._rotation
        self._rotation = (start + 1) % ranks
        block = self.block_size
        routing = self.routing
        if not groups and unshared_choice is not None and not (routing.rendezvous_slack and keys):
            rank = unshared_choice() if callable(unshared_choice) else unshared_choice
            if 0 <= rank < ranks:
                return RouteDecision(rank, 0, False)
        low, high = min(queued), max(queued)
        least = first_from(queued, low, start)
        least_depth = self._depth_of(groups, least)
        if ranks == 1:
            return RouteDecision(0, least_depth * block, False)
        if high - low > routing.imbalance_abs and high > routing.imbalance_rel * max(low, 1.0):
            self.counters.guard_fallbacks += 1
            return RouteDecision(least, least_depth * block, True)
        # A rank holding no more than the least loaded one cannot beat it; of the ranks
        # holding the same deeper prefix, only the least loaded one (rotation on ties)
        # can: the candidates are one per depth.
        candidates = [(least, least_depth)]
        for depth, mask in groups:
            if depth > least_depth:
                members = self._members(mask)
                if len(members) == 1:
                    candidates.append((members[0], depth))
                    continue
                value = min(map(queued.__getitem__, members))
                cut = bisect_left(members, start)
                for rank in chain(islice(members, cut, None), islice(members, cut)):
                    if queued[rank] == value:
                        candidates.append((rank, depth))
                        break
        deepest, holders = groups[-1] if groups else (0, 0)
        if routing.rendezvous_home and routing.rendezvous_slack and keys:
            return self._home(groups, keys, prompt_len, queued)
        shared = not holders or holders & (holders - 1)  # no single rank holds the most
        if len(candidates) == 1 and not (shared and routing.rendezvous_slack and keys):
            return RouteDecision(least, least_depth * block, False)
        # The cost of a rank, in tokens: its own work once it takes the request (its
        # queue, then the prompt's tokens it lacks) plus, weighted, the tokens of the
        # deepest known prefix it lacks: what choosing it throws away (the fleet computes
        # them again, and later requests of the prefix lose the rank that held it).
        most = deepest * block
        weight = routing.reuse_weight
        best: tuple[float, int, int] | None = None
        chosen, chosen_depth = least, least_depth
        for rank, depth in candidates:
            cached = depth * block
            cost = queued[rank] + prompt_len - cached + weight * (most - cached)
            candidate = (cost, -cached, (rank - start) % ranks)
            if best is None or candidate < best:
                best, chosen, chosen_depth = candidate, rank, depth
        if shared and routing.rendezvous_slack and keys and best is not None:
            chosen, chosen_depth = self._rendezvous(
                keys, deepest, holders, prompt_len, queued, best[0], (chosen, chosen_depth)
            )
        return RouteDecision(chosen, chosen_depth * block, False)

    def _rendezvous(
        self,
        keys: Sequence[int],
        deepest: int,
        holders: int,
        prompt_len: int,
        queued: Sequence[float],
        best_cost: float,
        best: tuple[int, int],
    ) -> tuple[int, int]:
        """No single rank holds more of the prompt than every other (``holders``, the
        ranks holding ``deepest`` blocks, are several, or none holds any): of those
        ranks whose cost is within ``rendezvous_slack`` prompts of the best, the one
        rendezvous hashing of the prompt's first block past that common prefix ranks
        first. Front-ends that each know only their own choices thus agree on where a
        new conversation goes (its first turn's block past a shared system prompt is
        its later turns' too) as long as their loads roughly agree; else ``best``."""
        key = keys[min(deepest, len(keys) - 1)]
        within = best_cost + self.routing.rendezvous_slack * prompt_len
        uncached = prompt_len - deepest * self.block_size
        members = self._members(holders) if holders else range(self.engine_count)
        winner = rendezvous_rank(key, (r for r in members if queued[r] + uncached <= within))
        if winner is None:
            return best
        return (winner, deepest)

    def receive_kv_events(self, engine_index: int, seq: int, payload: bytes, now: float) -> bool:
        """Apply one engine's KV-event batch (``seq`` from the PUB frame); False if rejected.

        A sequence gap or step back means lost or reordered batches: the rank's exact
        knowledge is forgotten, since what it would now claim could be stale. Rejected
        batches are logged at WARNING (rate-limited) and counted; nothing else changes.
        """
        rank = engine_index
        if not 0 <= rank < self.engine_count:
            self.counters.rejected_event_batches += 1
            self._reject("KV events", f"from unknown rank {rank}", now)
            return False
        try:
            batch = decode_event_batch(payload)
        except KVEventError as exc:
            self.counters.rejected_event_batches += 1
            self._reject("KV events", f"batch from rank {rank}: {exc}", now)
            return False
        self.settle()
        state = self._exact[rank]
        index = self._indexes[rank]
        if state.last_seq is not None and seq != state.last_seq + 1:
            self.counters.event_gaps += 1
            logger.warning(
                "KV events of rank %d: seq %d after %d, forgetting", rank, seq, state.last_seq
            )
            index.clear()
            state.vllm_to_ours.clear()
        state.last_seq = seq
        self.counters.event_batches += 1
        if self._closed:  # chains continued from a parent, evictions in any order
            self._closed = False
            for each in self._indexes:
                each._materialize()
        state.apply(batch.events, index, self.block_size, now)
        return True

    # --- read-only views (tests, diagnostics): copies, never the router's own state --------

    def block_owners(self) -> dict[int, int]:
        """Block key -> bit mask of the ranks believed to hold it (bit ``r``: rank ``r``),
        every rank's index together. A copy."""
        self.settle()
        return dict(self._owners)

    def prefix_groups(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """Which ranks hold how much of ``keys`` (a prompt's :func:`block_keys`): one
        ``(leading blocks held, bit mask of the ranks holding exactly that many)`` per
        depth, deepest last, ranks holding none omitted. What one decision weighs; it
        changes nothing (not even the indexes' recency or ages)."""
        self.settle()
        return self._walk(keys)


accelerate(globals(), "trio_dpcoord.routing._prefix_router_kernel")  # the compiled twin, if built
