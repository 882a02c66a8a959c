"""What one simulated DP rank keeps of each request (:class:`RequestState`, the ABORT
queued for it) and what it counts (:class:`EngineStatistics`), with vLLM's finish reasons.

Plain values, no I/O: :mod:`.engine_loop` steps with them, :mod:`.engine_core` extends
the rank with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from .. import protocol

__all__ = ["FINISH_ABORT", "FINISH_LENGTH", "AbortInput", "EngineStatistics", "RequestState"]

FINISH_LENGTH: Final = protocol.FINISH_REASONS.index("length")
"""vLLM's finish reason of a request that generated all its tokens (1 on the wire)."""
FINISH_ABORT: Final = protocol.FINISH_REASONS.index("abort")
"""vLLM's finish reason of a request an engine dropped (2 on the wire)."""


@dataclass(slots=True)
class RequestState:
    """One request in a rank's scheduler (its waiting or running queue)."""

    request_id: str
    remaining: int
    """Tokens still to generate."""
    generated: int = 0
    prompt: tuple[int, ...] = ()
    prefill_left: int = 0
    """Prompt tokens still to compute (the prefix-cache engine; 0 for the toy)."""


@dataclass(slots=True)
class EngineStatistics:
    """What one rank did, for tests and reports."""

    steps: int = 0
    dummy_steps: int = 0
    waves: int = 0
    requests_finished: int = 0
    start_waves_sent: int = 0
    broadcasts_dropped: int = 0
    broadcast_regressions: int = 0
    """START_DP_WAVEs for an older wave than one received before: the coordinator's wave
    went back as this engine sees it (never, by docs/protocol.md §16.1 rule 1)."""
    bad_requests: int = 0
    stats_sent: int = 0
    coordinator_disconnects: int = 0
    coordinator_reconnects: int = 0
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache (vLLM's ``prefix_cache_stats.queries``)."""
    prefix_hits: int = 0
    """Of those, tokens found cached (``prefix_cache_stats.hits``)."""
    computed_tokens: int = 0
    """Tokens processed by real steps (prefill chunks plus decodes; the prefix cache)."""
    kv_event_batches: int = 0


@dataclass(frozen=True, slots=True)
class AbortInput:
    """An ABORT read off the input socket, queued for the busy loop in order with the
    other inputs (a stand-in engine that reads its own socket queues it the same way)."""

    request_ids: tuple[str, ...]
