"""``python -m benchmarks.programs.engine_client PLAN.json``: our side of the ``client``
section (:mod:`benchmarks.sections.client`), run as a process of its own so that its CPU
time is its own: :func:`trio_dpcoord.open_engine_client` (the coordinator inside) in front
of the plan's headless engines, the plan's passes of requests; one JSON line out."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import trio


async def _run(plan: dict[str, Any]) -> dict[str, Any]:
    from trio_dpcoord import SamplingParams, hot_path_build, open_engine_client

    params = SamplingParams(max_tokens=plan["max_tokens"], temperature=0.0, ignore_eos=True, seed=0)
    started = time.monotonic()
    async with open_engine_client(
        plan["engines"],
        f"tcp://127.0.0.1:{plan['port']}",
        startup_timeout=plan["startup_timeout"],
    ) as client:
        startup_s = time.monotonic() - started
        by_rank = [0] * plan["engines"]

        shape = plan.get("shape", "first+done")
        whole = shape == "whole"
        first_and_done = shape == "first+done"

        async def one(prompt: list[int]) -> tuple[float, int]:
            sent = time.monotonic()
            if whole:  # the caller wakes once, at the end (its "TTFT" is the whole time)
                done = await client.complete(prompt, params)
                by_rank[done.engine_index] += 1
                return time.monotonic() - sent, len(done.token_ids)
            ttft: float | None = None
            count = 0
            async with client.generate(prompt, params) as stream:
                async for output in stream:
                    if output.new_token_ids and ttft is None:
                        ttft = time.monotonic() - sent
                    count += len(output.new_token_ids)
                    if first_and_done and ttft is not None:
                        # the end, woken once: the first token and the end, as vLLM's
                        # worker waits for its two futures
                        count += len(await stream.rest())
                        break
            if stream.engine_index is not None:
                by_rank[stream.engine_index] += 1
            return (time.monotonic() - sent if ttft is None else ttft), count

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

            async with trio.open_nursery() as nursery:
                for _ in range(plan["concurrency"]):
                    nursery.start_soon(worker)
            return ttfts, total

        await load(plan["warmup_prompts"])
        passes = []
        profiler = _start_profile(plan)
        for _ in range(plan["passes"]):
            by_rank[:] = [0] * plan["engines"]
            waves_before = client.coordinator.statistics().waves_completed
            threads_before = _threads_cpu_s()
            cpu_before = time.process_time()
            main_before = time.thread_time()
            began = time.monotonic()
            began_unix = time.time()  # for the parent sampling the engines' CPU
            ttfts, total = await load(plan["prompts"])
            seconds = time.monotonic() - began
            cpu_s = time.process_time() - cpu_before
            main_cpu_s = time.thread_time() - main_before
            threads_after = _threads_cpu_s()
            passes.append(
                {
                    "main_thread_cpu_s": main_cpu_s,
                    "requests": len(ttfts),
                    "tokens": total,
                    "seconds": seconds,
                    "began_unix": began_unix,
                    "ttft_s": ttfts if plan.get("report_ttft", True) else [],
                    "cpu_s": cpu_s,
                    "coordinator_cpu_s": None,  # inside the client's process, in cpu_s
                    "requests_by_rank": list(by_rank),
                    "waves": client.coordinator.statistics().waves_completed - waves_before,
                    "threads_cpu_s": {
                        name: round(cpu - threads_before.get(name, 0.0), 6)
                        for name, cpu in threads_after.items()
                    },
                }
            )
        _stop_profile(profiler, plan)
    return {
        "client": "trio_dpcoord open_engine_client",
        "build": hot_path_build(),  # "compiled" or "pure" (TRIO_DPCOORD_PURE_PYTHON=1)
        "startup_s": startup_s,
        "passes": passes,
    }


def _threads_cpu_s() -> dict[str, float]:
    """CPU seconds of each thread of this process by name (``comm``, with its id when
    two share one): libzmq's I/O threads apart from the interpreter's."""
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            sched = (task / "sched").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        line = next(x for x in sched.splitlines() if x.startswith("se.sum_exec_runtime"))
        out[f"{name}/{task.name}"] = float(line.split(":")[1]) / 1000
    return out


def _start_profile(plan: dict[str, Any]) -> Any:
    """A running cProfile profiler when the plan asks for one (``cprofile``: the path
    of its stats), else None."""
    if not plan.get("cprofile"):
        return None
    import cProfile

    # CPU time of this thread: wall time would charge a preempted call the other
    # processes' turns on a shared machine
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    return profiler


def _stop_profile(profiler: Any, plan: dict[str, Any]) -> None:
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(plan["cprofile"])


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING)
    plan = json.loads(Path(argv[0]).read_text())
    result = trio.run(_run, plan)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
