"""The wire, and nothing else: bytes to objects and back for every message of vLLM's
data-parallel protocols (vLLM 0.33.0; 0.32's differences in ``docs/protocol.md``).

No trio, no zmq, no logging: pure functions and small frozen values. Every malformed
input raises :class:`ProtocolError` (a ``ValueError``) with a message saying what was
wrong; frames above a size cap are refused before decoding.

================================  ============================================================
module                            messages
================================  ============================================================
``_codec``                        :class:`ProtocolError`, size limits, frame constants, the
                                  checked msgpack helpers the others are built on
``_coordinator``                  engines' subscriptions, READY, ``START_DP_WAVE``, the
                                  front publish, the front-ends' FIRST_REQ and SCALE notices
``_outputs``                      ``EngineCoreOutputs`` and their scheduler stats, the loads
                                  read from them, their classification
``_output_decoder``               the coordinator's fast decoder of the same frames (msgspec
                                  when the ``fast`` extra is installed)
``_client_decoder``               the engine client's fast decoder of the same frames: the
                                  request outputs and utility answers (msgspec likewise)
``_engine_core``                  the engine-core protocol: identities, handshake, ADD (one
                                  encoder), ABORT, utility calls, engines' answers
``_kv_events``                    vLLM's KV-cache event frames and ``EventBatch`` payloads
``_peer_routes``                  ours, between front-ends: a prompt's block keys and the
                                  engine it was routed to (the prefix router's shared feed)
================================  ============================================================

:func:`decode_coordinator_output` takes one of two paths, chosen once per process
(:data:`COORDINATOR_OUTPUT_DECODER` says which): msgspec's typed decode when the ``fast``
extra is installed, msgpack-python otherwise. Both are public as
:func:`decode_coordinator_output_with_msgspec` and
:func:`decode_coordinator_output_with_msgpack`, so that tests and benchmarks can hold them
to one contract (the same :data:`CoordinatorOutput` or the same :class:`ProtocolError` as
:func:`decode_engine_core_outputs` then :func:`classify_output`) and measure each.
:func:`decode_client_output` (what an engine client reads of the same frames: request
outputs and the utility answer, :data:`ClientOutput`) has the same two paths
(:data:`CLIENT_OUTPUT_DECODER`, :func:`decode_client_output_with_msgspec`,
:func:`decode_client_output_with_msgpack`) under the same contract with
:func:`decode_engine_core_outputs`. The coordinator's hot path reads a stats report with
:func:`decode_ingest_stats`: one of the ingest paths, public as
:func:`ingest_stats_with_msgspec`, :func:`ingest_stats_with_layouts` (without msgspec:
reports read against the layouts of earlier ones, else the next) and
:func:`ingest_stats_with_msgpack` (the report's fields as a flat tuple, or None for a
frame left to :func:`decode_coordinator_output`); where the compiled twin was built
(``setup.py``), it reads them itself (``_output_decoder_kernel.pyx``, the same answers
or None).
"""

from __future__ import annotations

