"""The front-end's sans-IO state: what :class:`~trio_dpcoord.Frontend` knows and decides.

:class:`FrontendState` is to :class:`~trio_dpcoord.Frontend` what
:class:`~trio_dpcoord.CoordinatorCore` is to :class:`~trio_dpcoord.Coordinator`: every
rule of a front-end following a standalone coordinator, in a plain object that takes the
frames that arrived and clock readings and returns what must go out. It never awaits and
never touches a socket; the trio handle only moves bytes and calls it.

The rules: the latest publish wins (its wave, and its counts when it has them, §7.1); a
publish that does not decode is rejected, counted and the rest of the batch kept; the
legacy first-request claim (§7.4: if the publish says paused, flip to running at once
and send one FIRST_REQ, so concurrent requests coalesce behind it); the engine choice
with vLLM's score or the prefix policy and this front-end's in-flight counts (§7.2).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

from .. import protocol
from .._errors import CoordinatorError
from ..protocol import IDLE_LOAD, EngineLoad
from ..routing._chooser import EngineChooser, Routing, check_routing
from ..routing._decision import RouterStatistics
from ..routing._settings import PrefixRouting
from ._coordinator import Reject
from ._wave import WaveSnapshot, WaveState, check_engine_index

__all__ = ["FrontendState", "FrontendStatistics"]

logger = logging.getLogger(__name__)

_UNDECODABLE = "undecodable_front_publish"


@dataclass(frozen=True, slots=True)
class FrontendStatistics:
    """What :meth:`FrontendState.statistics` (and :meth:`~trio_dpcoord.Frontend.statistics`)
    read: a copy, unchanged by later publishes and requests."""

    publishes_received: int
    """Valid publishes received (each one, even if a later one superseded it)."""
    last_publish_time: float | None
    """The clock reading when the latest publish arrived, or None before any."""
    rejected: dict[str, int]
    """Publishes that could not be decoded, by reason."""
    inflight: tuple[int, ...]
    """This front-end's unfinished requests per engine (empty before the first choice)."""
    router: RouterStatistics | None
    """The prefix policy's counters (a copy); None with vLLM's, or before the first choice."""
    disconnects: int = 0
    """How many times the connection to the coordinator dropped (the trio handle's
    connection monitor counts them; the sans-IO state sees no connection)."""


