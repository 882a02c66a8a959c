"""The prefix policy's settings (:class:`PrefixRouting`): a plain record, apart from the
router so that the shell and the core can name it without it (what a router reports:
``_decision.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from ._prefix_index import DEFAULT_BLOCK_SIZE, Feed

__all__ = ["PrefixRouting"]


@dataclass(frozen=True)
class PrefixRouting:
    """The prefix policy's settings (``EngineChooser(..., prefix=PrefixRouting(...))``).

    ``block_size``: tokens per block, as the engines' ``--block-size`` (vLLM: 16); only
    full blocks are matched. ``capacity_blocks``: blocks remembered per rank; set it to
    the engines' KV-cache size in blocks (vLLM logs it as ``# GPU blocks``), since an
    index larger than the real cache believes evicted blocks are still there (the
    default, 16,384 blocks = 262,144 tokens, is a mid-size GPU's; the index costs about
    250 bytes a block). ``max_age``: seconds after which an unseen block is forgotten
    (within ``max_age / 8`` more), the bound on stale beliefs when events are lost.
    ``imbalance_abs`` (tokens) and ``imbalance_rel``: when the busiest rank's queued
    work exceeds the idlest's by more than ``imbalance_abs`` *and* by a factor of more
    than ``imbalance_rel``, the loads are imbalanced beyond what affinity may cost and
    the guard sends the request to the least loaded rank (SGLang's cache-aware router
    has the same two thresholds, in requests). The defaults, 4,096 tokens and 3x, lose
    least in the worst case of sweeps on the lock-step model and the process fleet
    (``benchmarks/README.md``, the routing section); no setting is best everywhere. With
    caches of two documents a rank, a guard that never fires (SGLang's 32,768) left most
    of 64 ranks idle behind the holders of a few shared documents (2.3x vLLM's
    throughput, against 4.8x); with caches twice as large the default costs a fifth
    there instead (7.3x against 9.0x); a tighter guard (2x, 1.5x, or 3,072 tokens)
    broke up conversations for nothing (multi-turn up to 15 % slower, and on the
    fleet, whose load reports lag, 4 points of hit rate). ``feed``: ``"approximate"`` takes every
    routed prompt as cached on its rank; ``"exact"`` learns from the engines' KV
    events (:meth:`~trio_dpcoord.EngineChooser.receive_kv_events`), and takes a routed
    prompt's new blocks as cached *provisionally*, for ``provisional_age`` seconds
    (``max_age`` at most; within ``provisional_age / 8`` more), until the rank's events
    confirm them: an engine stores a prompt's blocks only when it computes them, after
    its queue, and without the provisional belief the next turn of a conversation
    routed before that would find nothing anywhere (0: events only).
    Provisional blocks count against ``capacity_blocks`` as the engine's own do (it
    makes room for a prompt by evicting); the reported blocks they push out are kept
    aside, unbelieved, until the events say which ones the engine evicted, so the index
    remembers at most twice ``capacity_blocks`` a rank and believes at most that.

    ``reuse_weight``: the choice's price, in tokens, for each token of the deepest known
    prefix of the prompt that the chosen rank lacks, on top of computing it there: a
    rank's cost is its queued work plus the prompt tokens it would compute plus
    ``reuse_weight`` times the cached tokens it throws away (computed again by the fleet,
    and lost to the next requests of that prefix, which would have found it where it
    was). So a request stays on the rank holding its longest prefix until that rank's
    queue exceeds another's by more than ``1 + reuse_weight`` times the cached tokens.
    The default, 1: on a real ``vllm serve`` (``benchmarks/README.md``, the real-engine
    section) 0, the least own work, lost 4-5 points of hit rate and 3 matched 1 within a
    point; on the lock-step model 1 did best of 0, 1, 3 and 10 but for 64 ranks of
    shared documents. With nothing cached the cost is the queue alone: the least loaded
    rank (vLLM's choice when the queued work is vLLM's score in tokens, as the vLLM
    plugin passes it), or the caller's own choice if it gives one
    (:meth:`PrefixRouter.route`'s ``unshared_choice``, as :class:`EngineChooser` does).
    ``rendezvous_slack``: 0 (the default) or, for front-ends that each keep their own
    index (several API servers, approximate feed), the load tolerance, in prompts, of a
    choice they all agree on: when no single rank holds more of the prompt than every
    other, the rank is chosen by rendezvous hashing of the prompt's first block past
    the prefix they share, among the ranks whose cost is within ``rendezvous_slack``
    times the prompt's tokens of the best. A conversation's first turns and a
    document's readers then meet on one rank whichever front-end takes them (a session
    one front-end moved, the others do not follow: the KV-event feed shares that). With
    nothing shared it is a spread by hash within the slack, not the least loaded rank.
    ``rendezvous_home`` (with ``rendezvous_slack``; off by default, an experiment): the
    rendezvous decides every choice, not only those no single rank holds more of, and
    hashes the prompt's first block past its last *branch point*, the deepest block this
    router has seen followed by two different blocks (the end of a shared system prompt
    or document), among the ranks holding the prompt up to that point if any do: a
    conversation's turns then have one home whatever each front-end knows of where its
    history is cached, as long as the home's cost is within the slack of the best. On
    the lock-step model with two front-ends (approximate feed, 20 requests/s a rank,
    slack 3; ``python -m benchmarks.tools.front_ends``) it raised multi-turn's hit rate from
    0.73-0.75 to 0.81-0.82 at DP = 2 (one front-end: 0.80-0.81) and from 0.63 to
    0.69-0.75 at DP = 8 (one: 0.78-0.81), shared documents' from 0.42 to 0.48 at DP = 8;
    with nothing shared it spreads by hash within the slack (0.91-0.98x the throughput
    of vLLM's choice in the model). On a real ``vllm serve`` with two API servers it is
    not reliable: 70.7 % multi-turn hit rate on seed 0 (one server 72.7 %), 62.4 % on
    seed 1 (one server 71.5 %; slack 1: 68.9 %), the busier engine taking 60 % of the
    prompt tokens. Front-ends that can reach each other share their routes instead
    (:meth:`PrefixRouter.take_routed`, :meth:`PrefixRouter.receive_routed`; the vLLM
    plugin's default with several API servers), and need no rendezvous.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    capacity_blocks: int = 16384
    max_age: float = 600.0
    imbalance_abs: float = 4096.0
    imbalance_rel: float = 3.0
    feed: Feed = "approximate"
    provisional_age: float = 10.0
    reuse_weight: float = 1.0
    rendezvous_slack: float = 0.0
    rendezvous_home: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if not self.max_age > 0:
            raise ValueError(f"max_age must be > 0, got {self.max_age}")
        if not self.imbalance_abs >= 0 or not self.imbalance_rel >= 1:
            raise ValueError("need imbalance_abs >= 0 and imbalance_rel >= 1")
        if self.feed not in ("approximate", "exact"):
            raise ValueError(f"feed must be 'approximate' or 'exact', got {self.feed!r}")
        if not self.provisional_age >= 0:
            raise ValueError(f"provisional_age must be >= 0, got {self.provisional_age!r}")
        if not self.reuse_weight >= 0:
            raise ValueError(f"reuse_weight must be >= 0, got {self.reuse_weight!r}")
        if not self.rendezvous_slack >= 0:
            raise ValueError(f"rendezvous_slack must be >= 0, got {self.rendezvous_slack!r}")
