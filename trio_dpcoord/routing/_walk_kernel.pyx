# cython: language_level=3, boundscheck=True, wraparound=True
"""The compiled twin of :mod:`trio_dpcoord.routing._walk`: :func:`bisect_holders`, the
same bisection over the same owners map (the same lookups, in the same order), without
a bytecode per step. ``_walk.py`` (pure Python) is the spec;
``tests/routing/test_compiled_twin.py`` checks the two side by side.
"""


def bisect_holders(owners, chunks, Py_ssize_t span, Py_ssize_t count, first, last):
    """``_walk.bisect_holders``: (leading blocks held, mask of the ranks holding exactly
    that many) per depth where ranks drop out, deepest last."""
    if type(owners) is not dict or type(chunks) is not list or span <= 0:
        return _pure_bisect_holders(owners, chunks, span, count, first, last)
    cdef dict holders = owners
    cdef list blocks = chunks
    cdef list groups = []
    # Stretches (low, high, holders at low, holders at high), leftmost on top.
    cdef list stack = [(0, count - 1, first, last)]
    cdef Py_ssize_t low, high, middle
    while stack:
        low, high, at_low, at_high = stack.pop()
        if at_low == at_high:
            continue
        if high - low == 1:
            groups.append((high, at_low ^ at_high))  # held to ``low``, not ``high``
            continue
        middle = (low + high) >> 1
        key = blocks[middle // span][middle % span]
        at_middle = holders.get(key, 0) & at_low
        stack.append((middle, high, at_middle, at_high))
        stack.append((low, middle, at_low, at_middle))
    if last:
        groups.append((count, last))
    return groups


cdef object _pure_bisect_holders = None
"""The pure function: for inputs other than a dict and a list of chunks."""


def accelerate(namespace):
    """The replacements for the pure module's names (``namespace``: its globals)."""
    global _pure_bisect_holders
    _pure_bisect_holders = namespace["bisect_holders"]
    return {"bisect_holders": bisect_holders}
