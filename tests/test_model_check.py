"""Exhaustive check of the coordinator's rules: a small bounded model checker.

It explores every interleaving of engine subscriptions, front-end requests, engine
reports, coordinator decisions and message deliveries for 2-3 engines, with the
coordinator being our real, whole :class:`trio_dpcoord.CoordinatorCore`, fed the bytes
the engines and front-ends would send: the start-up gate and READY, the wave rules, the
front publishes the publish-fed front-ends read, and the wake-confirmation watchdog. Engines
follow docs/protocol.md §6.9 in the abstract (subscribed, ready, wave, running, unserved
requests); they serve nothing before READY; lock-step is modelled by letting a step or a
wave end happen only while every engine runs. A wake-confirmation deadline passes only
when nothing else can happen (the timeout is far longer than any delivery or step).

Channels have ZeroMQ's ordering: each engine's PUSH to the coordinator is FIFO but
unordered against other engines'; every engine consumes its broadcasts and its requests
(two sockets) in order but independently of its peers; the front socket's legacy
FIRST_REQ notices are FIFO and applied as they are read (``receive_front_frame``). The
embedding handle claims the wake-up synchronously (``claim_first_request``); the service
then applies the claim's ``FirstRequest`` at once, under the same lock. The checker lets
each claim wait in a FIFO queue and be applied at any later point instead: a superset of
the service's interleavings, which also covers an embedder that drives the core itself
and applies its claims later, as the core's contract allows.

The checker reads the core's private decision state (``_observe``) to memoise states, and
swaps its wave rule for the mutants, through test hooks of :mod:`trio_dpcoord.testing`
(``core_internals``, ``replace_wave_rule``, ``force_wave_state``): no public read of the
core should expose what only a state-space search needs.

Checked in every reachable state: the coordinator's wave never decreases; it never
broadcasts a wave it already broadcast while that wave runs; engines stepping together
agree on the wave. Checked in every quiescent state (nothing enabled): no request is left
unserved, no engine runs while a peer sleeps (it would block in the per-step collectives
forever), and the coordinator's snapshot agrees with the engines (paused at their wave).

Restarts (docs/protocol.md §16): in the worlds that have them, the coordinator dies at any
point and a fresh core takes over with ``restarted()``: in place (the same sockets, the
gate and subscriptions carried over) or as a new process (the engines subscribe again).
What the dead one had read (a prefix of each engine's reports, of the front socket's
notices, the handle's claims) it applied but never answered; the rest lives on. Checked
besides: no START_DP_WAVE for an older wave than the last, no front-end reading an older
wave than it had, and no START_DP_WAVE repeating the last one's wave but the one recovery
wake a restart adds (or after a passed wake deadline). Engines there may also send a load
report when a request reaches them.

Search is breadth-first with every visited state memoised, so a counterexample is a
shortest one, printed as a numbered trace.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import pytest

from tests.helpers import core_internals
from trio_dpcoord import protocol
from trio_dpcoord.core import (
    Broadcast,
    CoordinatorCore,
    Effect,
    FirstRequest,
    Publish,
    Recovery,
    RecoveryRules,
    Reject,
    WaveSnapshot,
    WaveStart,
    WaveStartCause,
    WaveState,
)

# --- white-box: the mutants' way into a core (private attributes, on purpose) -----------


def replace_wave_rule(core: CoordinatorCore, rule: WaveState) -> None:
    """Make ``rule`` ``core``'s wave rule, in place of the :class:`~trio_dpcoord.core.
    WaveState` it made itself: for a model checker's mutants (a subclass with a known bug
    the checker must catch). Call it before the core's first input. The core's wave rules
    (``_wave_rules.py``) share its wave state, so they take the mutant too."""
    core._wave = core._rules._wave = rule


def wake_deadline(core: CoordinatorCore) -> float:
    """The clock reading of ``core``'s earliest pending wake-confirmation deadline."""
    return core._wake_deadlines.next_due()


def replace_recovery_rules(core: CoordinatorCore, rules: type[RecoveryRules]) -> None:
    """Make a recovering ``core`` follow ``rules`` (a subclass of
    :class:`~trio_dpcoord.core.RecoveryRules` with the same slots, a model checker's mutant
    with a known bug) from now on; nothing when the core is not recovering."""
    if core._rules.recovery is not None:
        core._rules.recovery.__class__ = rules


def force_wave_state(
    rule: WaveState,
    *,
    snapshot: WaveSnapshot | None = None,
    first_request_pending: bool | None = None,
) -> None:
    """Overwrite ``rule``'s snapshot and/or pending claim (what is not None), as a broken
    rule would: the bug of a model checker's mutant. Nothing checks the rule's invariants
    (the wave may go back)."""
    if snapshot is not None:
        rule._snapshot = snapshot
    if first_request_pending is not None:
        rule._first_request_pending = first_request_pending


# --------------------------------------------------------------------------- the model

HANDLE = "handle"
"""Embedded front-end: stamps the coordinator's snapshot, claims and queues FirstRequest."""
PUBLISH = "publish"
"""vLLM 0.33 Python front-end: stamps its view from front publishes, notifies nobody."""
LEGACY = "legacy"
"""Pre-removal Python front-end: like PUBLISH, plus FIRST_REQ upstream when it sees paused."""

REPORT_EVERY_WAKE = "0.33"
"""vLLM 0.33 engines: a request that wakes the engine reports start_wave (§6.3), and rank 0
mirrors the paused->running edge at its first synchronised step (§6.5 step 7, R8)."""
REPORT_STALE_ONLY = "legacy"
"""Engines of the FirstRequest era (Rust generations 1-2): no start_wave when a current
request wakes them, only when the request's wave is already over (R7's older rule); no
rank-0 mirror. The coordinator's first-request rule must wake their peers."""


IN_PLACE = "in place"
"""A restart inside the service: the same sockets, so subscriptions and the gate are carried
over (the XPUB does not report them again), the failed core's wave and state are read."""
PROCESS = "process"
"""A new process on the same addresses: engines connect and subscribe again and go through
the gate; only the wave survives (the file the dead worker kept it in)."""


@dataclass(frozen=True, slots=True)
class Config:
    engines: int
    requests: int
    front_ends: tuple[str, ...]
    engine_kind: str
    wave_state: Callable[[], WaveState] = WaveState
    restarts: int = 0
    """How many times the coordinator dies and a recovering one takes over (§16)."""
    restart_kind: str = PROCESS
    stats: bool = False
    """Engines send a load report (work waiting) when a request reaches them (§6.6)."""
    recovery_rules: type[RecoveryRules] = RecoveryRules
    keep_floor: bool = True
    """The restarted core is told the dead one's wave (mutant: it is not)."""
    lost_applied: bool = True
    """What the dead one read it had applied too (False: read, never applied: a process
    killed between reading a batch and applying it; see the test of its known gap)."""
    repeat_stats: bool = False
    """After the restart, an engine running with work may report its load once more (not
    vLLM: its engines report counts only when they change, and an engine waiting for its
    peers in a step's collective changes none)."""

    def describe(self) -> str:
        text = (
            f"{self.engines} engines ({self.engine_kind}), {self.requests} request(s), "
            f"front-ends {'+'.join(self.front_ends)}, coordinator {self.wave_state.__name__}"
        )
        if self.restarts:
            text += f", {self.restarts} {self.restart_kind} restart(s)"
            text += ", load reports" if self.stats else ""
            text += "" if self.lost_applied else ", what it read unapplied"
            if self.recovery_rules is not RecoveryRules or not self.keep_floor:
                text += f", {self.recovery_rules.__name__}, floor {self.keep_floor}"
        return text


@dataclass(frozen=True, slots=True)
class Engine:
    subscribed: bool = False
    ready: bool = False
    """Got READY: before it, the engine's busy loop does not run (requests wait)."""
    wave: int = 0
    running: bool = False
    work: int = 0
    """Requests received and not yet served."""
    mirror_owed: bool = False
    """Rank 0 woke since its last synchronised step and will report start_wave (R8)."""
    repeated: bool = False
    """Reported its load once more since its last request (``Config.repeat_stats``)."""


Report = tuple[str, int]  # ("start_wave" | "wave_complete" | "stats", wave)
Notice = tuple[int, int]  # (request wave, target engine)
Command = tuple[int, int, bool]  # (request wave, target engine, legacy FIRST_REQ?)
T = TypeVar("T")
READY = (-1, None)
"""READY in an engine's broadcast queue (START_DP_WAVE entries are (wave, exclude))."""


@dataclass(frozen=True, slots=True)
class World:
    """One global state. Equality and hashing ignore the core object itself and use its
    state (see :func:`_observe`) instead."""

    coordinator: tuple[object, ...]
    engines: tuple[Engine, ...]
    requests_in_flight: tuple[tuple[int, ...], ...]
    """Per engine: stamped waves of ADD requests on their way (front-end -> engine)."""
    broadcasts_in_flight: tuple[tuple[tuple[int, int | None], ...], ...]
    """Per engine: READY or START_DP_WAVE [wave, exclude] not yet consumed."""
    reports_in_flight: tuple[tuple[Report, ...], ...]
    """Per engine: its PUSH to the coordinator."""
    commands: tuple[Command, ...]
    """The handle's claimed FirstRequests not yet applied, in order (see the module's
    docstring: the service applies each at once, the checker at any later point)."""
    front_notices: tuple[Notice, ...]
    """Legacy FIRST_REQ notices on their way over the front socket."""
    publishes: tuple[tuple[int, bool], ...]
    """Front publishes (wave, running) not yet read by the viewing front-end."""
    view: tuple[int, bool]
    """The publish-fed front-end's (wave, running)."""
    requests_left: int
    last_broadcast_wave: int
    """The wave of the coordinator's latest START_DP_WAVE (-1 before the first)."""
    deadlines: tuple[int, ...]
    """Waves whose wake-confirmation deadline the watchdog holds, in order."""
    restarts_left: int
    repeats_allowed: int
    """START_DP_WAVEs that may repeat the previous one's wave: one per restart (its
    recovery wake) and one per passed wake deadline (the start was taken back)."""
    core: CoordinatorCore = field(compare=False, hash=False, repr=False)


def initial_world(config: Config) -> World:
    core = CoordinatorCore(config.engines, publish_to_front_ends=_viewing_front_end(config))
    # The mutants below are wave rules with a known bug: the checker must catch each one.
    # Only this test swaps the core's rule object: the hook is a test hook, not the core's.
    replace_wave_rule(core, config.wave_state())
    n = config.engines
    return World(
        coordinator=_observe(core),
        engines=(Engine(),) * n,
        requests_in_flight=((),) * n,
        broadcasts_in_flight=((),) * n,
        reports_in_flight=((),) * n,
        commands=(),
        front_notices=(),
        publishes=(),
        view=(0, False),
        requests_left=config.requests,
        last_broadcast_wave=-1,
        deadlines=(),
        restarts_left=config.restarts,
        repeats_allowed=0,
        core=core,
    )


def _observe(core: CoordinatorCore) -> tuple[object, ...]:
    """Everything in the core that decides what it does next (its counters excepted)."""
    snap = core.snapshot()
    inside = core_internals(core)
    return (
        snap.current_wave,
        snap.engines_running,
        inside.first_request_pending,
        inside.unconfirmed_wave,
        core.gate_open(),
        core.subscriptions().current,
        repr(inside.deferred),
        repr(inside.deferred_commands),
        inside.recovery_wake_owed,
    )


def _set(items: tuple[T, ...], index: int, value: T) -> tuple[T, ...]:
    return (*items[:index], value, *items[index + 1 :])


STALE_NOTICE = "stale first-request notice acted on"
"""R1: a notice handled after the wave it was stamped with has ended."""
LATE_COMPLETE = "late wave_complete ignored"
"""R3: a wave_complete that arrives after the coordinator moved past its wave."""


@dataclass(frozen=True, slots=True)
class Step:
    label: str
    world: World
    violation: str | None = None
    tag: str | None = None
    """Names a race this step exercises, for the coverage counts."""


def _coordinator_step(
    config: Config,
    world: World,
    label: str,
    act: Callable[[CoordinatorCore], Sequence[Effect]],
    *,
    tag: str | None = None,
    fresh: CoordinatorCore | None = None,
    **changes: object,
) -> Step:
    """Run one core input on a copy and carry out the effects it returns in the world;
    with ``fresh``, on that core instead, which replaces the world's (a restart)."""
    core = copy.deepcopy(world.core) if fresh is None else fresh
    before = world.core.snapshot()
    effects = act(core)
    after = core.snapshot()
    violation = None
    if after.current_wave < before.current_wave:
        violation = (
            f"the coordinator's wave decreased: {before.current_wave} -> {after.current_wave}"
            " (rewind)"
        )
    new = replace(world, coordinator=_observe(core), core=core, **changes)  # type: ignore[arg-type]
    started = False
    for effect in effects:
        if isinstance(effect, Broadcast):
            start = effect.wave_start
            if start is None:
                label += " -> READY"
                entry: tuple[int, int | None] = READY
            else:
                started = True
                label += f" -> START_DP_WAVE [{start.wave}, {_exclude(start.exclude)}]"
                if effect.cause == WaveStartCause.RECOVERY:
                    label += " (recovery)"
                if effect.cause in _ARMS_A_WAKE_DEADLINE:
                    new = replace(new, deadlines=(*new.deadlines, start.wave))
                if violation is None and start.wave < new.last_broadcast_wave:
                    violation = (
                        f"START_DP_WAVE for wave {start.wave} after one for wave "
                        f"{new.last_broadcast_wave}: the engines see the wave go back"
                    )
                if (
                    violation is None
                    and before.engines_running
                    and world.core.gate_open()  # decided now, not waiting behind READY
                    and effect.cause != WaveStartCause.RECOVERY
                    and start.wave == before.current_wave == world.last_broadcast_wave
                ):
                    violation = (
                        f"START_DP_WAVE for wave {start.wave}, which was already broadcast and runs"
                    )
                if start.wave == new.last_broadcast_wave:
                    if new.repeats_allowed:
                        new = replace(new, repeats_allowed=new.repeats_allowed - 1)
                    elif violation is None:
                        violation = (
                            f"START_DP_WAVE for wave {start.wave} again, with no restart or "
                            "passed deadline since the last: a wake twice for nothing"
                        )
                entry = (start.wave, start.exclude if isinstance(start.exclude, int) else None)
                new = replace(new, last_broadcast_wave=start.wave)
            new = replace(
                new,
                broadcasts_in_flight=tuple(
                    (*q, entry) if e.subscribed else q
                    for q, e in zip(new.broadcasts_in_flight, new.engines, strict=True)
                ),
            )
        elif isinstance(effect, Publish):
            published = protocol.decode_front_publish(effect.payload)
            seen = (published.current_wave, published.engines_running)
            new = replace(new, publishes=(*new.publishes, seen))
        else:
            assert isinstance(effect, Reject)
            violation = violation or f"the core rejected a valid input: {effect}"
    if not effects:
        label += " -> nothing sent"
    if after.current_wave != before.current_wave:
        label += f"  [wave {before.current_wave} -> {after.current_wave}]"
    if tag == STALE_NOTICE and not started:
        tag = None
    if tag == LATE_COMPLETE and after != before:
        tag = None
    return Step(label, new, violation, tag)


_ARMS_A_WAKE_DEADLINE = (
    WaveStartCause.FIRST_REQUEST,
    WaveStartCause.LEGACY_FIRST_REQUEST,
    WaveStartCause.RECOVERY,
)
"""A start a first-request notice began: the core then expects an engine to confirm it."""


def _receives(frames: list[bytes]) -> Callable[[CoordinatorCore], Sequence[Effect]]:
    return lambda core: core.receive_engine_output(frames, 0.0)


def _engine_output(engine: int, what: str, wave: int) -> list[bytes]:
    stats = None
    if what == "stats":  # a request is waiting: the engine runs its wave
        stats = protocol.SchedulerStats(num_waiting_reqs=1, current_wave=wave)
    out = protocol.EngineCoreOutputs(
        engine_index=engine,
        scheduler_stats=stats,
        wave_complete=wave if what == "wave_complete" else None,
        start_wave=wave if what == "start_wave" else None,
    )
    return [protocol.encode_engine_core_outputs(out)]


def _viewing_front_end(config: Config) -> bool:
    return PUBLISH in config.front_ends or LEGACY in config.front_ends


def _exclude(value: object) -> str:
    return "nil" if value is None else str(value)


def successors(config: Config, world: World) -> Iterator[Step]:
    """Every step enabled in ``world``; a wake deadline passes only when nothing else can
    (a restart aside: one left to happen can happen at any point)."""
    if world.restarts_left:
        yield from _restarts(config, world)
    steps = list(_ordinary_successors(config, world))
    if steps or not world.deadlines:
        yield from steps
        return
    # every deadline pending was armed at the same clock reading (0, or the last passing,
    # where a recovery probe is armed) with the same timeout: they pass together
    waves = " ".join(str(wave) for wave in world.deadlines)
    yield _coordinator_step(
        config,
        world,
        f"the wake-confirmation deadline of wave(s) {waves} passes",
        lambda core: core.tick(wake_deadline(core)),
        deadlines=(),
        repeats_allowed=world.repeats_allowed + len(world.deadlines),
    )


def _restarts(config: Config, world: World) -> Iterator[Step]:
    """The coordinator dies and a recovering one takes over (docs/protocol.md §16).

    What the dead one had read when it died is a prefix of each engine's reports and of
    the front socket's FIRST_REQs, and every claim of the handle (the service applies
    each at once): it applied them (its wave, the floor handed over, includes them) but
    nothing it decided went out. Everything else lives on: the engines, what is on its
    way to them (requests, broadcasts already sent), the publishes already sent, and the
    reports sent later, which reach the new coordinator (ZeroMQ queues them while no one
    listens). In a process restart the engines' XSUBs reconnect and subscribe again."""
    n = config.engines
    in_place = config.restart_kind == IN_PLACE
    choices = [range(len(queue) + 1) for queue in world.reports_in_flight]
    for *lost_reports, lost_notices in itertools.product(
        *choices, range(len(world.front_notices) + 1)
    ):
        dead = copy.deepcopy(world.core)
        for i, count in enumerate(lost_reports if config.lost_applied else ()):
            for what, wave in world.reports_in_flight[i][:count]:
                dead.receive_engine_output(_engine_output(i, what, wave), 0.0)
        for fwave, ftarget in world.front_notices[: lost_notices if config.lost_applied else 0]:
            dead.receive_front_frame(protocol.encode_legacy_first_request(ftarget, fwave), 0.0)
        for wave, target, legacy in world.commands:
            dead.receive_command(FirstRequest(target, wave, legacy=legacy), 0.0)
        fresh = CoordinatorCore(n, publish_to_front_ends=_viewing_front_end(config))
        replace_wave_rule(fresh, config.wave_state())
        recovery = Recovery(
            wave=dead.snapshot().current_wave if config.keep_floor else None,
            subscriptions=dead.subscriptions().current if in_place else 0,
            gate_open=in_place and dead.gate_open(),
        )

        def restart(core: CoordinatorCore, recovery: Recovery = recovery) -> Sequence[Effect]:
            effects = core.restarted(recovery, 0.0)
            replace_recovery_rules(core, config.recovery_rules)  # the mutants' rules
            return effects

        lost = [f"{count} report(s) of engine {i}" for i, count in enumerate(lost_reports) if count]
        if lost_notices:
            lost.append(f"{lost_notices} FIRST_REQ(s)")
        if world.commands:
            lost.append(f"{len(world.commands)} claim(s)")
        done = "applied, unanswered" if config.lost_applied else "never applied"
        label = (
            f"the coordinator dies ({', '.join(lost) or 'nothing'} read, {done});"
            f" restarted {config.restart_kind} at wave {recovery.wave}"
        )
        engines = world.engines
        if not in_place:
            engines = tuple(replace(e, subscribed=False) for e in engines)
        yield _coordinator_step(
            config,
            replace(world, core=dead),
            label,
            restart,
            fresh=fresh,
            engines=engines,
            reports_in_flight=tuple(
                queue[count:]
                for queue, count in zip(world.reports_in_flight, lost_reports, strict=True)
            ),
            front_notices=world.front_notices[lost_notices:],
            commands=(),
            deadlines=(),
            restarts_left=world.restarts_left - 1,
            repeats_allowed=world.repeats_allowed + 1,
        )


def _ordinary_successors(config: Config, world: World) -> Iterator[Step]:
    n = config.engines
    engines = world.engines
    reporting = config.engine_kind == REPORT_EVERY_WAKE

    # An engine subscribes to the broadcast socket (the start-up gate counts these).
    for i, engine in enumerate(engines):
        if not engine.subscribed:
            yield _coordinator_step(
                config,
                replace(world, engines=_set(engines, i, replace(engine, subscribed=True))),
                f"engine {i} subscribes",
                lambda core: core.receive_engine_subscription(protocol.SUBSCRIBE, 0.0),
            )

    # A front-end routes a request to an engine.
    if world.requests_left:
        number = config.requests - world.requests_left + 1
        for kind in config.front_ends:
            for target in range(n):
                label = f"front-end ({kind}) routes request {number} to engine {target}"
                changes: dict[str, object] = {"requests_left": world.requests_left - 1}
                if kind == HANDLE:
                    core = copy.deepcopy(world.core)
                    stamp = core.snapshot().current_wave
                    claim = core.claim_first_request(target)
                    label += f", stamped wave {stamp}"
                    if claim is not None:
                        label += (
                            f"; handle claims the wake-up, queues FirstRequest"
                            f"(wave {claim.wave}, engine {target})"
                        )
                        changes["commands"] = (*world.commands, (claim.wave, target, False))
                    changes["coordinator"] = _observe(core)
                    changes["core"] = core
                else:
                    stamp, running = world.view
                    label += (
                        f", stamped wave {stamp} (its view: {'running' if running else 'paused'})"
                    )
                    if kind == LEGACY and not running:
                        label += f"; sends FIRST_REQ [{target}, {stamp}]"
                        changes["front_notices"] = (*world.front_notices, (stamp, target))
                        changes["view"] = (stamp, True)
                changes["requests_in_flight"] = _set(
                    world.requests_in_flight, target, (*world.requests_in_flight[target], stamp)
                )
                yield Step(label, replace(world, **changes))  # type: ignore[arg-type]

    # The viewing front-end drains its publishes and keeps the last one read (§7.1).
    for count in range(1, len(world.publishes) + 1):
        seen = world.publishes[count - 1]
        waves = [world.view[0], *(wave for wave, _ in world.publishes[:count])]
        backwards = next((b for a, b in itertools.pairwise(waves) if b < a), None)
        yield Step(
            f"front-end reads {count} publish(es), keeps wave {seen[0]} "
            f"{'running' if seen[1] else 'paused'}",
            replace(world, publishes=world.publishes[count:], view=seen),
            None
            if backwards is None
            else f"a front-end reads wave {backwards} after wave {max(waves)}: it went back",
        )

    for i in range(n):
        engine = engines[i]
        # An engine takes the next request (§6.3), once its busy loop runs.
        if engine.ready and world.requests_in_flight[i]:
            stamp = world.requests_in_flight[i][0]
            wave = max(engine.wave, stamp)
            reports = world.reports_in_flight[i]
            label = f"engine {i} receives a request stamped {stamp}"
            running, mirror = engine.running, engine.mirror_owed
            report = reporting or (stamp < engine.wave)
            if not engine.running:
                running = True
                mirror = reporting and i == 0
                if report:
                    reports = (*reports, ("start_wave", wave))
                    label += f", wakes, reports start_wave({wave})"
                else:
                    label += ", wakes itself"
            if config.stats:
                reports = (*reports, ("stats", wave))
            new_engine = Engine(engine.subscribed, True, wave, running, engine.work + 1, mirror)
            yield Step(
                label,
                replace(
                    world,
                    engines=_set(engines, i, new_engine),
                    requests_in_flight=_set(
                        world.requests_in_flight, i, world.requests_in_flight[i][1:]
                    ),
                    reports_in_flight=_set(world.reports_in_flight, i, reports),
                ),
            )
        # With repeat_stats, after the restart, an engine running with work reports its
        # load once more (a report the new coordinator reads, whatever the dead one read).
        repeats = config.repeat_stats and not world.restarts_left and not engine.repeated
        if repeats and engine.running and engine.work:
            yield Step(
                f"engine {i} reports its load again, stats({engine.wave})",
                replace(
                    world,
                    engines=_set(engines, i, replace(engine, repeated=True)),
                    reports_in_flight=_set(
                        world.reports_in_flight,
                        i,
                        (*world.reports_in_flight[i], ("stats", engine.wave)),
                    ),
                ),
            )
        # An engine takes the next broadcast (§6.4).
        if world.broadcasts_in_flight[i]:
            wave, exclude = world.broadcasts_in_flight[i][0]
            rest = _set(world.broadcasts_in_flight, i, world.broadcasts_in_flight[i][1:])
            label = f"engine {i} receives START_DP_WAVE [{wave}, {_exclude(exclude)}]"
            if (wave, exclude) == READY:
                new_engine = replace(engine, ready=True)
                label = f"engine {i} receives READY" + (", again" if engine.ready else "")
            elif not engine.ready:
                new_engine = engine
                label += ", ignores it (not READY yet)"
            elif exclude != i and wave >= engine.wave:
                woke = not engine.running
                new_engine = Engine(
                    engine.subscribed,
                    True,
                    wave,
                    True,
                    engine.work,
                    engine.mirror_owed or (woke and reporting and i == 0),
                )
                label += ", wakes" if woke else ", already running"
            else:
                new_engine = engine
                label += ", ignores it (excluded)" if exclude == i else ", ignores it (stale)"
            yield Step(
                label,
                replace(world, engines=_set(engines, i, new_engine), broadcasts_in_flight=rest),
            )
        # The coordinator takes engine i's next report (§5.5).
        if world.reports_in_flight[i]:
            what, wave = world.reports_in_flight[i][0]
            yield _coordinator_step(
                config,
                world,
                f"coordinator handles {what}({wave}) from engine {i}",
                _receives(_engine_output(i, what, wave)),
                tag=LATE_COMPLETE if what == "wave_complete" else None,
                reports_in_flight=_set(world.reports_in_flight, i, world.reports_in_flight[i][1:]),
            )

    # The handle's next claimed FirstRequest is applied; the front socket's next FIRST_REQ
    # is read and applied.
    if world.commands:
        wave, target, legacy = world.commands[0]
        what = (
            f"FIRST_REQ [{target}, {wave}]"
            if legacy
            else f"the handle's FirstRequest(wave {wave}, engine {target})"
        )
        command = FirstRequest(target, wave, legacy=legacy)
        yield _coordinator_step(
            config,
            world,
            f"coordinator handles {what}",
            lambda core: core.receive_command(command, 0.0),
            tag=STALE_NOTICE if wave < world.core.snapshot().current_wave else None,
            commands=world.commands[1:],
        )
    if world.front_notices:
        fwave, ftarget = world.front_notices[0]
        frame = protocol.encode_legacy_first_request(ftarget, fwave)
        yield _coordinator_step(
            config,
            world,
            f"front socket delivers FIRST_REQ [{ftarget}, {fwave}], applied as it is read",
            lambda core: core.receive_front_frame(frame, 0.0),
            tag=STALE_NOTICE if fwave < world.core.snapshot().current_wave else None,
            front_notices=world.front_notices[1:],
        )

    # Lock-step: a step or a wave end needs every engine.
    if all(e.running and e.ready for e in engines):
        disagreement = None
        if len({e.wave for e in engines}) > 1:
            disagreement = "engines stepping together disagree on the wave: " + ", ".join(
                f"engine {i} at {e.wave}" for i, e in enumerate(engines)
            )
        if any(e.work for e in engines):
            outputs = world.reports_in_flight
            label = "all engines step together, serving " + ", ".join(
                f"{e.work} request(s) on engine {i}" for i, e in enumerate(engines) if e.work
            )
            first = engines[0]
            if first.mirror_owed:
                outputs = _set(outputs, 0, (*outputs[0], ("start_wave", first.wave)))
                label += f"; rank 0 mirrors start_wave({first.wave})"
            stepped = tuple(Engine(e.subscribed, True, e.wave, True, 0, False) for e in engines)
            yield Step(
                label,
                replace(world, engines=stepped, reports_in_flight=outputs),
                disagreement,
            )
        else:
            wave = engines[0].wave
            yield Step(
                f"all-reduce finds no work: wave {wave} ends, rank 0 reports wave_complete({wave})",
                replace(
                    world,
                    engines=tuple(Engine(e.subscribed, True, e.wave + 1) for e in engines),
                    reports_in_flight=_set(
                        world.reports_in_flight,
                        0,
                        (*world.reports_in_flight[0], ("wave_complete", wave)),
                    ),
                ),
                disagreement,
            )


def quiescent_violation(world: World, *, behind_ok: bool = False) -> str | None:
    """What is wrong in a state where nothing can happen any more, if anything.
    ``behind_ok``: the coordinator may settle at an older wave than the engines' (a
    restart that lost reports it never applied): any engine's next start_wave, of their
    newer wave, is accepted and catches up."""
    stranded = [i for i, e in enumerate(world.engines) if e.work]
    if stranded:
        return f"request(s) never served on engine(s) {stranded}"
    running = [i for i, e in enumerate(world.engines) if e.running]
    if running:
        asleep = [i for i, e in enumerate(world.engines) if not e.running]
        return (
            f"engine(s) {running} run while engine(s) {asleep} sleep and no message in flight "
            "will wake them: the runners block in lock-step collectives forever"
        )
    not_ready = [i for i, e in enumerate(world.engines) if not e.ready]
    if not_ready:
        return f"engine(s) {not_ready} never got READY"
    waves = {e.wave for e in world.engines}
    snap = world.core.snapshot()
    wave, running_flag = snap.current_wave, snap.engines_running
    if behind_ok and len(waves) == 1 and wave < min(waves):
        return None
    if waves != {wave} or running_flag or core_internals(world.core).first_request_pending:
        return (
            f"coordinator settles at wave {wave} {'running' if running_flag else 'paused'} "
            f"while the engines sleep at wave(s) {sorted(waves)}"
        )
    return None


def render(world: World) -> str:
    snap = world.core.snapshot()
    parts = [
        f"coordinator wave {snap.current_wave} {'running' if snap.engines_running else 'paused'}"
        + (" (claim pending)" if core_internals(world.core).first_request_pending else "")
        + ("" if world.core.gate_open() else " (gate closed)")
        + (" (recovering)" if core_internals(world.core).recovering else "")
    ]
    for i, e in enumerate(world.engines):
        parts.append(
            f"e{i}: "
            + ("" if e.subscribed else "unsubscribed ")
            + ("" if e.ready else "not ready ")
            + f"wave {e.wave} {'running' if e.running else 'asleep'}"
            + (f" work={e.work}" if e.work else "")
        )
    flight = []
    for i in range(len(world.engines)):
        if world.requests_in_flight[i]:
            flight.append(f"ADD->e{i} {list(world.requests_in_flight[i])}")
        if world.broadcasts_in_flight[i]:
            flight.append(
                f"START->e{i} "
                + " ".join(
                    "READY" if (w, x) == READY else f"[{w},{_exclude(x)}]"
                    for w, x in world.broadcasts_in_flight[i]
                )
            )
        if world.reports_in_flight[i]:
            flight.append(
                f"e{i}->coord " + " ".join(f"{k}({w})" for k, w in world.reports_in_flight[i])
            )
    if world.commands:
        flight.append("commands " + " ".join(f"(w{w},e{t})" for w, t, _ in world.commands))
    if world.deadlines:
        flight.append("wake deadlines " + " ".join(f"w{w}" for w in world.deadlines))
    if world.front_notices:
        flight.append("FIRST_REQ " + " ".join(f"[{t},{w}]" for w, t in world.front_notices))
    text = " | ".join(parts)
    return text + (" | in flight: " + "; ".join(flight) if flight else "")


@dataclass(slots=True)
class Result:
    config: Config
    states: int
    transitions: int
    quiescent: int
    max_depth: int
    seconds: float
    coverage: dict[str, int]
    counterexample: str | None = None
    trace: list[tuple[str, World]] = field(default_factory=list)


def explore(config: Config, *, max_states: int = 2_000_000) -> Result:
    """Breadth-first over every interleaving; stops at the first violation (shortest)."""
    started = time.perf_counter()
    start = initial_world(config)
    parent: dict[World, tuple[World, str] | None] = {start: None}
    depth = {start: 0}
    frontier = deque([start])
    transitions = quiescent = 0
    coverage = {STALE_NOTICE: 0, LATE_COMPLETE: 0}

    def trace_to(world: World, last: tuple[str, World] | None) -> list[tuple[str, World]]:
        steps: list[tuple[str, World]] = []
        node: World | None = world
        while node is not None:
            link = parent[node]
            steps.append((link[1] if link else "initial state", node))
            node = link[0] if link else None
        steps.reverse()
        if last is not None:
            steps.append(last)
        return steps

    def finish(trace: list[tuple[str, World]] | None, message: str | None) -> Result:
        result = Result(
            config,
            len(parent),
            transitions,
            quiescent,
            max(depth.values()),
            time.perf_counter() - started,
            coverage,
        )
        if trace is not None and message is not None:
            result.trace = trace
            result.counterexample = format_trace(config, trace, message)
        return result

    while frontier:
        world = frontier.popleft()
        any_step = False
        for step in successors(config, world):
            any_step = True
            transitions += 1
            if step.tag is not None:
                coverage[step.tag] += 1
            if step.violation is not None:
                return finish(trace_to(world, (step.label, step.world)), step.violation)
            if step.world not in parent:
                if len(parent) >= max_states:
                    raise AssertionError(f"state space above {max_states}: {config.describe()}")
                parent[step.world] = (world, step.label)
                depth[step.world] = depth[world] + 1
                frontier.append(step.world)
        if not any_step:
            quiescent += 1
            problem = quiescent_violation(world, behind_ok=not config.lost_applied)
            if problem is not None:
                return finish(trace_to(world, None), problem)
    return finish(None, None)


def format_trace(config: Config, trace: list[tuple[str, World]], violation: str) -> str:
    lines = [f"COUNTEREXAMPLE ({config.describe()}), {len(trace) - 1} steps:"]
    for number, (label, world) in enumerate(trace):
        lines.append(f"{number:3d}. {label}")
        lines.append(f"       => {render(world)}")
    lines.append(f"VIOLATION: {violation}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- broken rules


class PreFixWaveState(WaveState):
    """Rust generation 1, before PR #46833: the handled notice sets the wave to the
    request's wave and broadcasts ``[request wave, target]``, stale or not (acceptance
    gate unchanged, so only the rule differs)."""

    __slots__ = ()

    def start_wave_for_first_request(
        self, request_wave: int, target_engine_index: int | bytes | None
    ) -> WaveStart | None:
        if super().start_wave_for_first_request(request_wave, target_engine_index) is None:
            return None
        force_wave_state(self, snapshot=WaveSnapshot(request_wave, True))  # the rewind under test
        return WaveStart(request_wave, target_engine_index)


class AlwaysExcludeTargetWaveState(WaveState):
    """Never rewinds, but excludes the target even when the notice is stale (R1's second
    half: the target may already have served its request in the older wave)."""

    __slots__ = ()

    def start_wave_for_first_request(
        self, request_wave: int, target_engine_index: int | bytes | None
    ) -> WaveStart | None:
        start = super().start_wave_for_first_request(request_wave, target_engine_index)
        return None if start is None else WaveStart(start.wave, target_engine_index)


# --------------------------------------------------------------------------- the tests


class KeepClaimAfterEngineStartWaveState(WaveState):
    """Our rule as it was before this checker: an engine's accepted start_wave left a
    pending claim in place, so the stale notice re-broadcast the running wave."""

    __slots__ = ()

    def engine_start_wave(self, wave: int, engine_index: int) -> WaveStart | None:
        pending = self.first_request_pending
        start = super().engine_start_wave(wave, engine_index)
        force_wave_state(self, first_request_pending=pending)
        return start


GEN2_WORLDS = [  # the handle's FirstRequest path with engines of its era
    Config(2, 2, (HANDLE,), REPORT_STALE_ONLY),
    Config(3, 2, (HANDLE,), REPORT_STALE_ONLY),
    Config(2, 3, (HANDLE,), REPORT_STALE_ONLY),
    Config(3, 3, (HANDLE,), REPORT_STALE_ONLY),
    Config(2, 2, (LEGACY,), REPORT_STALE_ONLY),
    Config(2, 3, (LEGACY,), REPORT_STALE_ONLY),
]
MODERN_WORLDS = [  # vLLM 0.33 engines, with every kind of front-end and mixes of them
    Config(2, 2, (PUBLISH,), REPORT_EVERY_WAKE),
    Config(3, 3, (PUBLISH,), REPORT_EVERY_WAKE),
    Config(3, 3, (HANDLE,), REPORT_EVERY_WAKE),
    Config(2, 3, (HANDLE, PUBLISH), REPORT_EVERY_WAKE),
    Config(2, 2, (LEGACY,), REPORT_EVERY_WAKE),
    Config(2, 2, (HANDLE, LEGACY), REPORT_EVERY_WAKE),
    Config(3, 2, (HANDLE, LEGACY), REPORT_EVERY_WAKE),
]
LARGE_WORLDS = [  # 3-8 s each (skip with -m "not slow"); 2 engines x 3 requests x
    # handle+legacy with 0.33 engines (277k states, ~11 s) and 3 x 3 of it (1.2M) also pass
    Config(3, 3, (HANDLE, PUBLISH), REPORT_EVERY_WAKE),
    Config(3, 3, (HANDLE, LEGACY), REPORT_STALE_ONLY),
]


def _check_holds(config: Config) -> Result:
    result = explore(config)
    assert result.counterexample is None, result.counterexample
    # the search really ran: it reached the ends of runs after many interleavings
    assert result.quiescent > 0
    assert result.states > 200
    print(
        f"\n{config.describe()}: {result.states} states, {result.transitions} transitions, "
        f"depth {result.max_depth}, {result.seconds:.2f} s, {result.coverage}"
    )
    return result


@pytest.mark.parametrize("config", GEN2_WORLDS + MODERN_WORLDS, ids=Config.describe)
def test_our_wave_rules_hold_in_every_interleaving(config: Config) -> None:
    _check_holds(config)


@pytest.mark.slow
@pytest.mark.parametrize("config", LARGE_WORLDS, ids=Config.describe)
def test_our_wave_rules_hold_in_larger_worlds(config: Config) -> None:
    _check_holds(config)


def test_the_races_of_section_8_are_reached() -> None:
    """The search covers R1 (a FirstRequest handled after its wave ended) and R3 (a
    wave_complete that arrives after a newer start), and our rules survive both."""
    result = _check_holds(Config(2, 3, (HANDLE,), REPORT_STALE_ONLY))
    assert result.coverage[STALE_NOTICE] > 0
    assert result.coverage[LATE_COMPLETE] > 0


def test_pre_46833_rule_yields_a_rewind_counterexample() -> None:
    result = explore(Config(2, 2, (HANDLE,), REPORT_STALE_ONLY, PreFixWaveState))
    trace = result.counterexample
    assert trace is not None, "the checker missed the pre-#46833 rewind"
    print("\n" + trace)
    assert "decreased: 1 -> 0 (rewind)" in trace, trace
    # the rewinding step is the FirstRequest claimed in wave 0, handled after wave 0 ended
    labels = [label for label, _ in result.trace]
    assert labels[-1].startswith("coordinator handles the handle's FirstRequest(wave 0"), trace
    assert any(lab.startswith("coordinator handles wave_complete(0)") for lab in labels), trace


def test_excluding_the_target_of_a_stale_notice_strands_it() -> None:
    result = explore(Config(2, 2, (HANDLE,), REPORT_STALE_ONLY, AlwaysExcludeTargetWaveState))
    trace = result.counterexample
    assert trace is not None, "the checker missed the stranded target"
    print("\n" + trace)
    assert "sleep and no message in flight will wake them" in trace, trace
    assert "ignores it (excluded)" in trace, trace


def test_a_claim_outliving_an_engine_start_rebroadcasts_a_running_wave() -> None:
    """Found by this checker: the claim must be dropped once an engine's start wakes all."""
    config = Config(2, 3, (HANDLE,), REPORT_STALE_ONLY, KeepClaimAfterEngineStartWaveState)
    result = explore(config)
    trace = result.counterexample
    assert trace is not None, "the checker missed the duplicate broadcast"
    print("\n" + trace)
    assert "which was already broadcast and runs" in trace, trace


# --------------------------------------------------------------------------- restarts


class NoRecoveryWake(RecoveryRules):
    """A restarted core that never wakes the engines on its own (its floor kept)."""

    __slots__ = ()

    def wake(self, wave_state: WaveState) -> WaveStart | bool:
        return False


RESTART_WORLDS = [
    Config(2, 1, (PUBLISH,), REPORT_EVERY_WAKE, restarts=1, stats=True),
    Config(2, 1, (LEGACY,), REPORT_STALE_ONLY, restarts=1, stats=True),
    Config(2, 2, (HANDLE,), REPORT_STALE_ONLY, restarts=1, restart_kind=IN_PLACE),
    Config(2, 2, (HANDLE,), REPORT_STALE_ONLY, restarts=1, restart_kind=IN_PLACE, stats=True),
]
LARGE_RESTART_WORLDS = [  # 15-300 s each
    Config(2, 2, (HANDLE,), REPORT_EVERY_WAKE, restarts=1, restart_kind=IN_PLACE, stats=True),
    Config(2, 2, (PUBLISH,), REPORT_EVERY_WAKE, restarts=1, stats=True),
    Config(2, 2, (LEGACY,), REPORT_STALE_ONLY, restarts=1, stats=True),
    Config(2, 2, (LEGACY,), REPORT_EVERY_WAKE, restarts=1, stats=True),
    Config(2, 2, (PUBLISH,), REPORT_EVERY_WAKE, restarts=2),
]


@pytest.mark.parametrize("config", RESTART_WORLDS, ids=Config.describe)
def test_a_restarted_coordinator_recovers_in_every_interleaving(config: Config) -> None:
    """§16: the coordinator dies at any point, what it had read is lost, a recovering one
    takes over: no request stranded, no engine or front-end sees the wave go back, no
    wake repeated for nothing, the engines and the coordinator agree in the end."""
    _check_holds(config)


@pytest.mark.slow
@pytest.mark.parametrize("config", LARGE_RESTART_WORLDS, ids=Config.describe)
def test_a_restarted_coordinator_recovers_in_larger_worlds(config: Config) -> None:
    _check_holds(config)


def test_without_its_recovery_wake_a_restart_strands_a_request() -> None:
    """The engine whose start_wave died with the coordinator runs alone: its peers sleep."""
    config = Config(2, 1, (PUBLISH,), REPORT_EVERY_WAKE, restarts=1, recovery_rules=NoRecoveryWake)
    result = explore(config)
    trace = result.counterexample
    assert trace is not None, "the checker missed the stranded engine"
    print("\n" + trace)
    assert "request(s) never served on engine(s) [0]" in trace, trace
    assert "1 report(s) of engine 0 read, applied, unanswered" in trace, trace


def test_without_the_dead_coordinators_wave_a_restart_rewinds() -> None:
    config = Config(2, 1, (HANDLE,), REPORT_EVERY_WAKE, restarts=1, keep_floor=False)
    result = explore(config)
    trace = result.counterexample
    assert trace is not None, "the checker missed the rewind"
    print("\n" + trace)
    assert "decreased: 1 -> 0 (rewind)" in trace, trace
    assert "restarted process at wave None" in trace, trace


@pytest.mark.slow
def test_a_restart_that_never_applied_what_it_read_can_leave_an_engine_waiting() -> None:
    """The gap left (docs/protocol.md §16.4). The form the recovery probe closed (the dead
    process read rank 0's wave_complete(W) and engine 1's start_wave(W + 1), applied
    neither: the recovery wake at W goes unanswered, and the probe at W + 1 joins engine
    1's peers to it) is no longer found; what is: the dead process read only engine 1's
    start_wave(W + 1) and its load report. Rank 0's leftover start_wave(W) (its mirror of
    an earlier start) reaches the new one first and is taken as a start at W (so the
    recovery wake is not needed, and nothing goes unanswered), rank 0's wave_complete(W)
    then settles the restart at W + 1, paused, while engine 1 runs W + 1 alone and, as
    vLLM's engines report counts only when they change, reports nothing more. A request
    reaching engine 0 wakes it (its start_wave(W + 1) is accepted)."""
    config = Config(2, 2, (PUBLISH,), REPORT_EVERY_WAKE, restarts=1, lost_applied=False, stats=True)
    trace = explore(config).counterexample
    assert trace is not None
    print("\n" + trace)
    assert "report(s) of engine 1 read, never applied" in trace, trace
    assert "report(s) of engine 0 read" not in trace, trace
    assert "coordinator handles start_wave(0) from engine 0" in trace, trace
    assert "handles wave_complete(0) from engine 0  [wave 0 -> 1]" in trace, trace
    assert "request(s) never served on engine(s) [1]" in trace, trace


@pytest.mark.slow
def test_a_repeated_load_report_is_ignored_once_a_wave_report_settled_the_restart() -> None:
    """Why the gap is not only a missing report (docs/protocol.md §16.4): the dead process
    read only engine 1's start_wave(W + 1) and load report; rank 0's mirrored
    start_wave(W) reaches the new one and is taken as a start (no recovery wake owed; its
    START_DP_WAVE [W, 0] is stale for engine 1), then rank 0's wave_complete(W) settles
    the restart and drops the load-report rule: from then on §5.5 alone applies, and
    engine 1's further report of work at W + 1, the wave the core believes paused,
    starts nothing."""
    config = Config(
        2,
        2,
        (PUBLISH,),
        REPORT_EVERY_WAKE,
        restarts=1,
        lost_applied=False,
        stats=True,
        repeat_stats=True,
    )
    trace = explore(config).counterexample
    assert trace is not None
    print("\n" + trace)
    assert "read, never applied" in trace, trace
    assert "handles wave_complete(0) from engine 0  [wave 0 -> 1]" in trace, trace
    assert "reports its load again, stats(1)" in trace, trace
    assert "handles stats(1) from engine 1 -> nothing sent" in trace, trace
    assert "request(s) never served on engine(s) [1]" in trace, trace