from ._client_decoder import DECODER as CLIENT_OUTPUT_DECODER
from ._client_decoder import ClientOutput, RequestTokens, decode_client_frames, decode_client_output
from ._client_decoder import decode_with_msgpack as decode_client_output_with_msgpack
from ._client_decoder import decode_with_msgspec as decode_client_output_with_msgspec
from ._codec import (
    MAX_CONTROL_FRAME_BYTES,
    MAX_DATA_FRAME_BYTES,
    READY,
    SCALE_ELASTIC_EP,
    SUBSCRIBE,
    UNSUBSCRIBE,
    ProtocolError,
    RequestType,
)
from ._coordinator import (
    FrontPublish,
    LegacyFirstRequest,
    ScaleElasticEP,
    StartDPWave,
    Subscription,
    decode_engine_broadcast,
    decode_front_message,
    decode_front_publish,
    decode_request_type,
    decode_start_dp_wave,
    decode_subscription,
    encode_front_publish,
    encode_front_publish_trusted,
    encode_legacy_first_request,
    encode_scale_elastic_ep,
    encode_start_dp_wave,
    encode_start_dp_wave_trusted,
)
from ._engine_core import (
    ENGINE_CORE_DEAD,
    FINISH_REASONS,
    EngineCoreRequest,
    EngineDead,
    EngineHandshakeError,
    HandshakeMetadata,
    SamplingParams,
    UtilityCall,
    UtilityResult,
    decode_abort,
    decode_engine_frames,
    decode_engine_request,
    decode_handshake,
    decode_handshake_metadata,
    decode_ready_response,
    decode_utility,
    decode_utility_output,
    encode_abort,
    encode_add,
    encode_add_request,
    encode_handshake_hello,
    encode_handshake_metadata,
    encode_handshake_ready,
    encode_ready_response,
    encode_utility,
    encode_utility_output,
    engine_identity,
    rank_of_identity,
    request_slots_after_sampling,
)
from ._kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    KVEventError,
    decode_event_batch,
    decode_kv_event_frames,
    encode_event_batch,
    encode_kv_event_frames,
)
from ._output_decoder import DECODER as COORDINATOR_OUTPUT_DECODER
from ._output_decoder import Decoded as CoordinatorOutput
from ._output_decoder import decode_coordinator_output, decode_ingest_stats
from ._output_decoder import decode_with_msgpack as decode_coordinator_output_with_msgpack
from ._output_decoder import decode_with_msgspec as decode_coordinator_output_with_msgspec
from ._output_decoder import ingest_with_layouts as ingest_stats_with_layouts
from ._output_decoder import ingest_with_msgpack as ingest_stats_with_msgpack
from ._output_decoder import ingest_with_msgspec as ingest_stats_with_msgspec
from ._outputs import (
    IDLE_LOAD,
    NO_PREFIX_CACHE_STATS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineLoad,
    OutputKind,
    PrefixCacheStats,
    SchedulerStats,
    StatsReport,
    classify_output,
    decode_engine_core_outputs,
    encode_engine_core_outputs,
)
from ._peer_routes import PEER_ROUTE_MAGIC, PeerRoute, decode_peer_route, encode_peer_route

__all__ = [
    "CLIENT_OUTPUT_DECODER",
    "COORDINATOR_OUTPUT_DECODER",
    "ENGINE_CORE_DEAD",
    "FINISH_REASONS",
    "IDLE_LOAD",
    "MAX_CONTROL_FRAME_BYTES",
    "MAX_DATA_FRAME_BYTES",
    "NO_PREFIX_CACHE_STATS",
    "PEER_ROUTE_MAGIC",
    "READY",
    "SCALE_ELASTIC_EP",
    "SUBSCRIBE",
    "UNSUBSCRIBE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ClientOutput",
    "CoordinatorOutput",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineDead",
    "EngineHandshakeError",
    "EngineLoad",
    "EventBatch",
    "FrontPublish",
    "HandshakeMetadata",
    "KVEvent",
    "KVEventError",
    "LegacyFirstRequest",
    "OutputKind",
    "PeerRoute",
    "PrefixCacheStats",
    "ProtocolError",
    "RequestTokens",
    "RequestType",
    "SamplingParams",
    "ScaleElasticEP",
    "SchedulerStats",
    "StartDPWave",
    "StatsReport",
    "Subscription",
    "UtilityCall",
    "UtilityResult",
    "classify_output",
    "decode_abort",
    "decode_client_frames",
    "decode_client_output",
    "decode_client_output_with_msgpack",
    "decode_client_output_with_msgspec",
    "decode_coordinator_output",
    "decode_coordinator_output_with_msgpack",
    "decode_coordinator_output_with_msgspec",
    "decode_engine_broadcast",
    "decode_engine_core_outputs",
    "decode_engine_frames",
    "decode_engine_request",
    "decode_event_batch",
    "decode_front_message",
    "decode_front_publish",
    "decode_handshake",
    "decode_handshake_metadata",
    "decode_ingest_stats",
    "decode_kv_event_frames",
    "decode_peer_route",
    "decode_ready_response",
    "decode_request_type",
    "decode_start_dp_wave",
    "decode_subscription",
    "decode_utility",
    "decode_utility_output",
    "encode_abort",
    "encode_add",
    "encode_add_request",
    "encode_engine_core_outputs",
    "encode_event_batch",
    "encode_front_publish",
    "encode_front_publish_trusted",
    "encode_handshake_hello",
    "encode_handshake_metadata",
    "encode_handshake_ready",
    "encode_kv_event_frames",
    "encode_legacy_first_request",
    "encode_peer_route",
    "encode_ready_response",
    "encode_scale_elastic_ep",
    "encode_start_dp_wave",
    "encode_start_dp_wave_trusted",
    "encode_utility",
    "encode_utility_output",
    "engine_identity",
    "ingest_stats_with_layouts",
    "ingest_stats_with_msgpack",
    "ingest_stats_with_msgspec",
    "rank_of_identity",
    "request_slots_after_sampling",
]
