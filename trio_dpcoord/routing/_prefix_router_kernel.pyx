# cython: language_level=3, boundscheck=True, wraparound=True
"""The compiled twin of :mod:`trio_dpcoord.routing._prefix_router`'s per-decision steps:
``PrefixRouter._decide``, ``_walk``, ``_bisect`` and ``_pick``, the same steps on the same
objects without a bytecode per step. ``choose`` (a check and a call) and ``settle`` (a few
calls) stay the pure methods: compiled copies of them measured no faster.

:mod:`._prefix_router` (pure Python) is the spec. All but ``_pick`` are its steps line
for line, on untyped objects (Python's own arithmetic); they call the router's other methods as it does,
so a method replaced on the class (``benchmarks/tools/decision_profile.py`` times the
parts so) is still the one called. ``_pick`` computes the same choice over the ranks in
C: the queued work read once into doubles, each group's mask into bytes. It leaves to
the pure method whatever C's arithmetic could answer otherwise than Python's (a queued
value neither a float nor an int within 2**50, a NaN, a setting other than a finite
float, queued work that is not a list or a tuple, groups not in a list) and the rendezvous
(``rendezvous_slack`` with a prompt: Python's hashing). ``tests/routing/
test_compiled_twin.py`` runs both builds side by side.
"""

from cpython.float cimport PyFloat_AS_DOUBLE, PyFloat_CheckExact
from cpython.long cimport PyLong_CheckExact
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.sequence cimport PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS


cdef extern from "Python.h":
    int PyObject_GenericSetAttr(object o, object name, object value) except -1
    long long PyLong_AsLongLongAndOverflow(object o, int *overflow) except? -1


cdef extern from *:
    """
    /* a * b, never fused with a following add (an FMA rounds once where Python's
       float arithmetic rounds twice) */
    static double tdc_product(double a, double b) {
        volatile double product = a * b;
        return product;
    }
    """
    double tdc_product(double a, double b)


cdef object _pure_pick = None
cdef object _RouteDecision = None
cdef object _ChunkedKeys = None
cdef object _bisect_holders = None
cdef Py_ssize_t _CHUNK_BLOCKS = 16

cdef double _EXACT = 1125899906842624.0  # 2**50: ints below it are exact as doubles, and
# so are the sums and differences the pick makes of them


cdef inline bint _as_double(PyObject *item, double *out):
    """``item`` as a double where C's arithmetic on it gives Python's: a float other
    than NaN, or an int (not a bool) within 2**50; False otherwise."""
    cdef double value
    cdef long long whole
    cdef int overflow = 0
    if PyFloat_CheckExact(<object>item):
        value = PyFloat_AS_DOUBLE(<object>item)
        if value != value:
            return False
        out[0] = value
        return True
    if PyLong_CheckExact(<object>item):
        whole = PyLong_AsLongLongAndOverflow(<object>item, &overflow)
        if overflow or whole >= <long long>_EXACT or whole <= -<long long>_EXACT:
            return False
        out[0] = <double>whole
        return True
    return False


cdef inline bint _setting(object value, double *out):
    """A setting as a double where it is a float other than NaN (an int setting times an
    int is exact in Python, not always in doubles: the pure method takes it)."""
    if not PyFloat_CheckExact(value):
        return False
    return _as_double(<PyObject *>value, out)


cdef object _decision(object engine, object cached, object guarded):
    """``RouteDecision(engine, cached, guarded)``, its three slots set as its
    ``__init__`` (frozen: ``object.__setattr__``) sets them, without a Python frame."""
    decision = _RouteDecision.__new__(_RouteDecision)
    PyObject_GenericSetAttr(decision, "engine_index", engine)
    PyObject_GenericSetAttr(decision, "cached_tokens", cached)
    PyObject_GenericSetAttr(decision, "guarded", guarded)
    return decision


