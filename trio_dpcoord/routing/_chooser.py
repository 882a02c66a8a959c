"""Engine choice for front-ends: vLLM 0.33.0's ``DPLBAsyncMPClient`` score (§7.2), or the
prefix-cache-aware policy of :mod:`._prefix_router` (``routing="prefix"``).

One chooser serves both modes: an embedded front-end feeds it the coordinator's live
loads, a front-end of the standalone process feeds it the latest publish.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from math import isfinite
from typing import Literal

from .._compiled import accelerate
from ..protocol import IDLE_LOAD, EngineLoad
from ._decision import RouterStatistics
from ._prefix_router import PrefixRouter, first_from
from ._score import vllm_score
from ._settings import PrefixRouting

__all__ = ["ROUTINGS", "ChooserStatistics", "EngineChooser", "Routing"]

Routing = Literal["vllm", "prefix"]
"""How a front-end chooses the engine: ``"vllm"``, vLLM 0.33.0's score (the default), or
``"prefix"``, prefix-cache affinity weighed against the busiest rank's work."""

ROUTINGS: tuple[Routing, ...] = ("vllm", "prefix")

_UNIT_SMOOTHING = 1 / 64
"""Weight of each routed request in the running mean of uncached prompt tokens."""


def check_routing(routing: str) -> Routing:
    """``routing`` as a :data:`Routing`; ``ValueError`` naming the choices otherwise."""
    for known in ROUTINGS:
        if routing == known:
            return known
    raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}; got {routing!r}")


@dataclass(frozen=True, slots=True)
class ChooserStatistics:
    """What :meth:`EngineChooser.statistics` reads: a copy, unchanged by later choices."""

    inflight: tuple[int, ...]
    """This chooser's unfinished requests per engine (chosen, or observed and counted)."""
    router: RouterStatistics | None
    """The prefix policy's counters (a copy), or None with vLLM's routing."""


