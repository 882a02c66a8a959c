"""examples/http_frontend.py as a user runs it: a real HTTP client against the
trio web front-end that embeds the coordinator, its simulated engine processes behind it.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from trio_dpcoord.testing import ServeProcess, open_child

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "http_frontend.py"
GUARD = 120.0  # a web server and engine processes on a shared 2-core machine


@dataclass
class Server:
    child: ServeProcess
    url: str
    engine_pids: list[int]

    @property
    def process(self) -> trio.Process:
        return self.child.process

    async def stop(self, signum: int) -> None:
        self.process.send_signal(signum)
        await self.exited_cleanly()

    async def exited_cleanly(self) -> None:
        """The front-end exits 0 and its engine processes are gone."""
        await self.process.wait()
        assert self.process.returncode == 0, self.child.stderr
        assert all(_gone(pid) for pid in self.engine_pids)


@asynccontextmanager
async def http_frontend(*args: str) -> AsyncIterator[Server]:
    """Start the example on port 0 and read its first stdout line; always reaped."""
    command = [sys.executable, str(EXAMPLE), "--port=0", "--exit-on-stdin-eof", *args]
    async with open_child(command) as child:
        started = json.loads(await child.line(0))
        yield Server(child, started["url"], started["engine_pids"])


def expected_text(tokens: int) -> str:
    return "".join(f" tok{i}" for i in range(1, tokens + 1))


async def complete(client: httpx.AsyncClient, max_tokens: int) -> dict[str, Any]:
    response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def stream(client: httpx.AsyncClient, max_tokens: int) -> list[Any]:
    """The decoded ``data:`` events of one streamed completion, ``"[DONE]"`` included."""
    events: list[Any] = []
    request = {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
    async with client.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def check_stream(events: list[Any], max_tokens: int) -> int:
    """One token per event, in order, the last one finished by length; returns the wave."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["choices"][0]["text"] for c in chunks] == [
        f" tok{i}" for i in range(1, max_tokens + 1)
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (max_tokens - 1) + [
        "length"
    ]
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    assert len({c["id"] for c in chunks}) == 1
    wave: int = chunks[0]["dp_wave"]
    return wave


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


