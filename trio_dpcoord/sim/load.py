"""The load generator of the simulated cluster: a repeatable plan of bursts separated by
idle gaps, multi-turn chat prompts when asked, sent through a :class:`~.frontend.SimFrontend`.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from .frontend import SimFrontend

__all__ = ["LoadPlan", "generate_load"]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """A repeatable load: bursts of requests separated by idle gaps.

    After each burst the generator waits until every request finished, then sleeps a
    random gap, so that the cluster goes idle and many waves start and end; short gaps
    land while the wave is still winding down (requests stamped for a finished wave,
    R2/R3). Every ``pause_every`` bursts (0: never) it pauses and resumes all engines in
    the gap, as a weight update would.
    """

    requests: int = 400
    seed: int = 0
    burst: tuple[int, int] = (10, 40)
    gap: tuple[float, float] = (0.0, 0.15)
    tokens: tuple[int, int] = (4, 16)
    pause_every: int = 5
    sessions: int = 0
    """0: every request sends the fixed 4-token prompt. N: multi-turn chat over N
    sessions sharing a 256-token system prompt; each turn resends its session's
    history plus 16-64 new tokens (history capped at 2,048 tokens), from its own seeded
    generator, so the bursts and token counts stay those of ``seed``."""

    def __post_init__(self) -> None:
        if self.requests < 0 or self.pause_every < 0 or self.sessions < 0:
            raise ValueError("requests, pause_every and sessions must be >= 0")
        for name, (low, high) in (("burst", self.burst), ("tokens", self.tokens)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be 1 <= MIN <= MAX, got {low} {high}")
        if not 0 <= self.gap[0] <= self.gap[1]:
            raise ValueError(f"gap must be 0 <= MIN <= MAX, got {self.gap}")


class _ChatPrompts:
    """Multi-turn chat prompts: sessions sharing a system prompt, each turn resending
    its session's history (the traffic prefix caching pays off on)."""

    SYSTEM_TOKENS = 256
    HISTORY_CAP = 2048

    def __init__(self, sessions: int, seed: int) -> None:
        self._rng = random.Random(f"chat-{seed}")
        self._system = [self._rng.randrange(1, 32000) for _ in range(self.SYSTEM_TOKENS)]
        self._histories: list[list[int]] = [[] for _ in range(sessions)]

    def next_turn(self) -> list[int]:
        rng = self._rng
        history = self._histories[rng.randrange(len(self._histories))]
        turn = [rng.randrange(1, 32000) for _ in range(rng.randint(16, 64))]
        if len(history) + len(turn) > self.HISTORY_CAP:
            history.clear()  # the session ends; a new one starts in its place
        history.extend(turn)
        return self._system + history


async def generate_load(
    frontend: SimFrontend,
    plan: LoadPlan,
    *,
    after_burst: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Send ``plan.requests`` requests and wait until all have finished.

    ``after_burst`` is awaited after every burst but the last, once all its requests
    finished (before the pause and the gap): a hook for fault injection.
    """
    rng = random.Random(plan.seed)
    chat = _ChatPrompts(plan.sessions, plan.seed) if plan.sessions else None
    sent = 0
    bursts = 0
    while sent < plan.requests:
        size = min(rng.randint(*plan.burst), plan.requests - sent)
        for _ in range(size):
            prompt = chat.next_turn() if chat is not None else None
            await frontend.submit(max_tokens=rng.randint(*plan.tokens), prompt_token_ids=prompt)
            # Spread some requests over a few steps, so that bursts straddle steps.
            await trio.sleep(rng.uniform(0.0, 0.003) if rng.random() < 0.2 else 0)
        sent += size
        bursts += 1
        await frontend.wait_for(lambda f: f.pending == 0)
        if sent >= plan.requests:
            break
        if after_burst is not None:
            await after_burst()
        if plan.pause_every and bursts % plan.pause_every == 0:
            await frontend.pause_engines()
            await frontend.resume_engines()
        await trio.sleep(rng.uniform(*plan.gap))