class EngineChooser:
    """Chooses the engine for each new request and tracks this front-end's in-flight counts.

    ``routing="vllm"`` (the default) is vLLM 0.33.0's choice, byte for byte: scans
    engines in rotated order from a start that advances by one per choice, takes the
    first strictly lowest score, then counts the request as waiting on that engine
    until the next load report replaces the table. With no load reports yet, the
    in-flight counts alone spread requests over all engines instead of piling them on
    rank 0. Prompt token ids and clock readings are ignored. Each engine's score is
    kept, recomputed only where a report, a choice or a finished request changes it,
    so that a choice costs a C-level ``min`` and ``index`` over the scores, not a
    Python-level score per engine (at 256 engines, 100 us a choice).

    ``routing="prefix"`` hands the choice to a :class:`~trio_dpcoord.routing.PrefixRouter`
    (settings: ``prefix_routing``, a :class:`PrefixRouting`). Each rank's queued work, in
    tokens, is its latest report's queue (vLLM's score: waiting + running, or
    ``client_count`` times this chooser's requests in flight there if more, plus the
    KV-pressure penalty) times the mean uncached prompt of the requests this chooser
    routed, plus ``client_count`` times the uncached tokens this chooser sent there since
    that report (shrinking as they finish): where a prefix is cached, what a request
    costs is what the engine must still compute of it. Where no rank holds any of the
    prompt, the choice is vLLM's, engine for engine (its score, kept as with
    ``routing="vllm"``, and its rotation): with nothing to reuse there is nothing to
    weigh against the load, and vLLM's count of the engines' requests (a decoding one as
    much as a prefilling one: each holds a slot of every step) spread the process fleet's
    work better than a count of prompt tokens whose decoding it does not see (that count
    lost 3-7 % of vLLM's throughput at 100 requests/s a rank, ``benchmarks/README.md``).
    Without ``prompt_token_ids`` a request thus goes where vLLM's score sends it. ``now``
    (a clock reading, seconds) ages the index; without it blocks are forgotten only by
    capacity.
    """

    ROUTINGS: tuple[Routing, ...] = ROUTINGS
    """The policies ``routing`` takes (for command-line choices)."""

    check_routing = staticmethod(check_routing)

    def __init__(
        self,
        engine_count: int,
        *,
        client_index: int = 0,
        client_count: int = 1,
        routing: Routing = "vllm",
        prefix_routing: PrefixRouting | None = None,
    ) -> None:
        if engine_count < 1 or client_count < 1 or not 0 <= client_index < client_count:
            raise ValueError("need engine_count >= 1 and 0 <= client_index < client_count")
        self._routing: Routing = check_routing(routing)
        self._client_count = client_count
        self._inflight = [0] * engine_count
        self._start = (engine_count * client_index) // client_count
        self._table: tuple[EngineLoad, ...] = ()
        self._local: list[EngineLoad] = [IDLE_LOAD] * engine_count
        self._scores: list[float] = [0.0] * engine_count
        """vLLM routing: each engine's score (``_local`` and ``_inflight``), kept up to date
        where they change, so that a choice is a C-level ``min`` and ``index``."""
        self._finite = True
        """vLLM routing: every score in ``_scores`` is finite (see :meth:`_lowest`)."""
        self._router: PrefixRouter | None = None
        if routing == "prefix":
            self._router = PrefixRouter(engine_count, prefix_routing, start=self._start)
        elif prefix_routing is not None:
            raise ValueError('prefix_routing settings need routing="prefix"')
        self._queued: list[float] = [0.0] * engine_count
        """Prefix routing: each rank's queued work in tokens (see the class docstring)."""
        self._pending: list[float] = [0.0] * engine_count
        """Prefix routing: tokens routed to each rank since the latest report."""
        self._unit = 1.0
        self._mean_uncached: float | None = None
        self._now = 0.0

    @property
    def routing(self) -> Routing:
        """The policy: ``"vllm"`` or ``"prefix"``."""
        return self._routing

    @property
    def client_count(self) -> int:
        return self._client_count

    @property
    def engine_count(self) -> int:
        """How many engines it chooses among (follows the length of the loads given)."""
        return len(self._inflight)

    @property
    def router(self) -> PrefixRouter | None:
        """The prefix router (its index and settings), or None with ``routing="vllm"``."""
        return self._router

    def statistics(self) -> ChooserStatistics:
        """The in-flight counts per engine and, with the prefix policy, its counters
        (decisions, guard fallbacks, KV-event batches): a frozen copy."""
        router = self._router
        return ChooserStatistics(
            tuple(self._inflight), replace(router.counters) if router is not None else None
        )

    def _resize(self, engine_count: int) -> None:
        extra = engine_count - len(self._inflight)
        if extra > 0:
            self._inflight.extend([0] * extra)
        elif extra < 0:
            del self._inflight[engine_count:]
        self._start %= engine_count
        self._table = ()  # rebuild the scores (and queued work) for the new ranks
        self._local = [IDLE_LOAD] * engine_count
        self._scores = [0.0] * engine_count
        if self._router is not None:
            self._router.resize(engine_count)
            self._queued = [0.0] * engine_count
            self._pending = [0.0] * engine_count

    def choose(
        self,
        loads: Sequence[EngineLoad],
        prompt_token_ids: Sequence[int] | None = None,
        *,
        now: float | None = None,
    ) -> int:
        """Pick the engine for one new request given the latest per-engine loads; the
        request counts as in flight there until :meth:`finished`.

        ``prompt_token_ids`` and ``now`` matter only with ``routing="prefix"``.
        """
        count = len(loads)
        if count == 0:
            raise ValueError("no engines to choose from")
        if count != len(self._inflight):
            self._resize(count)
        table = tuple(loads)
        if table != self._table:
            self._follow_report(table)
        start = self._start
        self._start = (start + 1) % count
        if self._router is not None:
            best_index = self._choose_prefix(self._router, prompt_token_ids, now, start)
        else:
            best_index = self._lowest(start)
        chosen = self._local[best_index]
        waiting = chosen.waiting + self._client_count
        if type(chosen) is EngineLoad:  # its three fields: built directly, not by _replace
            self._local[best_index] = EngineLoad(waiting, chosen.running, chosen.kv_cache_usage)
        else:
            self._local[best_index] = chosen._replace(waiting=waiting)
        self._inflight[best_index] += 1
        self._rescore(best_index)
        return best_index

    def _lowest(self, start: int) -> int:
        """vLLM's scan: engines in rotated order from ``start``, the first strictly lowest
        score. With finite scores that is the first minimum at or after ``start``,
        wrapping, found by C-level ``min`` and ``index`` (the per-decision cost at 256
        engines); otherwise (an infinite or NaN score, which never compares lower) the
        scan itself, so the choice stays vLLM's whatever the loads."""
        scores = self._scores
        if self._finite:
            return first_from(scores, min(scores), start)
        count = len(scores)
        best_index = -1
        best_score = float("inf")
        for offset in range(count):
            index = (start + offset) % count
            if scores[index] < best_score:
                best_index, best_score = index, scores[index]
        return best_index  # -1 when no score is below infinity, as the scan gives

    def _rescore(self, index: int) -> None:
        local = self._local[index]
        score = vllm_score(
            local.waiting,
            local.running,
            local.kv_cache_usage,
            self._inflight[index],
            self._client_count,
        )
        self._scores[index] = score
        if not isfinite(score):
            self._finite = False

    def _clock(self, now: float | None) -> float:
        if now is not None and now > self._now:
            self._now = now
        return self._now

    def _follow_report(self, table: tuple[EngineLoad, ...]) -> None:
        """A new load table: vLLM's score of every engine afresh, and with the prefix
        policy each rank's queued work in tokens. The table now counts what was routed
        before it, or this front-end's requests still in flight there if they are more
        (vLLM's score): an engine reports between its steps and the coordinator publishes
        every 100 ms, so a table often predates what was just sent to some engine, which
        would otherwise look idle and draw every request."""
        self._table = table
        self._local = list(table)
        clients = self._client_count
        self._scores = [
            vllm_score(load.waiting, load.running, load.kv_cache_usage, inflight, clients)
            for load, inflight in zip(table, self._inflight, strict=True)
        ]
        self._finite = all(map(isfinite, self._scores))
        if self._router is None:
            return
        if self._mean_uncached is not None:
            self._unit = max(1.0, self._mean_uncached)
        unit = self._unit
        self._queued = [unit * score for score in self._scores]
        self._pending = [0.0] * len(table)

    def _choose_prefix(
        self,
        router: PrefixRouter,
        prompt_token_ids: Sequence[int] | None,
        now: float | None,
        start: int,
    ) -> int:
        tokens: Sequence[int] = prompt_token_ids if prompt_token_ids is not None else ()
        # vLLM's choice, scanned only if nothing of the prompt is cached anywhere
        decision = router.choose(
            tokens, self._queued, self._clock(now), unshared_choice=partial(self._lowest, start)
        )
        self._charge(decision.engine_index, len(tokens) - decision.cached_tokens, bool(tokens))
        return decision.engine_index

    def _charge(self, rank: int, uncached: int, has_prompt: bool) -> None:
        if has_prompt:
            mean = self._mean_uncached
            self._mean_uncached = (
                float(uncached) if mean is None else mean + (uncached - mean) * _UNIT_SMOOTHING
            )
        cost = self._client_count * (float(uncached) if has_prompt else self._unit)
        self._queued[rank] += cost
        self._pending[rank] += cost

    def observe(
        self, engine_index: int, prompt_token_ids: Sequence[int], *, now: float | None = None
    ) -> bool:
        """A request for ``prompt_token_ids`` went to ``engine_index`` without
        :meth:`choose` (a pinned ``data_parallel_rank``): with ``routing="prefix"`` its
        uncached tokens count as queued there and, with the approximate feed, its prompt
        as cached there; it is then in flight there like a chosen one. No-op with vLLM's
        routing (as vLLM does for pinned requests).

        Returns whether the request now counts as in flight: only then must
        :meth:`finished` follow when it ends (a ``finished`` for an uncounted request
        would release a chosen request's count)."""
        router = self._router
        if router is None or not 0 <= engine_index < router.engine_count:
            return False
        decision = router.observe(engine_index, prompt_token_ids, self._clock(now))
        self._charge(engine_index, len(prompt_token_ids) - decision.cached_tokens, True)
        self._inflight[engine_index] += 1
        self._rescore(engine_index)
        return True

    def receive_kv_events(
        self, engine_index: int, seq: int, payload: bytes, *, now: float | None = None
    ) -> bool:
        """One of ``engine_index``'s vLLM KV-event batches (the PUB frame's ``seq`` and
        msgpack payload): the exact feed. False when rejected (logged, counted in
        :meth:`statistics`) or when the routing is not ``"prefix"``."""
        if self._router is None:
            return False
        return self._router.receive_kv_events(engine_index, seq, payload, self._clock(now))

    def finished(self, engine_index: int) -> None:
        """A request :meth:`choose` placed on ``engine_index`` (or :meth:`observe` counted
        there) finished (vLLM's ``finished_requests``): its in-flight count is released."""
        if 0 <= engine_index < len(self._inflight) and self._inflight[engine_index] > 0:
            if self._router is not None:
                share = self._pending[engine_index] / self._inflight[engine_index]
                self._pending[engine_index] -= share
                self._queued[engine_index] -= share
            self._inflight[engine_index] -= 1
            self._rescore(engine_index)


accelerate(globals(), "trio_dpcoord.routing._chooser_kernel")  # the compiled twin, if built
