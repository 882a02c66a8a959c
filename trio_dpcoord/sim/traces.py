"""Seeded request traces for the routing benchmark, and their reuse bound.

Three shapes: multi-turn chat (sessions share a system prompt; each turn resends
the whole history plus new tokens), many users over a few long documents, and a
trace with no reuse.  The reuse bound is the prefix-cache hit rate an infinite
cache with perfect affinity would reach, counted in whole blocks as vLLM does.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from trio_dpcoord import PrefixRouting
from trio_dpcoord.routing import block_keys

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = PrefixRouting().block_size
"""The router's default block size (vLLM's default ``--block-size``, 16)."""

_VOCAB = 50_000


@dataclass(frozen=True)
class Request:
    """One request: when it arrives (s), its prompt, how many tokens it outputs, its session."""

    arrival_s: float
    token_ids: tuple[int, ...]
    output_len: int
    session_id: int


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(_VOCAB) for _ in range(count)]


def multi_turn_chat(
    seed: int,
    sessions: int = 64,
    turns: int = 6,
    system_tokens: int = 512,
    turn_tokens: int = 128,
    output_len: int = 64,
    rate_per_s: float = 50.0,
) -> list[Request]:
    """Sessions sharing one system prompt; each turn resends the history plus new tokens."""
    rng = random.Random(seed)
    system = _tokens(rng, system_tokens)
    histories = [list(system) for _ in range(sessions)]
    pending = [(rng.expovariate(rate_per_s / sessions), s, 0) for s in range(sessions)]
    out: list[Request] = []
    while pending:
        pending.sort()
        at, session, turn = pending.pop(0)
        history = histories[session]
        history.extend(_tokens(rng, turn_tokens))
        out.append(Request(at, tuple(history), output_len, session))
        history.extend(_tokens(rng, output_len))
        if turn + 1 < turns:
            pending.append((at + rng.expovariate(rate_per_s / sessions), session, turn + 1))
    return out


def shared_documents(
    seed: int,
    users: int = 256,
    documents: int = 4,
    document_tokens: int = 4096,
    question_tokens: int = 64,
    output_len: int = 64,
    rate_per_s: float = 50.0,
) -> list[Request]:
    """Many users, each asking one question about one of a few long documents."""
    rng = random.Random(seed)
    docs = [_tokens(rng, document_tokens) for _ in range(documents)]
    at = 0.0
    out: list[Request] = []
    for user in range(users):
        at += rng.expovariate(rate_per_s)
        prompt = docs[rng.randrange(documents)] + _tokens(rng, question_tokens)
        out.append(Request(at, tuple(prompt), output_len, user))
    return out


def no_reuse(
    seed: int,
    requests: int = 256,
    prompt_tokens: int = 1024,
    output_len: int = 64,
    rate_per_s: float = 50.0,
) -> list[Request]:
    """Independent random prompts: nothing to reuse."""
    rng = random.Random(seed)
    at = 0.0
    out: list[Request] = []
    for index in range(requests):
        at += rng.expovariate(rate_per_s)
        out.append(Request(at, tuple(_tokens(rng, prompt_tokens)), output_len, index))
    return out


def reuse_bound(trace: list[Request], block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Hit rate (hit tokens / prompt tokens) of an infinite cache seeing every request in order.

    Only whole blocks that match a chain already seen count, and, as in vLLM, the
    last prompt token is always computed, so a fully seen prompt hits one block less.
    """
    seen: set[int] = set()
    queried = 0
    hit = 0
    for request in sorted(trace, key=lambda r: r.arrival_s):
        keys = block_keys(request.token_ids, block_size)
        usable = len(keys) if len(request.token_ids) % block_size else max(len(keys) - 1, 0)
        matched = 0
        for key in keys[:usable]:
            if key not in seen:
                break
            matched += 1
        queried += len(request.token_ids)
        hit += matched * block_size
        seen.update(keys)
    return hit / queried if queried else 0.0