cdef int _read_mask(object mask, unsigned char *bits, Py_ssize_t width) except -1:
    """The bytes of ``mask`` (a rank mask, below ``2 ** (8 * width)``), little end first."""
    cdef unsigned long long word
    cdef Py_ssize_t at
    cdef bytes raw
    if width <= 8:
        word = mask
        for at in range(width):
            bits[at] = (word >> (8 * at)) & 0xFF
        return 0
    raw = mask.to_bytes(width, "little")
    cdef const unsigned char *data = raw
    for at in range(width):
        bits[at] = data[at]
    return 0


cdef inline bint _has(const unsigned char *bits, Py_ssize_t rank):
    return (bits[rank >> 3] >> (rank & 7)) & 1


def pick(self, groups, keys, prompt_len, queued, unshared_choice=None):
    """``PrefixRouter._pick``: the same choice, its steps over the ranks in C."""
    routing = self.routing
    cdef double weight, imbalance_abs, imbalance_rel
    if (
        (routing.rendezvous_slack and keys)
        or not _setting(routing.reuse_weight, &weight)
        or not _setting(routing.imbalance_abs, &imbalance_abs)
        or not _setting(routing.imbalance_rel, &imbalance_rel)
        or not (type(queued) is list or type(queued) is tuple)
        or type(groups) is not list
        or type(prompt_len) is not int
        or not -_EXACT < prompt_len < _EXACT
        or weight - weight != 0.0  # infinite: inf * 0 is NaN, kept to Python
    ):
        return _pure_pick(self, groups, keys, prompt_len, queued, unshared_choice)
    cdef Py_ssize_t ranks = self.engine_count
    cdef Py_ssize_t size = PySequence_Fast_GET_SIZE(queued)
    if size != ranks or ranks < 1:
        return _pure_pick(self, groups, keys, prompt_len, queued, unshared_choice)
    cdef Py_ssize_t width = (ranks + 7) // 8
    cdef double *work = <double *>PyMem_Malloc(ranks * sizeof(double) + width)
    if work == NULL:
        raise MemoryError()
    try:
        return _pick(self, groups, keys, prompt_len, queued, unshared_choice, work, ranks,
                     width, weight, imbalance_abs, imbalance_rel)
    finally:
        PyMem_Free(work)


