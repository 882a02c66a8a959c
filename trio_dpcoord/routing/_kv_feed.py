"""The exact feed: what one engine's KV-cache events tell its rank's index.

vLLM's engines publish every block they store and evict (``--kv-events-config``);
:class:`ExactRank` follows one rank's stream (its sequence numbers, and vLLM's block
hashes mapped to our block keys) and applies each batch's events to the rank's
:class:`~._prefix_index.RankPrefixIndex`. The router (``_prefix_router.py``) checks the
batch, its rank and its sequence first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..protocol import BlockRemoved, BlockStored, KVEvent
from ._prefix_index import ROOT_KEY, RankPrefixIndex, block_keys

__all__ = ["ExactRank"]


@dataclass
class ExactRank:
    """One rank's KV-event stream as the router follows it."""

    last_seq: int | None = None
    vllm_to_ours: dict[Any, tuple[int, int]] = field(default_factory=dict)
    """vLLM's block hash -> (our key, the block's depth in its chain)."""

    def apply(
        self, events: Iterable[KVEvent], index: RankPrefixIndex, block_size: int, now: float
    ) -> None:
        """Apply one batch's ``events`` to the rank's ``index``: stored chains whose
        parent is known (or that start at the root) are stored and confirmed, removed
        blocks forgotten, a cleared cache clears the index; blocks of another size never
        match our prompts' and are skipped. The hash map stays bounded."""
        for event in events:
            if isinstance(event, BlockStored):
                if event.block_size != block_size:
                    continue  # keys of another block size never match our prompts'
                parent, depth = ROOT_KEY, 0
                if event.parent_block_hash is not None:
                    known = self.vllm_to_ours.get(event.parent_block_hash)
                    if known is None or not index.knows(known[0]):
                        continue  # parent unknown: the chain cannot be matched anyway
                    parent, depth = known[0], known[1] + 1
                ours = block_keys(event.token_ids, event.block_size, parent, depth)
                for offset, (theirs, key) in enumerate(zip(event.block_hashes, ours, strict=True)):
                    self.vllm_to_ours[theirs] = (key, depth + offset)
                index.confirm(ours)
                index.store(ours, now)
            elif isinstance(event, BlockRemoved):
                gone = (self.vllm_to_ours.pop(h, None) for h in event.block_hashes)
                index.remove(known[0] for known in gone if known is not None)
            else:
                index.clear()
                self.vllm_to_ours.clear()
        if len(self.vllm_to_ours) > 2 * index.capacity_blocks:
            self.vllm_to_ours = {
                h: known for h, known in self.vllm_to_ours.items() if index.knows(known[0])
            }
