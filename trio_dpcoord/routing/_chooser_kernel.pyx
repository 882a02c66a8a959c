# cython: language_level=3, boundscheck=True, wraparound=True
"""The compiled twin of :mod:`trio_dpcoord.routing._chooser`'s per-choice steps:
``EngineChooser.choose``, ``_choose_prefix``, ``_charge`` and ``_rescore`` (``_clock``,
a comparison, stays the pure method),
each the pure method's steps line for line on untyped objects (Python's own arithmetic and comparisons), without a bytecode per step, with
:func:`~trio_dpcoord.routing._score.vllm_score`'s steps inline in ``_rescore``.

One step is read otherwise, to the same effect: a load table whose engines are the very
objects of the last one is the same table (``tuple(loads) != table`` is false when
every item is identical), so it is not copied to be compared.

:mod:`._chooser` (pure Python) is the spec; ``tests/routing/test_compiled_twin.py`` runs
choosers of both builds side by side.
"""

from cpython.object cimport PyObject
from cpython.sequence cimport PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS


cdef object _EngineLoad = None
cdef object _tuple_new = tuple.__new__
cdef object _partial = None
cdef object _isfinite = None
cdef object _UNIT_SMOOTHING = None


cdef bint _same_table(loads, table):
    """Whether ``loads`` (a list or tuple) holds the very objects of ``table`` (a tuple)
    in order: then ``tuple(loads) == table``."""
    if not (type(loads) is list or type(loads) is tuple) or type(table) is not tuple:
        return False
    cdef Py_ssize_t count = PySequence_Fast_GET_SIZE(loads)
    if count != PySequence_Fast_GET_SIZE(table):
        return False
    cdef PyObject **mine = PySequence_Fast_ITEMS(loads)
    cdef PyObject **theirs = PySequence_Fast_ITEMS(table)
    cdef Py_ssize_t at
    for at in range(count):
        if mine[at] != theirs[at]:
            return False
    return True


def choose(self, loads, prompt_token_ids=None, *, now=None):
    """``EngineChooser.choose``, step for step."""
    count = len(loads)
    if count == 0:
        raise ValueError("no engines to choose from")
    if count != len(self._inflight):
        self._resize(count)
    if not _same_table(loads, self._table):
        table = tuple(loads)
        if table != self._table:
            self._follow_report(table)
    start = self._start
    self._start = (start + 1) % count
    router = self._router
    if router is not None:
        best_index = self._choose_prefix(router, prompt_token_ids, now, start)
    else:
        best_index = self._lowest(start)
    local = self._local
    chosen = local[best_index]
    waiting = chosen.waiting + self._client_count
    if type(chosen) is _EngineLoad:  # its three fields: built directly, not by _replace
        local[best_index] = _tuple_new(
            _EngineLoad, (waiting, chosen.running, chosen.kv_cache_usage)
        )
    else:
        local[best_index] = chosen._replace(waiting=waiting)
    self._inflight[best_index] += 1
    self._rescore(best_index)
    return best_index


cdef object _score(waiting, running, kv_cache_usage, in_flight, client_count):
    """``vllm_score`` (``_score.py``), its steps on objects: ``max(a, b)`` is ``b if b > a
    else a``, as the builtin compares."""
    shared = client_count * in_flight
    queue = waiting + running
    score = float(queue if queue > shared else shared)
    if waiting:
        over = kv_cache_usage - 0.5
        score += waiting * 6.0 * (over if over > 0.0 else 0.0)
    return score


def rescore(self, index):
    """``EngineChooser._rescore``."""
    local = self._local[index]
    score = _score(
        local.waiting,
        local.running,
        local.kv_cache_usage,
        self._inflight[index],
        self._client_count,
    )
    self._scores[index] = score
    if not _isfinite(score):
        self._finite = False


def choose_prefix(self, router, prompt_token_ids, now, start):
    """``EngineChooser._choose_prefix``."""
    tokens = prompt_token_ids if prompt_token_ids is not None else ()
    decision = router.choose(
        tokens, self._queued, self._clock(now), unshared_choice=_partial(self._lowest, start)
    )
    self._charge(decision.engine_index, len(tokens) - decision.cached_tokens, bool(tokens))
    return decision.engine_index


def charge(self, rank, uncached, has_prompt):
    """``EngineChooser._charge``."""
    if has_prompt:
        mean = self._mean_uncached
        self._mean_uncached = (
            float(uncached) if mean is None else mean + (uncached - mean) * _UNIT_SMOOTHING
        )
    cost = self._client_count * (float(uncached) if has_prompt else self._unit)
    self._queued[rank] += cost
    self._pending[rank] += cost


def accelerate(namespace):
    """The replacements for the pure module's names (``namespace``: its globals): the
    chooser's per-choice methods become this module's functions."""
    global _EngineLoad, _partial, _isfinite, _UNIT_SMOOTHING
    _EngineLoad = namespace["EngineLoad"]
    _partial = namespace["partial"]
    _isfinite = namespace["isfinite"]
    _UNIT_SMOOTHING = namespace["_UNIT_SMOOTHING"]
    chooser = namespace["EngineChooser"]
    chooser.choose = choose
    chooser._choose_prefix = choose_prefix
    chooser._charge = charge
    chooser._rescore = rescore
    return {}
