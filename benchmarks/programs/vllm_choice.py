"""Runs in the vLLM world (the cluster import root of vLLM 0.33.0 first on ``PYTHONPATH``,
``tests.vllm_reference.dp_cluster.prepare_cluster_root``): the cost of vLLM's own engine
choice, ``DPLBAsyncMPClient.get_core_engine_for_request``.

``python vllm_choice.py CALLS REPEATS`` reads the engines' loads from stdin (a JSON list
of ``[waiting, running, kv_cache_usage]``, one per engine) and prints one JSON line:
``{"us": [[...], ...]}``, the microseconds of each call, a list per loop of CALLS calls
on a fresh client, REPEATS loops. The client is made without
``__init__`` (which needs engines, sockets and a coordinator) and given the state its
``__init__`` gives it, as ``tests/vllm_reference/runners/routing.py`` does; the requests
are vLLM's ``EngineCoreRequest``, made before the clock starts. Imports nothing from this
repository.
"""

import json
import sys
import time
from collections import Counter
from typing import Any


def make_client(loads: list[list[float]]) -> Any:
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    client = object.__new__(DPLBAsyncMPClient)
    client.client_count = 1
    client.client_index = 0
    client.reqs_in_flight = {}
    client.streaming_reqs = set()
    client.engine_inflight = Counter()
    client.core_engines = [rank.to_bytes(2, "little") for rank in range(len(loads))]
    client.lb_engines = [list(load) for load in loads]
    client.eng_start_index = 0
    return client


def main() -> None:
    from vllm.v1.engine import EngineCoreRequest

    calls, repeats = int(sys.argv[1]), int(sys.argv[2])
    loads = json.load(sys.stdin)
    clock = time.perf_counter_ns
    passes = []
    for repeat in range(repeats):
        client = make_client(loads)
        choose = client.get_core_engine_for_request
        requests = [
            EngineCoreRequest(
                request_id=f"req-{repeat}-{call}",
                prompt_token_ids=[1, 2, 3],
                mm_features=None,
                sampling_params=None,
                pooling_params=None,
                arrival_time=0.0,
                lora_request=None,
                cache_salt=None,
                data_parallel_rank=None,
            )
            for call in range(calls)
        ]
        timings = []
        for request in requests:
            t0 = clock()
            choose(request)
            timings.append((clock() - t0) / 1000)
        passes.append(timings)
    print(json.dumps({"us": passes}))


if __name__ == "__main__":
    main()