cdef object _pick(self, groups, keys, prompt_len, queued, unshared_choice, double *work,
                  Py_ssize_t ranks, Py_ssize_t width, double weight, double imbalance_abs,
                  double imbalance_rel):
    cdef unsigned char *bits = <unsigned char *>(work + ranks)
    cdef PyObject **items = PySequence_Fast_ITEMS(queued)
    cdef Py_ssize_t rank
    # The queued work as doubles, every value checked before anything changes.
    for rank in range(ranks):
        if not _as_double(items[rank], &work[rank]):
            return _pure_pick(self, groups, keys, prompt_len, queued, unshared_choice)
    cdef Py_ssize_t start = self._rotation
    self._rotation = (start + 1) % ranks
    cdef Py_ssize_t block = self.block_size
    if not groups and unshared_choice is not None:  # (no rendezvous here: see pick)
        chosen = unshared_choice() if callable(unshared_choice) else unshared_choice
        if 0 <= chosen < ranks:
            return _decision(chosen, 0, False)
    # min() and max(): the first of the least and of the most
    cdef double low = work[0], high = work[0]
    for rank in range(1, ranks):
        if work[rank] < low:
            low = work[rank]
        if work[rank] > high:
            high = work[rank]
    cdef Py_ssize_t least = -1
    for rank in range(start, ranks):  # first_from: at or after start, wrapping
        if work[rank] == low:
            least = rank
            break
    if least < 0:
        for rank in range(ranks):
            if work[rank] == low:
                least = rank
                break
    # _depth_of(groups, least); the groups' masks are read again below (few groups)
    cdef list group_list = groups
    cdef Py_ssize_t least_depth = 0
    cdef Py_ssize_t depth
    for group in group_list:
        depth, mask = group
        _read_mask(mask, bits, width)
        if _has(bits, least):
            least_depth = depth
            break
    if ranks == 1:
        return _decision(0, least_depth * block, False)
    cdef double floor = low if low >= 1.0 else 1.0  # max(low, 1.0): low unless 1.0 is more
    if high - low > imbalance_abs and high > tdc_product(imbalance_rel, floor):
        self.counters.guard_fallbacks += 1
        return _decision(least, least_depth * block, True)
    # The candidates, one per depth deeper than the least loaded rank's (see _pick), and
    # the cost of each as the pure loop weighs them, the least kept as it goes.
    cdef Py_ssize_t deepest = 0
    cdef Py_ssize_t candidates = 1
    cdef Py_ssize_t chosen_rank = least, chosen_depth = least_depth
    cdef Py_ssize_t candidate_rank, members, offset
    cdef double value = 0.0
    if group_list:
        deepest = group_list[-1][0]
    cdef double most = <double>(deepest * block)
    cdef double prompt = <double>prompt_len
    cdef double best_cost = 0.0
    cdef Py_ssize_t best_cached = 0, best_turn = 0
    cdef bint have_best = False
    for group in group_list:
        depth, mask = group
        if depth <= least_depth:
            continue
        _read_mask(mask, bits, width)
        members = 0
        candidate_rank = -1
        for rank in range(ranks):  # the least queued of the members, first found
            if _has(bits, rank):
                if not members or work[rank] < value:
                    value = work[rank]
                members += 1
        for offset in range(ranks):  # the first member holding it from start on, wrapping
            rank = start + offset
            if rank >= ranks:
                rank -= ranks
            if _has(bits, rank) and work[rank] == value:
                candidate_rank = rank
                break
        if candidate_rank < 0:
            continue
        if not have_best:  # the least loaded rank is the first candidate
            _weigh(least, least_depth, work, block, prompt, most, weight, start, ranks,
                   &best_cost, &best_cached, &best_turn)
            have_best = True
        candidates += 1
        if _better(candidate_rank, depth, work, block, prompt, most, weight, start, ranks,
                   &best_cost, &best_cached, &best_turn):
            chosen_rank, chosen_depth = candidate_rank, depth
    if candidates == 1:
        return _decision(least, least_depth * block, False)
    return _decision(chosen_rank, chosen_depth * block, False)


cdef inline void _weigh(Py_ssize_t rank, Py_ssize_t depth, double *work, Py_ssize_t block,
                        double prompt, double most, double weight, Py_ssize_t start,
                        Py_ssize_t ranks, double *cost, Py_ssize_t *cached,
                        Py_ssize_t *turn):
    """The pure loop's ``(cost, -cached, (rank - start) % ranks)`` of one candidate."""
    cdef Py_ssize_t held = depth * block
    cost[0] = ((work[rank] + prompt) - <double>held) + tdc_product(weight, most - <double>held)
    cached[0] = held
    turn[0] = (rank - start) % ranks
    if turn[0] < 0:
        turn[0] += ranks


cdef inline bint _better(Py_ssize_t rank, Py_ssize_t depth, double *work, Py_ssize_t block,
                         double prompt, double most, double weight, Py_ssize_t start,
                         Py_ssize_t ranks, double *best_cost, Py_ssize_t *best_cached,
                         Py_ssize_t *best_turn):
    """Whether the candidate's tuple is below the best's (then it is the best): Python's
    tuple order, the first item that differs decides."""
    cdef double cost
    cdef Py_ssize_t cached, turn
    _weigh(rank, depth, work, block, prompt, most, weight, start, ranks, &cost, &cached, &turn)
    cdef bint less
    if cost != best_cost[0]:
        less = cost < best_cost[0]
    elif cached != best_cached[0]:
        less = -cached < -best_cached[0]
    else:
        less = turn < best_turn[0]
    if less:
        best_cost[0], best_cached[0], best_turn[0] = cost, cached, turn
    return less


