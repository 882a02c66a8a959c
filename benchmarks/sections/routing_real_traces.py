"""The traces of the ``routing_real`` section (:mod:`benchmarks.sections.routing_real`):
sessions of turns (multi-turn, shared documents, no reuse) and a Mooncake-format replay on
its timestamps, as token ids, with the sizes of the model and server they are made for."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.vllm_real import VOCAB_SIZE

MOONCAKE_BLOCK = 512
"""Tokens per hash id in the Mooncake trace format."""
RANK_HEADER = "X-data-parallel-rank"


@dataclass(frozen=True)
class Sizes:
    """The engines' and traces' sizes (the defaults are the measured run's)."""

    dp: int = 2
    block_size: int = 32  # the CPU attention backend takes multiples of 32
    max_model_len: int = 4224
    kv_blocks: int = 1024
    """Per engine (``--num-gpu-blocks-override``): 32,768 tokens, more than half of each
    reuse trace's working set (what one engine holds when a prefix lives on one engine)
    and less than all of it (what each engine would need if every prefix went
    everywhere)."""
    batched_tokens: int = 2048
    max_num_seqs: int = 8
    concurrency: int = 4
    output_tokens: int = 16
    sessions: int = 16
    turns: int = 5
    system_tokens: int = 512
    user_tokens: tuple[int, int] = (400, 700)
    documents: int = 16
    document_tokens: tuple[int, int] = (2048, 3072)
    readers: int = 64
    question_tokens: tuple[int, int] = (64, 128)
    many_documents: int = 12
    many_document_tokens: tuple[int, int] = (3584, 4000)
    """About 45,000 tokens in all: 1.4 times one engine's cache, 0.7 times in each
    engine's half (with a few requests' working blocks beside them)."""
    many_readers: int = 192
    unrelated: int = 40
    unrelated_tokens: tuple[int, int] = (1024, 4000)
    mooncake_output_cap: int = 64
    mooncake_time_scale: float = 1.0


@dataclass(frozen=True)
class Turn:
    user: list[int]
    output_len: int


@dataclass(frozen=True)
class Session:
    """Turns sent one after another, each resending the history (earlier turns and the
    model's replies) when ``history`` is set; ``key`` picks the pinned control's rank."""

    key: int
    turns: list[Turn]
    history: bool = True


@dataclass(frozen=True)
class Timed:
    at_s: float
    prompt: list[int]
    output_len: int
    key: int


@dataclass
class Trace:
    name: str
    sessions: list[Session] = field(default_factory=list)
    timed: list[Timed] = field(default_factory=list)


def vocab_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(count)]


def multi_turn(seed: int, sizes: Sizes) -> Trace:
    rng = random.Random(f"multi-turn-{seed}")
    system = vocab_tokens(rng, sizes.system_tokens)
    sessions = []
    for number in range(sizes.sessions):
        turns = [
            Turn(vocab_tokens(rng, rng.randint(*sizes.user_tokens)), sizes.output_tokens)
            for _ in range(sizes.turns)
        ]
        turns[0] = Turn(system + turns[0].user, sizes.output_tokens)
        sessions.append(Session(number, turns))
    return Trace("multi-turn", sessions=sessions)


def shared_docs(seed: int, sizes: Sizes, *, many: bool = False) -> Trace:
    name = "shared-docs-many" if many else "shared-docs"
    rng = random.Random(f"{name}-{seed}")
    count = sizes.many_documents if many else sizes.documents
    lengths = sizes.many_document_tokens if many else sizes.document_tokens
    docs = [vocab_tokens(rng, rng.randint(*lengths)) for _ in range(count)]
    readers = []
    for _ in range(sizes.many_readers if many else sizes.readers):
        doc = rng.randrange(len(docs))
        question = vocab_tokens(rng, rng.randint(*sizes.question_tokens))
        readers.append(Session(doc, [Turn(docs[doc] + question, sizes.output_tokens)], False))
    return Trace(name, sessions=readers)


def no_reuse(seed: int, sizes: Sizes) -> Trace:
    rng = random.Random(f"no-reuse-{seed}")
    return Trace(
        "no-reuse",
        sessions=[
            Session(
                number,
                [
                    Turn(
                        vocab_tokens(rng, rng.randint(*sizes.unrelated_tokens)),
                        sizes.output_tokens,
                    )
                ],
                False,
            )
            for number in range(sizes.unrelated)
        ],
    )


