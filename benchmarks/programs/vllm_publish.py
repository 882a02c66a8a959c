"""Runs in the vLLM world (an import root of vLLM 0.33.0 first on ``PYTHONPATH``): the
cost of vLLM's coordinator's timed front publish, before its send.

``python vllm_publish.py ENGINES CALLS`` prints one JSON line: ns per
``msgspec.msgpack.encode((coordinator._get_engine_counts(), wave, running))`` on a real
``DPCoordinatorProc`` holding ENGINES engines' counts (best of 5 loops, timeit's
convention), and the encoded size. Imports nothing from this repository.
"""

import json
import sys
import time


def main() -> None:
    import msgspec.msgpack
    from vllm.v1.engine.coordinator import DPCoordinatorProc

    engines, calls = int(sys.argv[1]), int(sys.argv[2])
    coordinator = DPCoordinatorProc(engines)
    for index, engine in enumerate(coordinator.engines):
        engine.request_counts[:] = [index, 4, 0.25]
    encode = msgspec.msgpack.encode
    counts = coordinator._get_engine_counts

    def publish() -> bytes:
        return encode((counts(), 3, True))

    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            publish()
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    coordinator.ctx.term()
    print(json.dumps({"publish_ns": best, "bytes": len(publish())}))


if __name__ == "__main__":
    main()