@final
class FrontendState:
    """A front-end's view of the coordinator, and the requests it routed.

    ``engine_count``, if known before the first publish, lets :meth:`choose` work at
    once; ``now`` is the clock reading at opening (a silence is measured from it until
    the first publish arrives). ``routing`` and ``prefix_routing`` choose the
    engine-choice policy (:class:`~trio_dpcoord.EngineChooser`; vLLM's by default).
    """

    __slots__ = (
        "_chooser",
        "_client_count",
        "_client_index",
        "_counts",
        "_engine_count",
        "_last_publish_time",
        "_opened_at",
        "_prefix_routing",
        "_publishes_received",
        "_rejected",
        "_routing",
        "_wave",
    )

    def __init__(
        self,
        *,
        client_index: int,
        client_count: int,
        engine_count: int | None,
        now: float,
        routing: Routing = "vllm",
        prefix_routing: PrefixRouting | None = None,
    ) -> None:
        if client_count < 1 or not 0 <= client_index < client_count:
            raise ValueError("need client_count >= 1 and 0 <= client_index < client_count")
        if engine_count is not None and engine_count < 1:
            raise ValueError(f"engine_count must be positive, got {engine_count!r}")
        self._routing: Routing = check_routing(routing)
        if prefix_routing is not None and routing != "prefix":
            raise ValueError('prefix_routing settings need routing="prefix"')
        self._prefix_routing = prefix_routing
        self._client_index = client_index
        self._client_count = client_count
        self._engine_count = engine_count
        self._opened_at = now
        self._wave = WaveState()
        """The latest publish's wave, and the claim rule the coordinator's handle uses."""
        self._counts: tuple[EngineLoad, ...] | None = None
        self._chooser: EngineChooser | None = None
        self._publishes_received = 0
        self._last_publish_time: float | None = None
        self._rejected: Counter[str] = Counter()

    # --- reads ----------------------------------------------------------------------------

    @property
    def client_index(self) -> int:
        return self._client_index

    @property
    def client_count(self) -> int:
        return self._client_count

    @property
    def engine_count(self) -> int:
        """How many engines the latest publish listed (``engine_count`` as given before
        one; 0 if unknown yet)."""
        return len(self.engine_loads())

    def silent_since(self) -> float:
        """The clock reading of the latest publish (of opening, before the first one)."""
        last = self._last_publish_time
        return last if last is not None else self._opened_at

    def snapshot(self) -> WaveSnapshot:
        """The wave to stamp on a new request, and whether the engines run."""
        return self._wave.snapshot

    def engine_loads(self) -> tuple[EngineLoad, ...]:
        """Per engine load from the latest publish with counts; before one, zeros for
        ``engine_count`` engines (empty if that was not given)."""
        if self._counts is not None:
            return self._counts
        return (IDLE_LOAD,) * (self._engine_count or 0)

    def statistics(self, *, disconnects: int = 0) -> FrontendStatistics:
        """Publishes received and rejected, the latest one's time, this front-end's
        requests in flight and the prefix policy's counters: a frozen copy.
        ``disconnects``: the connection drops the caller counted (the trio handle's)."""
        chooser = self._chooser.statistics() if self._chooser is not None else None
        return FrontendStatistics(
            publishes_received=self._publishes_received,
            last_publish_time=self._last_publish_time,
            rejected=dict(self._rejected),
            inflight=chooser.inflight if chooser is not None else (),
            router=chooser.router if chooser is not None else None,
            disconnects=disconnects,
        )

    # --- inputs ---------------------------------------------------------------------------

    def receive_publishes(self, frames: Sequence[bytes], now: float) -> Sequence[Reject]:
        """A batch of publishes arrived at ``now``: the latest wave and the latest counts
        win. Returns what was rejected (already counted), for the log."""
        rejects: list[Reject] = []
        latest: protocol.FrontPublish | None = None
        latest_counts: tuple[EngineLoad, ...] | None = None
        for frame in frames:
            try:
                publish = protocol.decode_front_publish(frame)
            except protocol.ProtocolError as exc:
                self._rejected[_UNDECODABLE] += 1
                rejects.append(Reject(_UNDECODABLE, str(exc)))
                continue
            self._publishes_received += 1
            latest = publish
            if publish.counts is not None:
                latest_counts = publish.counts
        if latest is None:
            return rejects
        self._last_publish_time = now
        old = self._wave.snapshot
        self._wave = WaveState(WaveSnapshot(latest.current_wave, latest.engines_running))
        if self._wave.snapshot != old:
            logger.debug(
                "publish: wave %d -> %d, running %s -> %s",
                old.current_wave,
                latest.current_wave,
                old.engines_running,
                latest.engines_running,
            )
        if latest_counts is not None:
            self._counts = latest_counts
        return rejects

    @property
    def routing(self) -> Routing:
        return self._routing

    @property
    def chooser(self) -> EngineChooser | None:
        """The engine chooser, once the engine count is known and a choice was made."""
        return self._chooser

    def _ensure_chooser(self, engine_count: int) -> EngineChooser:
        if self._chooser is None:
            self._chooser = EngineChooser(
                engine_count,
                client_index=self._client_index,
                client_count=self._client_count,
                routing=self._routing,
                prefix_routing=self._prefix_routing,
            )
        return self._chooser

    def choose(
        self, prompt_token_ids: Sequence[int] | None = None, now: float | None = None
    ) -> int:
        """The engine for one new request, by the routing policy with the latest loads
        (``prompt_token_ids`` and the clock reading ``now`` serve the prefix policy);
        counted in flight there until :meth:`finished`. :class:`CoordinatorError`
        while the engine count is unknown."""
        loads = self.engine_loads()
        if not loads:
            raise CoordinatorError(
                "engine count unknown: pass engine_count= to open_frontend or wait for "
                "the first publish (wait_for(lambda f: f.engine_count > 0))"
            )
        return self._ensure_chooser(len(loads)).choose(loads, prompt_token_ids, now=now)

    def observe(
        self, engine_index: int, prompt_token_ids: Sequence[int], now: float | None = None
    ) -> bool:
        """A request went to ``engine_index`` without :meth:`choose` (pinned): the
        prefix policy learns it (no-op with vLLM's). Returns whether it now counts in
        flight there: only then must :meth:`finished` follow when it ends."""
        loads = self.engine_loads()
        if not loads:
            return False
        return self._ensure_chooser(len(loads)).observe(engine_index, prompt_token_ids, now=now)

    def receive_kv_events(
        self, engine_index: int, seq: int, payload: bytes, now: float | None = None
    ) -> bool:
        """One vLLM KV-event batch of ``engine_index`` for the prefix policy's exact feed;
        False if rejected (logged, counted) or not routing by prefix."""
        loads = self.engine_loads()
        if not loads:
            return False
        chooser = self._ensure_chooser(len(loads))
        return chooser.receive_kv_events(engine_index, seq, payload, now=now)

    def finished(self, engine_index: int) -> None:
        """A request routed to ``engine_index`` finished (vLLM's ``finished_requests``)."""
        if self._chooser is not None:
            self._chooser.finished(engine_index)

    def claim_first_request(self, engine_index: int) -> bytes | None:
        """A request is being routed to ``engine_index``: the FIRST_REQ frame to send if
        the latest publish says paused (the snapshot says running from now on, so
        concurrent requests send one notice), else None. ``TypeError`` for a non-int,
        ``ValueError`` for an index outside the engines (when their count is known)."""
        check_engine_index(engine_index, len(self.engine_loads()) or None)
        claim = self._wave.claim_first_request(engine_index)
        if claim is None:
            return None
        return protocol.encode_legacy_first_request(engine_index, claim.wave)

    @staticmethod
    def resize(engine_count: int) -> bytes:
        """The SCALE_ELASTIC_EP frame asking for ``engine_count`` engines (§5.8)."""
        if type(engine_count) is not int or engine_count < 1:
            raise ValueError(f"engine_count must be a positive int, got {engine_count!r}")
        return protocol.encode_scale_elastic_ep(engine_count)