async def until_idle(
    client: httpx.AsyncClient,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Scrape until the coordinator says the engines are paused (the wave ended)."""
    while True:
        metrics = await scrape(client)
        if metrics[("trio_dpcoord_engines_running", ())] == 0:
            return metrics
        await trio.sleep(0.05)


async def hang_up_after_first_token(url: str) -> None:
    host, port = httpx.URL(url).host, httpx.URL(url).port
    assert port is not None
    body = json.dumps({"prompt": "hi", "max_tokens": 4000, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    async with await trio.open_tcp_stream(host, port) as stream:
        await stream.send_all(head.encode() + body)
        received = b""
        while b"data: " not in received:
            chunk = await stream.receive_some()
            assert chunk, received
            received += chunk
    assert received.startswith(b"HTTP/1.1 200")


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


async def test_completions_stream_and_idle_gaps_start_new_waves() -> None:
    with trio.fail_after(GUARD):
        async with http_frontend("--engines=2", "--step-time=0.005") as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                waves: list[set[int]] = []
                tokens_sent = 0
                for burst in range(2):
                    seen: set[int] = set()

                    async def one_stream(n: int, seen: set[int] = seen) -> None:
                        seen.add(check_stream(await stream(client, n), n))

                    async def one_json(n: int, seen: set[int] = seen) -> None:
                        body = await complete(client, n)
                        choice = body["choices"][0]
                        assert choice["text"] == expected_text(n)
                        assert choice["finish_reason"] == "length"
                        assert body["usage"]["completion_tokens"] == n
                        seen.add(body["dp_wave"])

                    async with trio.open_nursery() as nursery:
                        for n in (3, 7, 12):
                            nursery.start_soon(one_stream, n + burst)
                            nursery.start_soon(one_json, n + burst + 1)
                            tokens_sent += 2 * (n + burst) + 1
                    waves.append(seen)
                    # The idle gap: the engines finish the wave and pause.
                    metrics = await until_idle(client)
                    assert metrics[("trio_dpcoord_current_wave", ())] > max(seen)
                # Requests after an idle gap are stamped with a newer wave.
                assert min(waves[1]) > max(waves[0])
                assert metrics[("trio_dpcoord_waves_completed_total", ())] >= 2
                starts = sum(
                    v
                    for (name, _), v in metrics.items()
                    if name == "trio_dpcoord_wave_starts_total"
                )
                assert starts >= 2  # each burst woke the paused engines
                assert metrics[("trio_dpcoord_engine_subscriptions", ())] == 2
                # The front-end's own metrics share the registry.
                completed = "http_frontend_completion_requests_total"
                assert metrics[(completed, (("outcome", "completed"), ("stream", "true")))] == 6
                assert metrics[(completed, (("outcome", "completed"), ("stream", "false")))] == 6
                assert metrics[("http_frontend_completion_tokens_total", ())] == tokens_sent

                bad = await client.post("/v1/completions", json={"max_tokens": 0})
                assert bad.status_code == 400
                assert "max_tokens" in bad.json()["error"]["message"]
                assert (await client.get("/nowhere")).status_code == 404
                models = (await client.get("/v1/models")).json()
                assert [m["id"] for m in models["data"]] == ["sim-moe"]

                # A client that goes away mid-stream (a bare socket: an HTTP client library
                # would finish the response): its request is aborted on the engine.
                await hang_up_after_first_token(server.url)
                while True:
                    health = (await client.get("/health")).json()
                    if health["in_flight"] == 0:
                        break
                    await trio.sleep(0.05)
                metrics = await scrape(client)
                assert metrics[(completed, (("outcome", "disconnected"), ("stream", "true")))] == 1
            await server.stop(signal.SIGINT)
        # A normal shutdown reads as one: the signal and the engines' going are told at
        # INFO, so at the default level (WARNING) it writes nothing at all.
        assert server.child.stderr == ""


async def test_shutdown_cuts_streams_in_flight_with_an_error_and_reaps_the_engines() -> None:
    with trio.fail_after(GUARD):
        async with http_frontend("--engines=2", "--step-time=0.01", "--drain-timeout=1") as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                request = {"prompt": "hi", "max_tokens": 4000, "stream": True}
                events: list[Any] = []
                async with client.stream("POST", "/v1/completions", json=request) as response:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line.removeprefix("data: ")
                        events.append(data if data == "[DONE]" else json.loads(data))
                        if len(events) == 3:  # streaming for sure: stop the server
                            server.process.send_signal(signal.SIGTERM)
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["type"] == "server_shutdown"
            tokens = [e["choices"][0]["text"] for e in events[:-2]]
            assert 3 <= len(tokens) < 4000
            assert tokens == [f" tok{i}" for i in range(1, len(tokens) + 1)]
            await server.exited_cleanly()


async def test_engine_client_mode_serves_simulated_engine_core_processes() -> None:
    """--engines-from sim: simulated engine processes speaking vLLM's engine-core protocol,
    served through open_engine_client (the code path of --engines-from vllm)."""
    with trio.fail_after(GUARD):
        async with http_frontend("--engines=3", "--engines-from=sim") as server:
            assert len(server.engine_pids) == 3
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                response = await client.post(
                    "/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 4}
                )
                assert response.status_code == 200, response.text
                choice = response.json()["choices"][0]
                assert choice["token_ids"] == [1, 2, 3, 4]
                assert choice["text"] == expected_text(4)
                assert choice["finish_reason"] == "length"
                events = await stream(client, 3)
                assert events[-1] == "[DONE]"
                assert [e["choices"][0]["token_ids"] for e in events[:-1]] == [[1], [2], [3]]
                assert events[-2]["choices"][0]["finish_reason"] == "length"
                # the client's coordinator sees the engines and their waves
                metrics = await until_idle(client)
                assert metrics[("trio_dpcoord_engine_subscriptions", ())] == 3
                assert metrics[("trio_dpcoord_waves_completed_total", ())] >= 1
            await server.stop(signal.SIGTERM)
        # stopping the engines on purpose is no outage: nothing at WARNING
        assert server.child.stderr == ""
