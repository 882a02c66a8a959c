"""Where a prefix decision's time goes: ``python -m benchmarks.tools.decision_profile``.

The decision of ``python -m benchmarks routing_decision`` (a follow-up turn of 4,096
tokens on a warm index, :func:`benchmarks.sections.routing_decision.warm_decision`), split
into its parts: the prompt's keys, the walk, the pick and the store (with the deferred
store, when the router has one: what the call does after the choice, timed apart). Two readings:

- ``timed``: each part's own clock (``time.perf_counter_ns`` around the router's method,
  wrapped on the instance; a part the router does not have is left out), p50 per
  decision, next to the p50 of whole decisions without the wrappers, passes alternated;
- ``--cprofile``: cProfile over the same decisions, each part's cumulative time per
  decision (cProfile's own cost inflates Python-level calls, so the sum is above the
  plain decision's; it names the functions inside each part).

``--defer`` sets ``PrefixRouter.defer_store`` and times ``settle()`` apart (the parts
done there are marked ``(settle)``); ``--no-reuse`` feeds fresh random prompts instead
of follow-ups; ``--floor`` times the least parts instead (:func:`floor`; with
``--between``, in the benchmark's colder context), ``--tail`` what the slow decisions
are made of (:func:`tail`: collections, resizes).

Works on the router before and after issue 37's cuts (it wraps whichever methods
exist), so that ``cd OLD && PYTHONPATH=OLD:REPO python -m benchmarks.tools.decision_profile``
profiles an older ``trio_dpcoord`` (unpacked in OLD) with the same prompts (``-m`` puts
the working directory first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.sections.routing_decision import (
    WarmDecision,
    follow_up_prompts,
    pure_twin_chooser,
    random_tokens,
    warm_decision,
)
from trio_dpcoord import EngineChooser
from trio_dpcoord.routing import ChunkedKeys, ChunkKeys, PrefixRouter, RankPrefixIndex

PARTS: tuple[tuple[str, type, str], ...] = (
    ("keys", ChunkKeys, "__call__"),
    ("keys", ChunkKeys, "lookup"),
    ("keys", ChunkedKeys, "complete"),
    ("walk", PrefixRouter, "_walk"),
    ("pick", PrefixRouter, "_pick"),
    ("store", RankPrefixIndex, "_store_chain"),
    ("store", RankPrefixIndex, "store"),
)
"""(part, class, method): wrapped on the class where the class has it (a part's outer
call is timed; nested calls of the same part are inside it)."""

CPROFILE_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "keys": ("__call__", "lookup", "complete"),
    "walk": ("_walk",),
    "pick": ("_pick",),
    "store": ("_store_chain",),
}


def _wrap(
    part: str, method: Callable[..., Any], times: dict[str, int], active: list[str]
) -> Callable[..., Any]:
    clock = time.perf_counter_ns

    def timed(*args: Any, **kwargs: Any) -> Any:
        if part in active:  # nested in the same part: timed by the outer call
            return method(*args, **kwargs)
        active.append(part)
        t0 = clock()
        try:
            return method(*args, **kwargs)
        finally:
            times[part] = times.get(part, 0) + clock() - t0
            active.pop()

    return timed


def instrument() -> tuple[dict[str, int], Callable[[], None]]:
    """Wrap the parts' methods; returns the per-part nanoseconds (cleared by the caller)
    and the undo."""
    times: dict[str, int] = {}
    active: list[str] = []
    undo: list[tuple[type, str, Any]] = []
    for part, owner, name in PARTS:
        original = owner.__dict__.get(name)
        if original is None:
            continue
        setattr(owner, name, _wrap(part, original, times, active))
        undo.append((owner, name, original))

    def restore() -> None:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)

    return times, restore


def profile(
    ranks: int,
    calls: int,
    passes: int,
    capacity_blocks: int,
    use_cprofile: bool,
    defer: bool,
    no_reuse: bool = False,
) -> dict[str, Any]:
    """The parts of ``passes`` x ``calls`` decisions at ``ranks`` (see the module
    docstring); with ``defer``, the router's store deferred (``defer_store``) and
    ``settle()`` timed apart after each choice; with ``no_reuse``, fresh random prompts
    of 4,096 tokens instead of follow-up turns (nothing to match, all to store)."""
    warm = warm_decision(ranks, capacity_blocks)
    make_prompts: Callable[[WarmDecision, int], list[list[int]]] = follow_up_prompts
    if no_reuse:

        def make_prompts(warm: WarmDecision, calls: int) -> list[list[int]]:
            return [random_tokens(warm.rng, 4096) for _ in range(calls)]

    chooser, loads = warm.chooser, warm.loads
    router = chooser.router
    assert router is not None
    deferring = defer and hasattr(router, "settle")
    if deferring:
        router.defer_store = True
    settle: Callable[[], None] = router.settle if deferring else (lambda: None)
    now = warm.now
    clock = time.perf_counter_ns
    whole: list[float] = []
    settled: list[float] = []
    parts: dict[str, list[float]] = {}
    for _ in range(passes):
        for prompt in make_prompts(warm, calls):  # plain decisions
            t0 = clock()
            chooser.choose(loads, prompt, now=now)
            t1 = clock()
            settle()
            t2 = clock()
            whole.append((t1 - t0) / 1000)
            settled.append((t2 - t1) / 1000)
            now += 1e-4
        times, restore = instrument()  # the same kind of decisions, parts timed
        try:
            for prompt in make_prompts(warm, calls):
                times.clear()
                chooser.choose(loads, prompt, now=now)
                in_choice = dict(times)
                settle()
                for part, ns in times.items():
                    parts.setdefault(part, []).append(in_choice.get(part, 0) / 1000)
                    later = (ns - in_choice.get(part, 0)) / 1000
                    parts.setdefault(part + " (settle)", []).append(later)
                now += 1e-4
        finally:
            restore()
    result: dict[str, Any] = {
        "ranks": ranks,
        "prompts": "no reuse" if no_reuse else "follow-up",
        "deferred": deferring,
        "choose_p50_us": statistics.median(whole),
        "choose_p99_us": _percentile(whole, 99),
        "settle_p50_us": statistics.median(settled),
        "settle_p99_us": _percentile(settled, 99),
        "both_p50_us": statistics.median(map(sum, zip(whole, settled, strict=True))),
        "parts_p50_us": {
            part: statistics.median(values) for part, values in parts.items() if any(values)
        },
    }
    if use_cprofile:
        prompts = make_prompts(warm, calls)
        profiler = cProfile.Profile()
        profiler.enable()
        for prompt in prompts:
            chooser.choose(loads, prompt, now=now)
            settle()
            now += 1e-4
        profiler.disable()
        stats = pstats.Stats(profiler)
        cumulative: dict[str, float] = {}
        own: list[tuple[float, str]] = []
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        for (filename, _line, name), (_cc, _nc, tt, ct, _callers) in raw.items():
            if "trio_dpcoord" not in filename:
                continue
            module = filename.rsplit("/", 1)[-1]
            for part, names in CPROFILE_FUNCTIONS.items():
                if name in names and module.startswith("_prefix"):
                    cumulative[part] = cumulative.get(part, 0.0) + ct / calls * 1e6
            own.append((tt / calls * 1e6, f"{module}:{name}"))
        result["cprofile_cumulative_us"] = cumulative
        result["cprofile_total_us"] = stats.total_tt / calls * 1e6  # type: ignore[attr-defined]
        result["cprofile_own_us"] = {name: value for value, name in sorted(own)[::-1][:12]}
    return result


def floor(
    ranks: int, calls: int, passes: int, capacity_blocks: int, between: bool = False
) -> dict[str, Any]:
    """The least parts of a decision cost on the same warm index and prompts, p50 and
    p99 each (the lowest of ``passes``, as ``routing_decision`` takes them): reading the
    prompt at all (a list copy: every token's object touched), hashing its whole chunks
    as tuples (as :class:`ChunkKeys` does), the key lookup (hashes, prefix ids, one to
    three lookups), lookup and walk, and the pick after them (the router's own, without
    the chooser around it); "prompt hot": the prompt's tokens read just before (a copy),
    as a tokenizer's or a decoder's fresh output would be (the benchmark's follow-ups
    reuse a document's token objects, made long before, so reading them is cold).

    ``between``: each timed step is followed, as each decision of ours is in
    ``routing_decision``, by vLLM's score on the same loads and prompt and the pure
    twin's whole decision on an index of its own (on a compiled build): the floor in
    the benchmark's own context, where ours run colder than back to back."""
    warm = warm_decision(ranks, capacity_blocks)
    chooser, loads = warm.chooser, warm.loads
    router = chooser.router
    assert router is not None
    now = warm.now
    for prompt in follow_up_prompts(warm, 2 * ranks):  # every document followed up once
        chooser.choose(loads, prompt, now=now)
        now += 1e-4
    span = router._keys._span
    queued = [float(10 * (rank % 7)) for rank in range(ranks)]

    def chunk_hashes(prompt: list[int]) -> None:
        list(map(hash, zip(*(iter(prompt),) * span, strict=False)))

    def lookup_walk(prompt: list[int]) -> None:
        router._walk(router._keys.lookup(prompt))

    def lookup_walk_pick(prompt: list[int]) -> None:
        keys = router._keys.lookup(prompt)
        router._pick(router._walk(keys), keys, len(prompt), queued)

    steps: dict[str, Callable[[list[int]], Any]] = {
        "copy the prompt (p[:])": lambda prompt: prompt[:],
        "hash its chunks": chunk_hashes,
        "hash its chunks, prompt hot": chunk_hashes,
        "keys lookup": router._keys.lookup,
        "keys lookup + walk": lookup_walk,
        "keys lookup + walk + pick": lookup_walk_pick,
        "keys lookup + walk + pick, prompt hot": lookup_walk_pick,
    }
    others: list[Callable[[list[int]], Any]] = []  # run after each timed step
    if between:
        base = EngineChooser(ranks)
        others.append(lambda prompt: base.choose(loads, prompt, now=now))
        twin = pure_twin_chooser(ranks, capacity_blocks)
        if twin is not None:
            others.append(lambda prompt: twin.choose(loads, prompt, now=now))
    clock = time.perf_counter_ns
    best: dict[str, float] = {}
    best_p99: dict[str, float] = {}
    for _ in range(passes):
        for name, step in steps.items():
            timings: list[float] = []
            for prompt in follow_up_prompts(warm, calls):
                if name.endswith("hot"):
                    prompt[:]  # every token's object read just before
                t0 = clock()
                step(prompt)
                timings.append((clock() - t0) / 1000)
                for other in others:
                    other(prompt)
            value, tail_value = statistics.median(timings), _percentile(timings, 99)
            best[name] = min(best.get(name, value), value)
            best_p99[name] = min(best_p99.get(name, tail_value), tail_value)
    return {
        "ranks": ranks,
        "context": "between vLLM's and the pure twin's decisions" if between else "back to back",
        "floor_p50_us": best,
        "floor_p99_us": best_p99,
    }


def tail(ranks: int, calls: int, passes: int, capacity_blocks: int) -> dict[str, Any]:
    """What the slow decisions are made of: each plain decision (as :func:`profile`
    times them) tagged by what happened inside it: a garbage collection (counted by
    ``gc.callbacks``), a resize of the owners map, of the chunk cache or of a rank's
    pieces (``sys.getsizeof`` changed); p50/p99 of all, of the untagged and of each tag
    with its share, then the same decisions with the collector off (``gc.disable()``),
    passes alternated."""
    warm = warm_decision(ranks, capacity_blocks)
    chooser, loads = warm.chooser, warm.loads
    router = chooser.router
    assert router is not None
    now = warm.now
    clock = time.perf_counter_ns
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    def sizes() -> tuple[int, ...]:
        pieces = sum(sys.getsizeof(index._pieces) for index in router._indexes)
        return sys.getsizeof(router._owners), sys.getsizeof(router._keys._chunks), pieces

    tagged: dict[str, list[float]] = {}
    collector_off: list[float] = []
    gc.callbacks.append(count)
    try:
        for _ in range(passes):
            for prompt in follow_up_prompts(warm, calls):
                before = sizes()
                collections.clear()
                t0 = clock()
                chooser.choose(loads, prompt, now=now)
                elapsed = (clock() - t0) / 1000
                now += 1e-4
                after = sizes()
                tags = [f"gc gen{generation}" for generation in collections]
                names = ("owners resized", "chunk cache resized", "pieces resized")
                tags += [name for name, a, b in zip(names, before, after, strict=True) if a != b]
                tagged.setdefault("all", []).append(elapsed)
                for tag in tags or ["untagged"]:
                    tagged.setdefault(tag, []).append(elapsed)
            gc.disable()
            try:
                for prompt in follow_up_prompts(warm, calls):
                    t0 = clock()
                    chooser.choose(loads, prompt, now=now)
                    collector_off.append((clock() - t0) / 1000)
                    now += 1e-4
            finally:
                gc.enable()
    finally:
        gc.callbacks.remove(count)
    total = len(tagged["all"])
    found: dict[str, Any] = {
        tag: {
            "share_pct": 100 * len(values) / total,
            "p50_us": statistics.median(values),
            "p99_us": _percentile(values, 99),
        }
        for tag, values in tagged.items()
    }
    found["gc.disable()"] = {
        "p50_us": statistics.median(collector_off),
        "p99_us": _percentile(collector_off, 99),
    }
    return {"ranks": ranks, "tail": found, "gc_threshold": gc.get_threshold()}


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 2)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return value


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.decision_profile")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 256])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--capacity-blocks", type=int, default=1024)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument(
        "--defer", action="store_true", help="defer the store (settle() timed apart)"
    )
    parser.add_argument("--no-reuse", action="store_true", help="fresh random prompts")
    parser.add_argument("--floor", action="store_true", help="the least parts (see floor())")
    parser.add_argument(
        "--between",
        action="store_true",
        help="with --floor: each step followed by vLLM's and the pure twin's decisions",
    )
    parser.add_argument("--tail", action="store_true", help="the slow decisions (see tail())")
    arguments = parser.parse_args(argv)
    for ranks in arguments.ranks:
        if arguments.tail:
            found = tail(ranks, arguments.calls, arguments.passes, arguments.capacity_blocks)
            print(json.dumps(_rounded(found)), flush=True)
            continue
        if arguments.floor:
            found = floor(
                ranks,
                arguments.calls,
                arguments.passes,
                arguments.capacity_blocks,
                arguments.between,
            )
            print(json.dumps(_rounded(found)), flush=True)
            continue
        result = profile(
            ranks,
            arguments.calls,
            arguments.passes,
            arguments.capacity_blocks,
            arguments.cprofile,
            arguments.defer,
            arguments.no_reuse,
        )
        print(json.dumps(_rounded(result)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
