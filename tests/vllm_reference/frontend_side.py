"""vLLM 0.33.0's DP front-end request path, run for real in a torch-free process.

Run as ``python frontend_side.py SPEC_JSON`` with the same import root as
``engine_side.py``. Two pieces of vLLM run here, as in vLLM's own launcher and API
server: ``wait_for_engine_startup`` (the engines' startup handshake: HELLO, the
addresses, READY) in a thread, and a ``DPLBAsyncMPClient`` built on externally managed
engines (``client_addresses``). Requests go through ``add_request_async`` (so
``DPAsyncMPClient`` stamps ``current_wave`` and ``DPLBAsyncMPClient.
get_core_engine_for_request`` picks the engine from the coordinator's published loads);
outputs come back through ``get_output_async``; pauses through
``pause_generation_async``/``resume_scheduler_async`` (sent to every engine).

The only addition is :class:`RecordingClient`, which records every value the client's
stats task assigns to ``current_wave`` and ``engines_running`` (so the report shows
whether the front-end ever saw the wave go backwards) and, in stress mode, fires extra
requests the moment the coordinator announces a wave end. The scenario ends once the
published view is paused at the wave every engine says it is paused at
(:func:`wait_for_published_end`: a probe through vLLM's utility path, answered by the
executor stand-in). The report (JSON) lists every request's outcome, the end probes, and
every vLLM function that ran in this process.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
import traceback
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import zmq
from engine_side import (  # type: ignore[import-not-found]  # beside this script
    DP_WAVE_STATE_RPC,
    CallTracer,
    StandInExecutor,
    make_vllm_config,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.network_utils import zmq_socket_ctx
from vllm.v1.engine import EngineCoreRequest, FinishReason
from vllm.v1.engine.core_client import DPLBAsyncMPClient
from vllm.v1.engine.utils import (
    CoreEngine,
    CoreEngineLaunch,
    EngineZmqAddresses,
    wait_for_engine_startup,
)

T = TypeVar("T")


class RecordingClient(DPLBAsyncMPClient):  # type: ignore[misc]
    """``DPLBAsyncMPClient`` whose ``current_wave``/``engines_running`` assignments are
    recorded (plain attributes in vLLM; properties here, nothing else changed)."""

    on_wave_end: Any = None

    @property
    def current_wave(self) -> int:
        return int(self.__dict__.get("_wave", 0))

    @current_wave.setter
    def current_wave(self, wave: int) -> None:
        self.__dict__.setdefault("wave_history", []).append(wave)
        self.__dict__["_wave"] = wave
        self._view_changed()

    @property
    def engines_running(self) -> bool:
        return bool(self.__dict__.get("_running", False))

    @engines_running.setter
    def engines_running(self, running: bool) -> None:
        was = self.__dict__.get("_running", False)
        self.__dict__.setdefault("running_history", []).append(running)
        self.__dict__["_running"] = running
        self._view_changed()
        if was and not running and self.on_wave_end is not None:
            self.on_wave_end()

    def _view_changed(self) -> None:
        changed = self.__dict__.get("view_changed")
        if changed is not None:
            changed.set()

    def watch_view(self) -> asyncio.Event:
        """An event set when the stats task next assigns the view (a publish arrived)."""
        changed = self.__dict__["view_changed"] = asyncio.Event()
        return changed


class Load:
    """Sends requests and tracks every one to its end."""

    def __init__(self, client: RecordingClient, rng: random.Random) -> None:
        self.client = client
        self.rng = rng
        self.sent: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.finished: dict[str, str] = {}
        self.rejected: list[str] = []
        self.waiters: dict[str, asyncio.Event] = {}
        self.counter = 0
        self.stamped_waves: list[int] = []
        self.extra_sent = 0
        self.progress = asyncio.Event()

    async def send(self, max_tokens: int) -> str:
        self.counter += 1
        request_id = f"req-{self.counter}"
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=[1, 2, 3],
            mm_features=None,
            sampling_params=SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        self.sent[request_id] = max_tokens
        self.tokens[request_id] = 0
        self.waiters[request_id] = asyncio.Event()
        await self.client.add_request_async(request)
        self.stamped_waves.append(request.current_wave)
        return request_id

    async def burst(self, count: int, low: int, high: int) -> list[str]:
        return [await self.send(self.rng.randint(low, high)) for _ in range(count)]

    async def pump_outputs(self) -> None:
        while True:
            outputs = await self.client.get_output_async()
            for output in outputs.outputs:
                request_id = output.request_id
                self.tokens[request_id] += len(output.new_token_ids)
                reason = output.finish_reason
                if reason is None:
                    continue
                if (
                    reason == FinishReason.ERROR
                    and output.error is not None
                    and (output.error.code == "engine_paused")
                ):
                    self.rejected.append(request_id)
                self.finished[request_id] = FinishReason(reason).name
                self.waiters[request_id].set()
            self.progress.set()

    async def wait_all(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            await self.waiters[request_id].wait()


async def run_scenario(
    spec: dict[str, Any], report: dict[str, Any], startup_done: threading.Event
) -> None:
    vllm_config = make_vllm_config({**spec, "rank": "frontend"})
    client = RecordingClient(
        vllm_config,
        StandInExecutor,
        False,
        client_addresses={
            "input_address": spec["input_address"],
            "output_address": spec["output_address"],
            "stats_update_address": spec["stats_address"],
        },
    )
    report["stage"] = "client ready"
    rng = random.Random(spec.get("seed", 1))
    load = Load(client, rng)
    pump = asyncio.create_task(load.pump_outputs())
    timeout = float(spec["timeout"])

    async def guarded(awaitable: Awaitable[T]) -> T:
        """``awaitable`` within the timeout, ended early if the output pump fails (e.g.
        EngineDeadError: an engine died), whose error then ends the scenario."""
        task = asyncio.ensure_future(awaitable)
        done, _ = await asyncio.wait({task, pump}, timeout=timeout, return_when="FIRST_COMPLETED")
        if task in done:
            return task.result()
        task.cancel()
        if pump in done:
            pump.result()
            raise RuntimeError("the front-end's output pump stopped")
        raise TimeoutError(f"{awaitable!r} took more than {timeout} s")

    pending_extra: list[asyncio.Task[str]] = []
    if spec.get("requests_at_wave_end"):

        def fire() -> None:
            if load.extra_sent < spec["requests_at_wave_end"]:
                load.extra_sent += 1
                pending_extra.append(asyncio.ensure_future(load.send(rng.randint(1, 4))))

        client.on_wave_end = fire
    try:
        # requests only once vLLM's handshake saw every engine READY, as vLLM's launcher
        if not await asyncio.to_thread(startup_done.wait, timeout):
            raise TimeoutError("the engines' startup handshake did not complete")
        for index, burst in enumerate(spec["bursts"]):
            ids = await load.burst(burst["count"], burst["min_tokens"], burst["max_tokens"])
            pause = burst.get("pause")
            if pause is not None:
                report["stage"] = f"pause {pause} at burst {index}"
                await guarded(wait_for_tokens(load, ids))
                await guarded(client.pause_generation_async(mode=pause, clear_cache=True))
                if pause == "keep":
                    ids += await load.burst(2, 1, 3)  # queued while paused, not rejected
                    # outputs sent before the pause completed are already received (each
                    # engine's outputs precede its pause result); let the pump take them
                    await asyncio.sleep(0.1)
                    frozen = dict(load.tokens)
                    await asyncio.sleep(0.3)
                    report.setdefault("progress_while_paused", []).append(
                        {k: load.tokens[k] - v for k, v in frozen.items() if load.tokens[k] != v}
                    )
                else:
                    ids += await load.burst(1, 1, 3)  # rejected: generation is paused
                await guarded(client.resume_scheduler_async())
            report["stage"] = f"burst {index}"
            await guarded(load.wait_all(ids))
            await asyncio.sleep(rng.uniform(*burst.get("gap", (0.0, 0.05))))
        await guarded(load.wait_all(await asyncio.gather(*pending_extra)))
        report["stage"] = "waiting for the last wave's end to be published"
        await guarded(wait_for_published_end(client, report))
        report["stage"] = "done"
    finally:
        pump.cancel()
        report.update(
            sent=load.sent,
            finished=load.finished,
            tokens=load.tokens,
            rejected=load.rejected,
            extra_sent=load.extra_sent,
            stamped_waves=load.stamped_waves,
            wave_history=client.__dict__.get("wave_history", []),
            running_history=client.__dict__.get("running_history", []),
            final_engines_running=client.engines_running,
        )
        client.shutdown()


async def wait_for_published_end(client: RecordingClient, report: dict[str, Any]) -> None:
    """Until the coordinator's publishes show the engines paused at the wave they are
    really paused at, after the last request finished.

    The last wave ends when the engines have nothing left, and the front-end learns it
    from the coordinator's publishes, which travel another path than the engines' outputs
    (engine -> coordinator -> front-end): a "paused" already seen when the last output
    arrives may be the previous wave's end, published before this wave's start reached
    the coordinator. So each time the view says paused, the engines are asked (vLLM's
    utility path, answered between two steps) for their own ``(current_wave,
    engines_running)``; it is over when every engine is paused at the view's wave. Rank
    0 reports every wave end to the coordinator before it answers, so until then a
    publish is still to come: wait for it (no polling; the caller bounds the wait).
    """
    probes = report.setdefault("end_probes", [])
    while True:
        changed = client.watch_view()  # before the probe: a publish during it counts
        if not client.engines_running:
            answers = await client.call_utility_all_async(
                "collective_rpc", DP_WAVE_STATE_RPC, None, (), None
            )
            engines = [tuple(workers[0]) for workers in answers]
            view = (client.current_wave, client.engines_running)  # as of the answers
            probes.append({"view": view, "engines": engines})
            if not view[1] and all(state == view for state in engines):
                return
        await changed.wait()


async def wait_for_tokens(load: Load, ids: list[str]) -> None:
    """Until some of ``ids`` produced a token (so the pause lands mid-flight)."""
    while not any(load.tokens[i] for i in ids):
        load.progress.clear()
        await load.progress.wait()


def handshake(spec: dict[str, Any], report: dict[str, Any], done: threading.Event) -> None:
    """vLLM's engine startup handshake, as its launcher runs it."""
    try:
        vllm_config = make_vllm_config({**spec, "rank": "launcher"})
        addresses = EngineZmqAddresses(
            inputs=[spec["input_address"]],
            outputs=[spec["output_address"]],
            coordinator_input=spec["coordinator_input"],
            coordinator_output=spec["coordinator_output"],
            frontend_stats_publish_address=spec["stats_address"],
        )
        launch = CoreEngineLaunch(None, None, addresses, None)
        engines = [CoreEngine(index=i, local=True) for i in range(spec["dp_size"])]
        with zmq_socket_ctx(spec["handshake_address"], zmq.ROUTER, bind=True) as socket:
            wait_for_engine_startup(
                socket, engines, vllm_config.parallel_config, True, vllm_config.cache_config, launch
            )
        report["handshake"] = "all engines READY"
        report["handshake_done_at"] = time.time()
        done.set()
    except BaseException as exc:
        report["handshake"] = "".join(traceback.format_exception(exc))


def main() -> int:
    spec = json.loads(sys.argv[1])
    report: dict[str, Any] = {"exception": None}
    import vllm

    tracer = CallTracer(str(Path(vllm.__file__).parent.parent))
    tracer.start()
    startup_done = threading.Event()
    thread = threading.Thread(target=handshake, args=(spec, report, startup_done), daemon=True)
    thread.start()
    try:
        scenario = run_scenario(spec, report, startup_done)
        asyncio.run(asyncio.wait_for(scenario, spec["total_timeout"]))
    except BaseException as exc:
        report["exception"] = "".join(traceback.format_exception(exc))
    tracer.stop()
    report["called"] = tracer.called()
    Path(spec["report_path"]).write_text(json.dumps(report, indent=1))
    return 0 if report["exception"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
