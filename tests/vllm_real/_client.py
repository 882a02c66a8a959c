"""Completions against a real ``vllm serve``, prompts as token ids (there is no tokenizer)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from ._server import MODEL_NAME


def completion_body(prompt: list[int], max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    """A greedy completion of exactly ``max_tokens`` tokens that returns their ids."""
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


@dataclass(frozen=True)
class Completion:
    status: int
    token_ids: list[int]
    error: str = ""


async def complete(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> Completion:
    """POST /v1/completions; the status and the completion's token ids (or the error)."""
    response = await client.post("/v1/completions", json=completion_body(prompt, max_tokens))
    if response.status_code != 200:
        return Completion(response.status_code, [], response.text[:500])
    choice = response.json()["choices"][0]
    return Completion(200, list(choice["token_ids"]))


async def stream_then_drop(
    base_url: str, prompt: list[int], max_tokens: int, keep_chunks: int
) -> int:
    """Stream a completion of ``max_tokens`` tokens and close the TCP connection after
    ``keep_chunks`` server-sent chunks with tokens (a client going away mid-way, as a
    browser tab closed); the chunks read. HTTP/1.1 by hand over a trio TCP stream, so
    that nothing is left half-read when the connection goes."""
    url = httpx.URL(base_url)
    body = json.dumps(completion_body(prompt, max_tokens, stream=True)).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    received = b""
    stream = await trio.open_tcp_stream(url.host, url.port or 80)
    async with stream:
        await stream.send_all(head + body)
        while received.count(b'"token_ids":[') < keep_chunks:
            data = await stream.receive_some(65536)
            if not data:
                raise ConnectionError(f"the stream ended early: {received[-300:]!r}")
            received += data
        if not received.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(f"not a 200 response: {received[:300]!r}")
    return keep_chunks


async def metric_values(client: httpx.AsyncClient, name: str) -> dict[str, float]:
    """The samples of one Prometheus metric from ``/metrics``: labels text -> value."""
    response = await client.get("/metrics")
    response.raise_for_status()
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


@dataclass(frozen=True)
class Streamed:
    """A streamed completion: status, token ids, and seconds to the first token and to the
    end (from sending the request)."""

    status: int
    token_ids: list[int]
    ttft_s: float
    total_s: float
    error: str = ""


async def stream_completion(
    client: httpx.AsyncClient,
    prompt: list[int],
    max_tokens: int,
    *,
    headers: dict[str, str] | None = None,
) -> Streamed:
    """POST /v1/completions with ``stream: true``; the token ids as they came, the time to
    the first chunk with tokens (TTFT) and to the end of the stream."""
    started = trio.current_time()
    first: float | None = None
    tokens: list[int] = []
    body = completion_body(prompt, max_tokens, stream=True)
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            elapsed = trio.current_time() - started
            return Streamed(response.status_code, [], elapsed, elapsed, text[:500])
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", ()):
                ids = choice.get("token_ids") or ()
                if ids and first is None:
                    first = trio.current_time() - started
                tokens.extend(ids)
    total = trio.current_time() - started
    return Streamed(200, tokens, first if first is not None else total, total)
