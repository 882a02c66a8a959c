"""A simulated rank's KV-cache change log as vLLM's KV-cache events (plain objects, no I/O).

What a vLLM engine run with ``--kv-events-config`` publishes (0.33.0,
``vllm/distributed/kv_events.py``) is written by :mod:`trio_dpcoord.protocol`
(:func:`~trio_dpcoord.protocol.encode_event_batch`,
:func:`~trio_dpcoord.protocol.encode_kv_event_frames`); this module only decides what the
events say. :class:`EventBatchEncoder` turns a :class:`~trio_dpcoord.sim.prefix.RankCache`
change log into such batches; the lock-step model's exact-feed policy (:mod:`.routing`)
and the simulated engines (:mod:`.engine`) both use it, so the two speak the same bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable, Sequence
from typing import Final

from trio_dpcoord.protocol import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_event_batch,
)
from trio_dpcoord.routing import block_keys

__all__ = ["EventBatchEncoder"]

logger = logging.getLogger(__name__)

_HASH_MASK: Final = (1 << 64) - 1
"""Our block keys are unbounded ints; the stand-in for vLLM's block hash is their low
64 bits (msgpack's widest int). The router indexes by its own hash of the tokens, so
these only have to name blocks consistently."""


class EventBatchEncoder:
    """Encodes one or more caches' change logs (``(stored, key)`` pairs, in order) as
    vLLM ``EventBatch`` payloads.

    A ``BlockStored`` names its blocks' tokens and its parent block, which a change log
    does not carry: :meth:`remember` registers a prompt's blocks (parent and tokens per
    key) before they are stored, and :meth:`forget` drops keys no cache holds any more.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        """Block key -> (parent key, the block's tokens)."""

    def __len__(self) -> int:
        return len(self._blocks)

    def remember(self, token_ids: Sequence[int]) -> list[int]:
        """Register the full blocks of a prompt; returns their keys (root first)."""
        size = self.block_size
        keys = block_keys(token_ids, size)
        blocks = self._blocks
        parent: int | None = None
        for offset, key in enumerate(keys):
            if key not in blocks:
                blocks[key] = (parent, tuple(token_ids[offset * size : (offset + 1) * size]))
            parent = key
        return keys

    def forget(self, keys: Iterable[int]) -> None:
        """Drop keys that are no longer cached anywhere this encoder serves."""
        for key in keys:
            self._blocks.pop(key, None)

    def retain(self, keys: Container[int]) -> None:
        """Keep only the blocks in ``keys`` (those still cached)."""
        self._blocks = {k: v for k, v in self._blocks.items() if k in keys}

    def encode(self, now: float, rank: int, changes: Sequence[tuple[bool, int]]) -> bytes:
        """vLLM's ``EventBatch`` ``[ts, events, data_parallel_rank]``: runs of chained
        stored blocks as one ``BlockStored`` each, runs of evictions as ``BlockRemoved``."""
        return encode_event_batch(EventBatch(now, self.events(changes), rank))

    def events(self, changes: Sequence[tuple[bool, int]]) -> list[KVEvent]:
        """The events of a change log (see :meth:`encode`)."""
        events: list[KVEvent] = []
        run: list[int] = []
        blocks = self._blocks

        def flush_stored() -> None:
            if run:
                parent = blocks[run[0]][0]
                tokens: list[int] = []
                for key in run:
                    tokens.extend(blocks[key][1])
                events.append(
                    BlockStored(
                        block_hashes=[key & _HASH_MASK for key in run],
                        parent_block_hash=None if parent is None else parent & _HASH_MASK,
                        token_ids=tokens,
                        block_size=self.block_size,
                    )
                )
                run.clear()

        for stored, key in changes:
            if stored:
                if run and blocks[key][0] != run[-1]:
                    flush_stored()
                run.append(key)
            else:
                flush_stored()
                if events and isinstance(events[-1], BlockRemoved):
                    events[-1].block_hashes.append(key & _HASH_MASK)
                else:
                    events.append(BlockRemoved([key & _HASH_MASK]))
        flush_stored()
        return events
