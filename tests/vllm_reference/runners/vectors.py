"""Encodes the protocol vectors with vLLM's real code; prints one JSON object on stdout.

Runs with an import root on ``PYTHONPATH`` (see ``tests/vllm_reference/README.md``). Every
frame here comes out of vLLM 0.33.0: its ``MsgpackEncoder`` over its ``EngineCoreOutputs``,
``EngineCoreOutput``, ``UtilityOutput``, ``SchedulerStats`` and ``EngineCoreRequest``;
``DPCoordinatorProc._send_start_wave`` into a real zmq socket; ``msgspec.msgpack.encode``
(the very call vLLM's coordinator and DP client make) for tuples; and the byte literals
vLLM's sources pass to ``send`` (read from those sources with ``ast``).
"""

import ast
import json
import sys
from pathlib import Path

import msgspec
import vllm
import zmq
from vllm import _version
from vllm.v1.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    UtilityOutput,
)
from vllm.v1.engine.coordinator import DPCoordinatorProc
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackEncoder, UtilityResult

TIMESTAMP = 81234.5678  # a fixed monotonic timestamp, so that the bytes are stable
VLLM_DIR = Path(vllm.__file__).parent


def sent_literals(relative: str, receiver: str) -> list[str]:
    """Hex of every bytes literal that ``relative`` passes to ``<receiver>.send(...)``."""
    tree = ast.parse((VLLM_DIR / relative).read_text())
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "send"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == receiver
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, bytes)
        ):
            found.append(node.args[0].value.hex())
    return sorted(set(found))


def hexes(frames: list[bytes]) -> list[str]:
    return [bytes(frame).hex() for frame in frames]


def main() -> None:
    encoder = MsgpackEncoder()

    def eco(**fields: object) -> list[str]:
        # DPEngineCoreProc sends coordinator messages with coord_socket.send_multipart(
        # encoder.encode(outputs)); front-end outputs go out as the same buffers.
        return hexes(encoder.encode(EngineCoreOutputs(timestamp=TIMESTAMP, **fields)))

    context = zmq.Context()
    capture_out = context.socket(zmq.PAIR)
    capture_in = context.socket(zmq.PAIR)
    capture_out.bind("inproc://start-dp-wave")
    capture_in.connect("inproc://start-dp-wave")

    def start_dp_wave(wave: int, exclude: int | None) -> list[str]:
        DPCoordinatorProc._send_start_wave(capture_out, wave, exclude)
        return hexes(capture_in.recv_multipart())

    request = EngineCoreRequest(
        request_id="cmpl-a1-0",
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=None,
        pooling_params=None,
        arrival_time=1700000000.25,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        current_wave=5,
    )
    frames = {
        "start_dp_wave_exclude_int": start_dp_wave(3, 1),
        "start_dp_wave_exclude_none": start_dp_wave(3, None),
        "eco_scheduler_stats_moe": eco(
            engine_index=2,
            scheduler_stats=SchedulerStats(
                num_running_reqs=12,
                num_waiting_reqs=3,
                step_counter=17,
                current_wave=5,
                kv_cache_usage=0.4375,
            ),
        ),
        "eco_scheduler_stats_dense": eco(
            engine_index=1,
            scheduler_stats=SchedulerStats(
                num_running_reqs=4, num_waiting_reqs=0, kv_cache_usage=0.1
            ),
        ),
        "eco_wave_complete": eco(engine_index=0, wave_complete=5),
        "eco_start_wave": eco(engine_index=2, start_wave=6),
        "eco_normal_output_batch": eco(
            engine_index=1,
            outputs=[
                EngineCoreOutput(
                    request_id="cmpl-a1-0",
                    new_token_ids=[1234, 5678],
                    events=[EngineCoreEvent.new_event(EngineCoreEventType.SCHEDULED, 81234.5)],
                ),
                EngineCoreOutput(
                    request_id="cmpl-b2-0", new_token_ids=[42], finish_reason=FinishReason.STOP
                ),
            ],
            finished_requests={"cmpl-b2-0"},
            weight_version="default",
        ),
        "eco_utility_output": eco(
            engine_index=0, utility_output=UtilityOutput(call_id=7, result=UtilityResult(None))
        ),
        "front_publish_counts": hexes(
            [msgspec.msgpack.encode(([[3, 12, 0.4375], [0, 4, 0.1], [0, 0, 0.0]], 5, True))]
        ),
        "front_publish_wave_only": hexes([msgspec.msgpack.encode((None, 6, False))]),
        "front_scale_elastic_ep": hexes([msgspec.msgpack.encode(("SCALE_ELASTIC_EP", 4))]),
        "legacy_first_req_int": hexes([msgspec.msgpack.encode((1, 5))]),
        "legacy_first_req_none": hexes([msgspec.msgpack.encode((None, 5))]),
        "legacy_first_req_identity_bytes": hexes(
            [msgspec.msgpack.encode(((1).to_bytes(2, "little"), 5))]
        ),
        # EngineCoreClient._send_input: (request_type.value, *encoder.encode(request))
        "front_to_engine_add_request_skeleton": hexes(
            [EngineCoreRequestType.ADD.value, *encoder.encode(request)]
        ),
    }
    capture_in.close()
    capture_out.close()
    context.term()
    # What engines send to vLLM's live coordinator while the live vectors are captured.
    live_inputs = {
        "engine_1_stats": eco(
            engine_index=1,
            scheduler_stats=SchedulerStats(
                num_running_reqs=12, num_waiting_reqs=3, kv_cache_usage=0.4375
            ),
        ),
        "engine_1_start_wave_0": eco(engine_index=1, start_wave=0),
        "engine_0_wave_complete_0": eco(engine_index=0, wave_complete=0),
    }

    result = {
        "vllm_version": vllm.__version__,
        "vllm_commit": _version.__commit_id__,
        "msgspec_version": msgspec.__version__,
        "literals": {
            "engine_subscribe": sent_literals("v1/engine/core.py", "coord_socket"),
            "frontend_subscribe": sent_literals("v1/engine/core_client.py", "socket"),
            "coordinator_ready": sent_literals("v1/engine/coordinator.py", "publish_back"),
        },
        "field_order": {
            cls.__name__: list(cls.__struct_fields__)
            for cls in (EngineCoreOutputs, EngineCoreOutput, UtilityOutput, EngineCoreRequest)
        },
        "request_types": {member.name: member.value.hex() for member in EngineCoreRequestType},
        "frames": frames,
        "live_inputs": live_inputs,
    }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
