"""The engine client over real sockets, against protocol engines written here.

Each ``_Engine`` speaks vLLM's engine side of the engine-core protocol as 0.32.0/0.33.0's
``EngineCoreProc`` does (docs/protocol.md §14): HELLO on a DEALER with its two-byte
identity, the answer's addresses used as given (a DEALER to the input with the ready
response first, a PUSH to its output, the coordinator's XSUB and PUSH), READY; then it
answers ADD with one token per step, ABORT with nothing (as vLLM), UTILITY with
``[call_id, None, [None, result]]``. Real vLLM engines run in test_engine_client_real.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
import trio
import zmq

from tests.vllm_real import free_port
from trio_dpcoord import (
    EngineDeadError,
    EngineStartupError,
    RequestAbortedError,
    SamplingParams,
    UtilityCallError,
    open_engine_client,
)
from trio_dpcoord.engine_protocol import engine_identity
from trio_dpcoord.trio_zmq import AsyncSocket, open_context, open_socket

TIMEOUT = 60.0


class _Engine:
    """One protocol engine; ``stalled`` stops it from answering anything."""

    def __init__(self, rank: int, handshake: str) -> None:
        self.rank = rank
        self.handshake = handshake
        self.stalled = False
        self.requests: dict[str, int] = {}  # id -> tokens still to send
        self.aborted: list[str] = []
        self._aborts = trio.Event()
        self.cancel = trio.CancelScope()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        identity = engine_identity(self.rank)
        task_status.started()
        with self.cancel:
            async with open_context() as ctx:
                options: dict[int, int | bytes] = {zmq.IDENTITY: identity}
                async with open_socket(
                    ctx, zmq.DEALER, connect=self.handshake, options=options
                ) as hs:
                    await hs.send(
                        msgpack.packb({"status": "HELLO", "local": False, "headless": True})
                    )
                    answer = msgpack.unpackb(await hs.recv())
                    addresses = answer["addresses"]
                    async with (
                        open_socket(
                            ctx, zmq.DEALER, connect=addresses["inputs"][0], options=options
                        ) as inp,
                        open_socket(ctx, zmq.PUSH, connect=addresses["outputs"][0]) as out,
                        open_socket(ctx, zmq.XSUB, connect=addresses["coordinator_input"]) as sub,
                        open_socket(ctx, zmq.PUSH, connect=addresses["coordinator_output"]),
                    ):
                        await sub.send(b"\x01")
                        await inp.send(
                            msgpack.packb({"data_parallel_rank": self.rank, "vllm_version": "test"})
                        )
                        assert await sub.recv() == b"READY"
                        await hs.send(
                            msgpack.packb(
                                {
                                    "status": "READY",
                                    "local": False,
                                    "headless": True,
                                    "parallel_config_hash": "h",
                                }
                            )
                        )
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(self._steps, out)
                            await self._inputs(inp, out)

    async def _inputs(self, inp: AsyncSocket, out: AsyncSocket) -> None:
        while True:
            kind, payload = await inp.recv_multipart()
            body = msgpack.unpackb(payload)
            if self.stalled:
                continue
            if kind == b"\x00":
                self.requests[body[0]] = body[3].get("max_tokens", 16)
            elif kind == b"\x01":
                for rid in body:
                    if self.requests.pop(rid, None) is not None:
                        self.aborted.append(rid)  # vLLM sends nothing back
                        self._aborts.set()
                        self._aborts = trio.Event()
            elif kind == b"\x03":
                _, call_id, method, args = body
                if method == "echo":
                    answer: list[Any] = [call_id, None, [None, args]]
                else:
                    answer = [call_id, f"no method {method}", None]
                await out.send(_outputs(self.rank, [], answer))

    async def wait_aborted(self, request_id: str) -> None:
        while request_id not in self.aborted:
            await self._aborts.wait()

    async def _steps(self, out: AsyncSocket) -> None:
        while True:
            await trio.sleep(0.01)
            if self.stalled or not self.requests:
                continue
            items = []
            for rid in list(self.requests):
                self.requests[rid] -= 1
                done = self.requests[rid] == 0
                items.append([rid, [self.rank + 10], None, None, None, 1 if done else None])
                if done:
                    del self.requests[rid]
            await out.send(_outputs(self.rank, items))


def _outputs(rank: int, items: list[Any], utility: Any = None) -> bytes:
    packed: bytes = msgpack.packb([rank, items, None, 0.0, utility])
    return packed


@asynccontextmanager
async def _fleet(count: int, **options: Any) -> AsyncIterator[tuple[Any, list[_Engine]]]:
    address = f"tcp://127.0.0.1:{free_port()}"
    engines = [_Engine(rank, address) for rank in range(count)]
    async with trio.open_nursery() as nursery:
        for engine in engines:
            await nursery.start(engine.run)
        async with open_engine_client(count, address, **options) as client:
            yield client, engines
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_requests_stream_utility_calls_and_aborts() -> None:
    with trio.fail_after(TIMEOUT):
        async with _fleet(2) as (client, engines):
            assert sorted(client.ready_responses) == [0, 1]
            done = [await client.complete([1, 2], SamplingParams(max_tokens=3)) for _ in range(4)]
            assert {d.engine_index for d in done} == {0, 1}
            for d in done:
                assert d.token_ids == (d.engine_index + 10,) * 3 and d.finish_reason == "length"
            pinned = await client.complete([1], SamplingParams(max_tokens=2), engine_index=1)
            assert pinned.engine_index == 1
            assert await client.call_utility("echo", 1, "a", engine_index=1) == [1, "a"]
            assert await client.call_utility_all("echo") == [[], []]
            with pytest.raises(UtilityCallError, match="no method nope"):
                await client.call_utility("nope")
            # a stream left early is aborted on its engine
            async with client.generate(
                [5], SamplingParams(max_tokens=1000), engine_index=0
            ) as stream:
                async for _ in stream:
                    break
            assert client.in_flight() == []
            with trio.fail_after(TIMEOUT):
                await engines[0].wait_aborted(stream.request_id)
            # abort by id: the stream ends at once, the engine drops the request
            async with client.generate([5], SamplingParams(max_tokens=1000)) as stream:
                async for output in stream:
                    if not output.finished:
                        await client.abort(stream.request_id)
            assert stream.finish_reason == "abort"
            await engines[stream.engine_index or 0].wait_aborted(stream.request_id)
            # a reader that falls behind is aborted, not buffered without end
            async with client.generate([5], SamplingParams(max_tokens=1000), buffer=2) as slow:
                await engines[slow.engine_index or 0].wait_aborted(slow.request_id)
                with pytest.raises(RequestAbortedError, match="fell 2 outputs behind"):
                    async for _ in slow:
                        pass
            assert client.in_flight() == [] and client.statistics().calls_pending == 0


@pytest.mark.trio
async def test_the_rest_of_a_stream_is_gathered_and_read_at_its_end() -> None:
    with trio.fail_after(TIMEOUT):
        async with _fleet(2) as (client, _):
            params = SamplingParams(max_tokens=6)
            # buffer=1: a reader of every output one behind would be aborted; the rest is
            # gathered as it comes, never buffered
            async with client.generate([1], params, engine_index=1, buffer=1) as stream:
                first = await stream.__anext__()
                assert first.new_token_ids == (11,) and not first.finished
                rest = await stream.rest()
                assert rest == (11,) * 5 and stream.finish_reason == "length"
                assert [output async for output in stream] == []
                with pytest.raises(RuntimeError, match="taken once"):
                    await stream.rest()
            # the whole request through rest alone is what complete() returns
            async with client.generate([1], params, engine_index=0) as whole:
                assert await whole.rest() == (10,) * 6
            with pytest.raises(RuntimeError, match="enter the stream"):
                await client.generate([1], params).rest()
            stats = client.statistics()
            assert stats.requests_in_flight == stats.streams_open == stats.requests_aborted == 0


@pytest.mark.trio
async def test_prefix_routing_sends_a_conversation_back_to_its_rank() -> None:
    with trio.fail_after(TIMEOUT):
        async with _fleet(2, routing="prefix") as (client, _engines):
            assert client.chooser.routing == "prefix"
            history = list(range(100, 164))  # four blocks of 16
            params = SamplingParams(max_tokens=2)
            first = await client.complete(history, params)
            turns = [await client.complete([*history, *range(n)], params) for n in (16, 32)]
            assert {t.engine_index for t in turns} == {first.engine_index}
            pinned = await client.complete(
                list(range(900, 964)), params, engine_index=1 - first.engine_index
            )
            again = await client.complete([*range(900, 964), 7], params)
            assert again.engine_index == pinned.engine_index == 1 - first.engine_index
            counters = client.chooser.statistics().router
            assert counters is not None and counters.decisions == 5
            assert counters.cached_tokens == 64 + 80 + 0 + 64


@pytest.mark.trio
async def test_a_dead_engine_fails_only_its_own_work() -> None:
    with trio.fail_after(TIMEOUT):
        async with _fleet(2) as (client, engines):
            async with (
                client.generate([1], SamplingParams(max_tokens=10**6), engine_index=1) as doomed,
                client.generate([1], SamplingParams(max_tokens=50), engine_index=0) as survivor,
            ):
                async for _ in doomed:
                    break
                engines[1].cancel.cancel()  # its sockets close, as a killed process's do
                with pytest.raises(EngineDeadError) as failure:
                    async for _ in doomed:
                        pass
                assert failure.value.engine_index == 1
                assert [len(o.new_token_ids) async for o in survivor] == [1] * 50
            assert client.statistics().dead_engines == {1}
            assert (await client.complete([2], SamplingParams(max_tokens=2))).engine_index == 0
            with pytest.raises(EngineDeadError, match="rank 1"):
                await client.call_utility("echo", engine_index=1)


@pytest.mark.trio
async def test_a_silent_engine_is_taken_as_dead() -> None:
    with trio.fail_after(TIMEOUT):
        async with _fleet(2, silence_timeout=1.0) as (client, engines):
            engines[0].stalled = True
            with pytest.raises(EngineDeadError, match=r"engine rank 0 is gone \(silent"):
                await client.complete([1], SamplingParams(max_tokens=5), engine_index=0)
            assert (await client.complete([1], SamplingParams(max_tokens=2))).engine_index == 1


@pytest.mark.trio
async def test_an_engine_idle_longer_than_the_silence_timeout_is_not_taken_as_dead() -> None:
    """Silence counts only while work waits: a rank idle for longer than the timeout
    gets its clock restarted by its next request (and by a utility call)."""
    with trio.fail_after(TIMEOUT):
        async with _fleet(2, silence_timeout=1.0) as (client, _):
            assert (
                await client.complete([1], SamplingParams(max_tokens=2), engine_index=0)
            ).engine_index == 0
            await trio.sleep(1.5)  # idle: nothing in flight, nothing heard
            again = await client.complete([1], SamplingParams(max_tokens=2), engine_index=0)
            assert again.finish_reason == "length"
            await trio.sleep(1.5)
            assert await client.call_utility("echo", 7, engine_index=0) == [7]
            assert client.statistics().dead_engines == frozenset()


@pytest.mark.trio
async def test_startup_timeout_names_the_missing_ranks() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(_Engine(1, address).run)
            with pytest.raises(
                EngineStartupError, match=r"never said HELLO: ranks \[0, 2\]"
            ) as err:
                async with open_engine_client(3, address, startup_timeout=3.0):
                    pass
            assert err.value.missing == [0, 1, 2]  # rank 1 waits for the gate of all 3
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_http_frontend_serves_engines_through_the_client() -> None:
    """examples/http_frontend.py --engine-client: an HTTP completion with token-id prompt
    reaches the engines (their token ids come back), a stream ends with [DONE], SIGTERM
    exits 0."""
    import json
    import signal
    import sys
    from pathlib import Path

    import httpx

    from trio_dpcoord.testing import open_child

    example = Path(__file__).resolve().parents[2] / "examples" / "http_frontend.py"
    address = f"tcp://127.0.0.1:{free_port()}"
    engines = [_Engine(rank, address) for rank in range(2)]
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for engine in engines:
                await nursery.start(engine.run)
            command = [sys.executable, str(example), "--port=0", "--exit-on-stdin-eof"]
            command += ["--engines=2", f"--engine-client={address}"]
            async with open_child(command) as child:
                url = json.loads(await child.line(0))["url"]
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    body = {"prompt": [3, 4, 5], "max_tokens": 4}
                    response = await http.post("/v1/completions", json=body)
                    assert response.status_code == 200, response.text
                    choice = response.json()["choices"][0]
                    assert choice["finish_reason"] == "length"
                    assert choice["token_ids"] in ([10] * 4, [11] * 4)
                    events = []
                    body = {"prompt": "text", "max_tokens": 3, "stream": True}
                    async with http.stream("POST", "/v1/completions", json=body) as sse:
                        async for line in sse.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                    assert events[-1] == "[DONE]" and len(events) == 4
                child.process.send_signal(signal.SIGTERM)
                await child.process.wait()
                assert child.process.returncode == 0, child.stderr
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_pinned_request_leaves_the_chosen_requests_counts_alone() -> None:
    """vLLM's routing counts only the requests it placed: a pinned request that ends on
    the same rank must not release the count of a chosen one still running there."""
    with trio.fail_after(TIMEOUT):
        async with _fleet(2) as (client, _):
            async with client.generate([1], SamplingParams(max_tokens=10**6)) as chosen:
                await chosen.__anext__()
                assert client.chooser.statistics().inflight[chosen.engine_index] == 1
                pinned = await client.complete(
                    [2], SamplingParams(max_tokens=2), engine_index=chosen.engine_index
                )
                assert pinned.finish_reason == "length"
                assert client.chooser.statistics().inflight[chosen.engine_index] == 1
            assert client.chooser.statistics().inflight == (0, 0)
