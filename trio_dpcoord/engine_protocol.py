"""The engine-core protocol's public vocabulary: what a front-end and a vLLM engine core
say to each other (the handshake, ADD, ABORT, utility calls, outputs), as pure codecs.

:class:`~trio_dpcoord.EngineClient` speaks it for you; a test, a simulated engine core
(:mod:`trio_dpcoord.sim.engine_core`) or an embedder that talks to engines itself imports
the codecs from here. The state behind the client (its handshake and request tables)
stays private and may change shape freely.
"""

from __future__ import annotations

from ._engine_protocol import (
    ENGINE_CORE_DEAD,
    FINISH_REASONS,
    EngineDead,
    EngineHandshakeError,
    SamplingParams,
    UtilityResult,
    decode_engine_frames,
    decode_handshake,
    decode_ready_response,
    decode_utility_output,
    encode_abort,
    encode_add,
    encode_utility,
    engine_identity,
    rank_of_identity,
)

__all__ = [
    "ENGINE_CORE_DEAD",
    "FINISH_REASONS",
    "EngineDead",
    "EngineHandshakeError",
    "SamplingParams",
    "UtilityResult",
    "decode_engine_frames",
    "decode_handshake",
    "decode_ready_response",
    "decode_utility_output",
    "encode_abort",
    "encode_add",
    "encode_utility",
    "engine_identity",
    "rank_of_identity",
]
