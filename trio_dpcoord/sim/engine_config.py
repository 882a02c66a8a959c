"""What one simulated DP rank is told: :class:`EngineConfig`.

Plain values, no I/O: :mod:`.engine` runs a rank with one; what a rank keeps of each
request and counts is in :mod:`.engine_state`, how it fails in :mod:`.engine_errors`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .prefix import DEFAULT_BLOCK_SIZE

__all__ = ["EngineConfig"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one simulated DP rank needs to know."""

    rank: int
    engine_count: int
    back_publish_address: str
    """The coordinator's back-publish socket (XPUB: READY, START_DP_WAVE)."""
    back_output_address: str
    """The coordinator's back-output socket (PULL: stats, wave reports)."""
    request_address: str
    """The front-end's request ROUTER."""
    completion_address: str
    """The front-end's completion PULL."""
    collective_address: str
    """Where rank 0 binds the collective ROUTER and every rank connects."""
    step_time: float = 0.002
    """Seconds one forward pass (real or dummy) takes."""
    tokens_per_request: int = 8
    """Tokens generated for a request that carries no ``max_tokens``."""
    max_running: int = 8
    """Per-step capacity: how many requests one step advances."""
    sync_interval: int = 16
    """``dp_sync_interval``: the all-reduce runs on step 1 and every multiple of this."""
    collective_timeout: float = 10.0
    report_start_wave: bool = True
    """vLLM >= 0.33 behaviour: report ``start_wave`` for every request reaching an idle
    engine. False emulates older engines (report only for stale-wave requests), which
    rely on the front-end to wake the other ranks."""
    coordinator_timeout: float | None = None
    """Exit (:class:`CoordinatorLostError`) when the coordinator stays unreachable this
    long; None: log the loss and keep waiting for it to come back."""
    curve_server_key: bytes | None = None
    """The coordinator's CURVE public key when it runs with CURVE (off by default):
    both coordinator sockets then connect as CURVE clients."""
    prefix_cache_blocks: int = 0
    """0 (the default): the toy scheduler, one token per running request per step, every
    step ``step_time`` long. N > 0: the prefix-cache engine (see
    :class:`~trio_dpcoord.sim.SimEngine`): an LRU prefix cache of N blocks of
    ``block_size`` tokens, chunked prefill of the uncached prompt tokens, steps of
    ``step_time + step_per_token * tokens``."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV-cache block (vLLM's ``--block-size``, 16)."""
    token_budget: int = 2048
    """Tokens one step may process (vLLM's ``max_num_batched_tokens``; 2048 is one of
    its defaults): decodes first, then prefill chunks."""
    step_per_token: float = 0.0
    """Seconds each processed token adds to a step (the lock-step model's ``b``,
    :data:`~trio_dpcoord.sim.prefix.STEP_PER_TOKEN_S`, is 2e-5); with the prefix cache only."""
    kv_events_address: str | None = None
    """Publish KV-cache events here (a ZeroMQ PUB socket this rank binds), as vLLM does
    with ``--kv-events-config``; needs the prefix cache."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.engine_count:
            raise ValueError(f"rank {self.rank} out of range for {self.engine_count} engines")
        if self.step_time < 0 or self.collective_timeout <= 0:
            raise ValueError("step_time must be >= 0 and collective_timeout > 0")
        if self.coordinator_timeout is not None and self.coordinator_timeout <= 0:
            raise ValueError("coordinator_timeout must be positive")
        if self.tokens_per_request < 1 or self.max_running < 1 or self.sync_interval < 1:
            raise ValueError("tokens_per_request, max_running and sync_interval must be >= 1")
        if self.prefix_cache_blocks < 0 or self.block_size < 1 or self.token_budget < 1:
            raise ValueError("need prefix_cache_blocks >= 0, block_size and token_budget >= 1")
        if not self.step_per_token >= 0:
            raise ValueError("step_per_token must be >= 0")
        if self.kv_events_address is not None and not self.prefix_cache_blocks:
            raise ValueError("kv_events_address needs a prefix cache (prefix_cache_blocks > 0)")