def write_mooncake_sample(path: Path, seed: int, *, conversations: int = 12) -> Path:
    """A small Mooncake-format trace: conversations (a shared 1-block system prompt, then
    turns that extend the history by 1-2 blocks), arriving over about 40 s."""
    rng = random.Random(f"mooncake-{seed}")
    next_id = 1
    rows: list[dict[str, Any]] = []
    for _ in range(conversations):
        ids = [0]
        at = rng.uniform(0, 12_000)
        for _ in range(rng.randint(3, 5)):
            for _ in range(rng.randint(1, 2)):
                ids.append(next_id)
                next_id += 1
            if len(ids) > 8:
                break
            length = MOONCAKE_BLOCK * (len(ids) - 1) + rng.randint(64, MOONCAKE_BLOCK)
            rows.append(
                {
                    "timestamp": int(at),
                    "input_length": length,
                    "output_length": rng.randint(8, 48),
                    "hash_ids": list(ids),
                }
            )
            at += rng.uniform(4_000, 9_000)
    rows.sort(key=lambda row: row["timestamp"])
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def mooncake(path: Path, seed: int, sizes: Sizes) -> Trace:
    """Replay ``path`` (Mooncake JSONL): a prompt is its hash ids' 512-token blocks (the
    same id, the same tokens), cut to ``input_length`` and padded with tokens of its own;
    lengths are clipped to the model (``max_model_len``), outputs to
    ``mooncake_output_cap``, and times scaled by ``mooncake_time_scale``."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no requests")
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            blocks[hash_id] = vocab_tokens(random.Random(f"mooncake-block-{seed}-{hash_id}"), 512)
        return blocks[hash_id]

    counts: dict[int, int] = {}
    for row in rows:
        for hash_id in row.get("hash_ids", ()):
            counts[hash_id] = counts.get(hash_id, 0) + 1
    start = min(float(row["timestamp"]) for row in rows)
    rng = random.Random(f"mooncake-pad-{seed}")
    timed = []
    for number, row in enumerate(rows):
        output = max(1, min(int(row["output_length"]), sizes.mooncake_output_cap))
        length = max(1, min(int(row["input_length"]), sizes.max_model_len - output))
        ids = [int(h) for h in row.get("hash_ids", ())]
        prompt = [token for hash_id in ids for token in block(hash_id)][:length]
        prompt += vocab_tokens(rng, length - len(prompt))
        # the pinned control's key: the request's first hash id that fewer than half the
        # requests share (its conversation, not a system prompt everyone has)
        key = next((h for h in ids if counts[h] * 2 < len(rows)), ids[-1] if ids else -number)
        at = (float(row["timestamp"]) - start) / 1000.0 / sizes.mooncake_time_scale
        timed.append(Timed(at, prompt, output, key))
    return Trace("mooncake", timed=timed)


def pinned_rank(key: int, dp: int) -> int:
    """The pinned control's rank for a session key (a multiplicative hash, so that
    consecutive keys spread)."""
    return (((key * 2654435761) & 0xFFFFFFFF) >> 16) % dp


def make_traces(names: Sequence[str], seed: int, sizes: Sizes, trace_file: Path) -> list[Trace]:
    traces = []
    for name in names:
        if name == "multi-turn":
            traces.append(multi_turn(seed, sizes))
        elif name == "shared-docs":
            traces.append(shared_docs(seed, sizes))
        elif name == "shared-docs-many":
            traces.append(shared_docs(seed, sizes, many=True))
        elif name == "no-reuse":
            traces.append(no_reuse(seed, sizes))
        elif name == "mooncake":
            traces.append(mooncake(trace_file, seed, sizes))
    return traces


def size_override(spec: str) -> tuple[str, Any]:
    """``FIELD=VALUE`` of :class:`Sizes`: an int, a float, or ints joined by commas (a
    range such as ``document_tokens``)."""
    name, _, value = spec.partition("=")
    fields = {f.name: f for f in dataclasses.fields(Sizes)}
    if name not in fields or not value:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected FIELD=VALUE, FIELD of Sizes")
    try:
        if "," in value:
            return name, tuple(int(part) for part in value.split(","))
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: not a number") from None
    return name, int(number) if number.is_integer() and "." not in value else number
