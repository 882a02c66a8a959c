"""vLLM 0.33.0's load score of one engine (``DPLBAsyncMPClient``, docs/protocol.md §7.2).

Stdlib only, so that the vLLM plugin imports it in every one of vLLM's processes without
loading msgpack, trio or pyzmq; :class:`~trio_dpcoord.routing.EngineChooser` and the
plugin's routing both score with it, so the two cannot drift apart.
"""

from __future__ import annotations

__all__ = ["vllm_score"]


def vllm_score(
    waiting: float, running: float, kv_cache_usage: float, in_flight: int, client_count: int
) -> float:
    """The engine's score, lower is better: its queue (``waiting + running``) or this
    client's share of what is in flight (``client_count x in_flight``), whichever is
    larger, plus a penalty for waiting requests when the KV cache is over half full."""
    score = float(max(client_count * in_flight, waiting + running))
    if waiting:
        score += waiting * 6.0 * max(0.0, kv_cache_usage - 0.5)
    return score
