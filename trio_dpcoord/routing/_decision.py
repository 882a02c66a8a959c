"""What the prefix router reports: each choice (:class:`RouteDecision`) and its running
counts (:class:`RouterStatistics`); plain records, apart from the router so that the
shell and the core can name them without it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RouteDecision", "RouterStatistics"]


@dataclass
class RouterStatistics:
    """What the router did: decisions (pinned ones included), the prompt tokens they
    routed and how many of those were believed cached on the chosen rank, guard
    fallbacks, KV-event batches applied, rejected (undecodable or from an unknown rank)
    and sequence gaps (lost or reordered batches, each of which forgot that rank's
    exact knowledge)."""

    decisions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    guard_fallbacks: int = 0
    event_batches: int = 0
    rejected_event_batches: int = 0
    event_gaps: int = 0


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """One choice: the engine, the prompt's tokens believed cached there, and whether
    the imbalance guard made it (least loaded, affinity ignored)."""

    engine_index: int
    cached_tokens: int
    guarded: bool
