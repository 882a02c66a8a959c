"""The prefix router's bisecting walk over prefix-closed indexes (``_prefix_router.py``,
``PrefixRouter._bisect``): where along a prompt the ranks holding it drop out.

With prefix-closed indexes the ranks holding block ``k`` hold every block before it, so
the holders' mask only shrinks along the prompt, and a stretch whose two ends have the
same holders has them throughout: bisecting the stretches whose ends differ finds every
depth where ranks drop out in about (depths where some do) x log2(blocks) lookups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .._compiled import accelerate

__all__ = ["bisect_holders"]


def bisect_holders(
    owners: Mapping[int, int],
    chunks: Sequence[Sequence[int]],
    span: int,
    count: int,
    first: int,
    last: int,
) -> list[tuple[int, int]]:
    """The ranks holding a prefix of the first ``count`` keys (``chunks`` of ``span``
    keys each), as (leading blocks held, bit mask of the ranks holding exactly that
    many), deepest last; ``owners``: block key -> bit mask of its holders, ``first`` and
    ``last`` the holders of the first and of the last key (none of the ranks holding the
    last one holds the key after it)."""
    holders = owners.get
    groups: list[tuple[int, int]] = []
    # Stretches (low, high, holders at low, holders at high), leftmost on top.
    stack = [(0, count - 1, first, last)]
    pop, push = stack.pop, stack.append
    while stack:
        low, high, at_low, at_high = pop()
        if at_low == at_high:
            continue
        if high - low == 1:
            groups.append((high, at_low ^ at_high))  # held to ``low``, not ``high``
            continue
        middle = (low + high) >> 1
        at_middle = holders(chunks[middle // span][middle % span], 0) & at_low
        push((middle, high, at_middle, at_high))
        push((low, middle, at_low, at_middle))
    if last:
        groups.append((count, last))
    return groups


accelerate(globals(), "trio_dpcoord.routing._walk_kernel")  # the compiled twin, if built
