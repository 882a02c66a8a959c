"""Our own message between front-ends (vLLM's API servers): "I routed a prompt with these
block keys to this engine" (docs/protocol.md §17). Not vLLM's: vLLM's API servers share
no routing knowledge; the prefix router's plugin adds it so that several servers each
keep the index one server would.

One msgpack frame: ``[MAGIC, version, sender, block_size, rank, keys]``, ``keys`` the
prompt's block keys (:func:`trio_dpcoord.routing.block_keys`, root first) as a
``bin`` of little-endian signed 64-bit integers, 8 bytes a block.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from sys import byteorder
from typing import Final

from ._codec import MAX_CONTROL_FRAME_BYTES, ProtocolError, dec_uint, expect_list, pack, unpack

__all__ = ["PEER_ROUTE_MAGIC", "PeerRoute", "decode_peer_route", "encode_peer_route"]

PEER_ROUTE_MAGIC: Final[str] = "trio-dpcoord/peer-route"
"""The first field: a frame from anything else on the socket is refused at once."""
_VERSION: Final[int] = 1
_WHAT = "peer route"


@dataclass(frozen=True, slots=True)
class PeerRoute:
    """One routed prompt: the sending front-end's index, the engines' block size the
    keys were made with, the engine it went to, and its block keys."""

    sender: int
    block_size: int
    engine_index: int
    keys: tuple[int, ...]


def _keys_bytes(keys: Sequence[int]) -> bytes:
    packed = array("q", keys)
    if byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        packed.byteswap()
    return packed.tobytes()


def encode_peer_route(sender: int, block_size: int, rank: int, keys: Sequence[int]) -> bytes:
    """The frame of one :class:`PeerRoute`; ``ProtocolError`` if a field is out of range
    (a key outside signed 64 bits: block keys never are)."""
    for value, name in ((sender, "sender"), (block_size, "block_size"), (rank, "rank")):
        if type(value) is not int or value < 0:
            raise ProtocolError(f"{_WHAT}: {name} must be an int >= 0, got {value!r}")
    if block_size < 1:
        raise ProtocolError(f"{_WHAT}: block_size must be >= 1, got {block_size}")
    try:
        data = _keys_bytes(keys)
    except (OverflowError, TypeError) as exc:
        raise ProtocolError(f"{_WHAT}: keys must be signed 64-bit ints ({exc})") from None
    return pack([PEER_ROUTE_MAGIC, _VERSION, sender, block_size, rank, data], _WHAT)


def decode_peer_route(frame: object) -> PeerRoute:
    """The :class:`PeerRoute` of one frame, or ``ProtocolError`` saying what was wrong."""
    fields = expect_list(unpack(frame, _WHAT, MAX_CONTROL_FRAME_BYTES), _WHAT, exact=6)
    magic, version, sender, block_size, rank, data = fields
    if magic != PEER_ROUTE_MAGIC:
        raise ProtocolError(f"{_WHAT}: not a peer route (first field {magic!r})")
    if version != _VERSION:
        raise ProtocolError(f"{_WHAT}: version {version!r}, this side reads {_VERSION}")
    sender = dec_uint(sender, f"{_WHAT} sender")
    block_size = dec_uint(block_size, f"{_WHAT} block_size")
    if block_size < 1:
        raise ProtocolError(f"{_WHAT}: block_size must be >= 1, got 0")
    rank = dec_uint(rank, f"{_WHAT} rank")
    if type(data) is not bytes or len(data) % 8:
        raise ProtocolError(
            f"{_WHAT}: keys must be a bin of 8-byte ints, got {type(data).__name__}"
            + (f" of {len(data)} bytes" if isinstance(data, bytes) else "")
        )
    keys = array("q")
    keys.frombytes(data)
    if byteorder != "little":  # pragma: no cover
        keys.byteswap()
    return PeerRoute(sender, block_size, rank, tuple(keys))
