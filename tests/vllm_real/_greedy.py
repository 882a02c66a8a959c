"""Greedy completions of the same prompts through different front-ends, kept for comparison.

The real-vLLM tests drive the same engines (the tiny MoE, dummy weights, ``--seed 0``)
through ``vllm serve``'s HTTP API (``tests/vllm/test_real.py``, with either coordinator)
and through trio_dpcoord's engine client on headless engines
(``tests/vllm/test_engine_client_real.py``). Under greedy sampling the prompt alone decides
the tokens, so every front-end must give the same ones. Each test records what it got
in the session's :class:`GreedyCompletions`, so that the comparison
(``tests/vllm_real/test_engine_client_vs_serve.py``) costs no server start of its own
when they ran before it.
"""

from __future__ import annotations

GREEDY_PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(5 + i % 4)] for i in range(8)]
"""Token-id prompts (the vocabulary has 512 tokens; 0-2 are special in the config)."""
GREEDY_MAX_TOKENS = 8
"""Completion length of the recorded runs (``ignore_eos``: always exactly this many)."""

TokenIds = tuple[int, ...]


class GreedyCompletions:
    """Front-end name -> prompt -> the token ids it completed it with."""

    def __init__(self) -> None:
        self.by_front_end: dict[str, dict[TokenIds, TokenIds]] = {}

    def record(self, front_end: str, by_prompt: dict[TokenIds, TokenIds]) -> None:
        """Keep ``front_end``'s completions of (exactly) the greedy prompts."""
        expected = {tuple(prompt) for prompt in GREEDY_PROMPTS}
        if set(by_prompt) != expected:
            raise ValueError(f"{front_end}: not the greedy prompts: {sorted(by_prompt)}")
        if any(len(tokens) != GREEDY_MAX_TOKENS for tokens in by_prompt.values()):
            raise ValueError(f"{front_end}: not {GREEDY_MAX_TOKENS} tokens each: {by_prompt}")
        self.by_front_end[front_end] = dict(by_prompt)

    def get(self, front_end: str) -> dict[TokenIds, TokenIds] | None:
        return self.by_front_end.get(front_end)
