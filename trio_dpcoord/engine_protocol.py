"""The engine-core protocol's codecs, kept at this path for code that imports them from
here: they live in :mod:`trio_dpcoord.protocol` now (``protocol._engine_core``), beside
every other message of the wire."""

from __future__ import annotations

from .protocol import (
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
