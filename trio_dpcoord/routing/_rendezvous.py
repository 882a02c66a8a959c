"""Rendezvous hashing for the prefix policy: where front-ends that each know only their
own choices agree to send a new conversation (``rendezvous_slack``,
``rendezvous_home``; see :class:`~._settings.PrefixRouting`).

:func:`rendezvous_rank` ranks candidate ranks by a hash of a prompt's block key and the
rank; every front-end computes the same. :class:`BranchPoints` learns, from the prompts
routed, the blocks followed by more than one different block (where a shared document
ends and conversations part), so that the hash is of the first block past it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Final

__all__ = ["BranchPoints", "rendezvous_rank"]

_BRANCH: Final = object()
"""A block seen followed by two different blocks."""


def rendezvous_rank(key: int, ranks: Iterable[int]) -> int | None:
    """Of ``ranks``, the one rendezvous hashing of ``key`` ranks first (None if none)."""
    winner, top = None, -1
    for rank in ranks:
        mine = hash((key, rank)) & 0xFFFFFFFFFFFF
        if mine > top:
            winner, top = rank, mine
    return winner


class BranchPoints:
    """Block key -> the key of the block seen after it, or a branch mark once two
    different ones were; bounded (cleared when full: relearnt from the traffic)."""

    __slots__ = ("_children",)

    def __init__(self) -> None:
        self._children: dict[int, object] = {}

    def learn(self, keys: Sequence[int], bound: int) -> None:
        """A prompt of these block keys was routed; at most ``bound`` keys are kept."""
        children = self._children
        if len(children) > bound:
            children.clear()
        for parent, child in zip(keys, islice(keys, 1, None), strict=False):
            known = children.get(parent)
            if known is None:
                children[parent] = child
            elif known is not _BRANCH and known != child:
                children[parent] = _BRANCH

    def point(self, keys: Sequence[int]) -> int:
        """The blocks of ``keys`` up to and including its last branch point."""
        get = self._children.get
        point = 0
        for index, key in enumerate(keys):
            if get(key) is _BRANCH:
                point = index + 1
        return point
