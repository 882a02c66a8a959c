"""Completions against a real ``vllm serve``, prompts as token ids (there is no tokenizer)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

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
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int, keep_chunks: int
) -> int:
    """Stream a completion of ``max_tokens`` tokens and close the connection after
    ``keep_chunks`` chunks with tokens (a client going away mid-way); the chunks read."""
    read = 0
    body = completion_body(prompt, max_tokens, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                read += 1
            if read >= keep_chunks:
                break  # leaving the block closes the connection: vLLM aborts the request
    return read


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
