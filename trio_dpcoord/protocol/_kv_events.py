"""vLLM's KV-cache events as its engines publish them (``vllm/distributed/kv_events.py``):
the (topic, sequence, payload) frames and the ``EventBatch`` payload (docs/protocol.md §15),
read (the prefix router) and written (the simulated engines)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack


class KVEventError(ValueError):
    """A KV-event batch that is not vLLM's ``EventBatch`` format."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[Any]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None


def encode_kv_event_frames(seq: int, payload: bytes, topic: bytes = b"") -> list[bytes]:
    """The PUB message of one batch as vLLM's ``ZmqEventPublisher`` sends it: ``topic``
    (vLLM's default ``KVEventsConfig.topic`` is empty: subscribers get every message),
    ``seq`` as 8 bytes big-endian, the ``EventBatch`` payload (the inverse of
    :func:`decode_kv_event_frames`)."""
    return [topic, seq.to_bytes(8, "big"), payload]


def _event_map(event: KVEvent) -> dict[str, Any]:
    """One event as vLLM's ``msgspec`` writes it: a map tagged by ``"type"``, its fields
    in declaration order; a GPU cache without LoRA (``lora_id`` nil, ``medium`` GPU)."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": "GPU",
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": "GPU"}
    return {"type": "AllBlocksCleared"}


def encode_event_batch(batch: EventBatch) -> bytes:
    """vLLM's msgpack ``EventBatch``, ``[ts, events, data_parallel_rank]`` (the rank left
    out when None, as ``omit_defaults`` does): what :func:`decode_event_batch` reads.
    :class:`KVEventError` for a value msgpack cannot write (a hash above 64 bits)."""
    events = [_event_map(event) for event in batch.events]
    fields: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        fields.append(batch.data_parallel_rank)
    try:
        payload: bytes = msgpack.packb(fields)
    except (TypeError, ValueError, OverflowError) as exc:
        raise KVEventError(f"EventBatch not encodable: {exc}") from None
    return payload


def _hash_ok(value: object) -> bool:
    return isinstance(value, (int, bytes)) and not isinstance(value, bool)


def decode_kv_event_frames(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of one message of vLLM's ``ZmqEventPublisher`` (``topic``,
    ``seq`` as 8 bytes big-endian, the ``EventBatch``); :class:`KVEventError` if it is
    not three frames with an 8-byte sequence number."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KVEventError(
            f"a KV-event message is (topic, 8-byte seq, payload); got {len(frames)} frames"
        )
    return int.from_bytes(frames[1], "big"), frames[2]


def decode_event_batch(payload: bytes) -> EventBatch:
    """Decode vLLM's msgpack ``EventBatch``; :class:`KVEventError` if it is not one.

    The layout is what vLLM's ``msgspec`` encoder writes (checked against the CPU build,
    0.32.0, ``vllm/distributed/kv_events.py``): the batch is array-like, ``[ts, events,
    data_parallel_rank]``, and each event a map tagged by ``"type"`` (``BlockStored`` with
    ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ...).
    """
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise KVEventError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KVEventError("EventBatch must be an array [ts, events, dp_rank?]")
    ts, raw_events = raw[0], raw[1]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise KVEventError("EventBatch ts must be a number")
    rank = raw[2] if len(raw) > 2 else None
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise KVEventError("EventBatch data_parallel_rank must be a non-negative int")
    events: list[KVEvent] = []
    for item in raw_events:
        # msgspec encodes the events (tagged, not array-like) as maps named by "type".
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise KVEventError("event must be a map with a 'type'")
        tag = item["type"]
        if tag == "BlockStored":
            hashes = item.get("block_hashes")
            parent = item.get("parent_block_hash")
            tokens, size = item.get("token_ids"), item.get("block_size")
            if not isinstance(hashes, list) or not all(_hash_ok(h) for h in hashes):
                raise KVEventError("BlockStored block_hashes must be ints or bytes")
            if parent is not None and not _hash_ok(parent):
                raise KVEventError("BlockStored parent_block_hash must be int, bytes or nil")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise KVEventError("BlockStored block_size must be a positive int")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens
            ):
                raise KVEventError("BlockStored token_ids must be ints")
            if len(tokens) != size * len(hashes):
                raise KVEventError("BlockStored token_ids must be block_size per block hash")
            events.append(BlockStored(hashes, parent, tokens, size))
        elif tag == "BlockRemoved":
            hashes = item.get("block_hashes")
            if not isinstance(hashes, list) or not all(_hash_ok(h) for h in hashes):
                raise KVEventError("BlockRemoved block_hashes must be ints or bytes")
            events.append(BlockRemoved(hashes))
        elif tag == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise KVEventError(f"unknown event type {tag!r}")
    return EventBatch(float(ts), events, rank)