def walk(self, keys):
    """``PrefixRouter._walk``: bisect closed indexes, else block by block."""
    if self._closed:
        return self._bisect(keys)
    return self._walk_blocks(keys)


def bisect(self, keys):
    """``PrefixRouter._bisect``: the same lookups, in the same order."""
    cdef Py_ssize_t count = len(keys)
    if not count:
        return []
    cdef dict owners = self._owners
    everyone = self._all
    chunks = [keys]
    cdef Py_ssize_t span = count
    cdef Py_ssize_t known, end
    if isinstance(keys, _ChunkedKeys):
        chunks, span = keys.chunks, _CHUNK_BLOCKS  # (the list extend() appends to)
        if keys.known < count:
            if not keys.known:
                if not owners.get(keys.probe(), 0) & everyone:
                    return []
                keys.extend()
            first = owners.get(chunks[0][0], 0) & everyone
            if not first:
                return []
            while True:  # a chunk more while ranks hold the block past the known ones
                known = keys.known
                end = known - 1
                last = owners.get(chunks[end // span][end % span], 0) & first
                if known == count or not last or not owners.get(keys.probe(), 0) & last:
                    return _bisect_holders(owners, chunks, span, known, first, last)
                keys.extend()
    first = owners.get(chunks[0][0], 0) & everyone
    if not first:
        return []
    end = count - 1
    last = owners.get(chunks[end // span][end % span], 0) & first
    return _bisect_holders(owners, chunks, span, count, first, last)


def decide(self, token_ids, queued, now, pinned, unshared_choice):
    """``PrefixRouter._decide``, step for step."""
    self.counters.decisions += 1
    if self._pending is not None:
        self.settle()
    routing = self.routing
    keys = self._keys.lookup(token_ids) if self._closed else list(self._keys(token_ids))
    if now >= self._next_sweep:
        for index in self._indexes:
            index.expire(now)
        self._next_sweep = now + routing.max_age / 8
    if self.feed == "exact" and routing.provisional_age and now >= self._next_belief_sweep:
        for index in self._indexes:
            index.expire_provisional(now)
        self._next_belief_sweep = now + routing.provisional_age / 8
    groups = self._walk(keys)
    if pinned is not None:
        depth = self._depth_of(groups, pinned)
        decision = _decision(pinned, depth * self.block_size, False)
    else:
        decision = self._pick(groups, keys, len(token_ids), queued, unshared_choice)
    if routing.rendezvous_home and keys:
        self._branches.learn(keys, self.engine_count * routing.capacity_blocks)
    counters = self.counters
    counters.prompt_tokens += len(token_ids)
    counters.cached_tokens += decision.cached_tokens
    if keys:
        if self.feed == "approximate":
            held = decision.cached_tokens // self.block_size
            self._pending = (decision.engine_index, keys, held, now)
            if not self.defer_store:
                self.settle()
        elif routing.provisional_age > 0:
            until = now + min(routing.provisional_age, routing.max_age)
            self._indexes[decision.engine_index].store_provisionally(keys, now, until)
    return decision


def accelerate(namespace):
    """The replacements for the pure module's names (``namespace``: its globals): the
    router's per-decision methods become this module's functions."""
    global _pure_pick, _RouteDecision, _ChunkedKeys, _bisect_holders, _CHUNK_BLOCKS
    router = namespace["PrefixRouter"]
    _pure_pick = router._pick
    _RouteDecision = namespace["RouteDecision"]
    _ChunkedKeys = namespace["ChunkedKeys"]
    _bisect_holders = namespace["bisect_holders"]
    _CHUNK_BLOCKS = namespace["CHUNK_BLOCKS"]
    router._decide = decide
    router._walk = walk
    router._bisect = bisect
    router._pick = pick
    return {}
