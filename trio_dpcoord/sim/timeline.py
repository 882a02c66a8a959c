"""A picture of the waves: what the simulated front-end saw, drawn on one time axis.

:class:`Timeline` is filled in by :class:`~trio_dpcoord.sim.SimFrontend` when its
``timeline`` attribute is set (the launcher's ``--timeline PATH`` does that): every
engine status event (``running``/``idle`` with its wave, ``paused``/``resumed``), every
wake-up of a sleeping cluster (from the request that found every engine idle to the
last engine's ``running`` event), every front-end ``notify_first_request`` and the
number of requests in flight after each change. Times are the front-end's
``trio.current_time()`` when it *received* each event, the same clock for every engine.

:func:`plot_timeline` draws it with matplotlib (the optional ``[plot]`` extra), which
is imported only there: recording costs nothing when nobody draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from .messages import EVENT_IDLE, EVENT_PAUSED, EVENT_RESUMED, EVENT_RUNNING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["EngineSpan", "Timeline", "plot_timeline"]

SpanState = Literal["running", "paused"]


_COLOURS: Final = {"running": "#2a9d55", "paused": "#e9a23b"}
_IDLE_COLOUR: Final = "#eeeeee"
_WAKE_COLOUR: Final = "#c0392b"
_NOTIFY_COLOUR: Final = "#7b2cbf"


@dataclass(frozen=True, slots=True)
class EngineSpan:
    """One stretch of one engine: stepping in ``wave`` (running) or scheduler-paused."""

    rank: int
    state: SpanState
    start: float
    end: float
    wave: int


@dataclass(slots=True)
class Timeline:
    """Raw events of one run, in the front-end's trio clock (seconds)."""

    engine_count: int
    start: float
    end: float | None = None
    engine_events: list[tuple[float, int, str, int]] = field(default_factory=list)
    """``(time, rank, event, wave)`` for every status event, in arrival order."""
    wakes: list[tuple[float, float]] = field(default_factory=list)
    """``(request found the cluster asleep, last engine running)``."""
    notifications: list[float] = field(default_factory=list)
    """Times of the front-end's ``notify_first_request`` calls."""
    in_flight: list[tuple[float, int]] = field(default_factory=list)
    """``(time, requests in flight)`` after every submit and every batch of finishes."""

    def finish(self, end: float) -> None:
        self.end = end

    def spans(self) -> list[EngineSpan]:
        """Running and paused stretches per engine, from the status events; a stretch
        still open at the end of the run is closed at :attr:`end`."""
        end = self.end if self.end is not None else self._last_time()
        open_running: dict[int, tuple[float, int]] = {}
        open_paused: dict[int, tuple[float, int]] = {}
        spans: list[EngineSpan] = []
        for time, rank, event, wave in self.engine_events:
            if time > end:  # arrived during the teardown
                break
            if event == EVENT_RUNNING:
                if rank in open_running:  # a wave change without an idle in between
                    started, old = open_running.pop(rank)
                    spans.append(EngineSpan(rank, "running", started, time, old))
                open_running[rank] = (time, wave)
            elif event == EVENT_IDLE and rank in open_running:
                started, old = open_running.pop(rank)
                spans.append(EngineSpan(rank, "running", started, time, old))
            elif event == EVENT_PAUSED and rank not in open_paused:
                open_paused[rank] = (time, wave)
            elif event == EVENT_RESUMED and rank in open_paused:
                started, old = open_paused.pop(rank)
                spans.append(EngineSpan(rank, "paused", started, time, old))
        for rank, (started, wave) in open_running.items():
            spans.append(EngineSpan(rank, "running", started, end, wave))
        for rank, (started, wave) in open_paused.items():
            spans.append(EngineSpan(rank, "paused", started, end, wave))
        return spans

    def wave_starts(self) -> list[tuple[float, int]]:
        """``(time, wave)`` when the first engine reported running in each wave."""
        seen: set[int] = set()
        starts: list[tuple[float, int]] = []
        for time, _rank, event, wave in self.engine_events:
            if event == EVENT_RUNNING and wave not in seen:
                seen.add(wave)
                starts.append((time, wave))
        return starts

    def _last_time(self) -> float:
        times = [self.start]
        times += [e[0] for e in self.engine_events[-1:]]
        times += [t for t, _ in self.in_flight[-1:]]
        return max(times)


def _thin(times: list[float], min_gap: float) -> list[int]:
    """Indices of ``times`` (ascending) kept so that kept ones are ``min_gap`` apart."""
    kept: list[int] = []
    last = -math.inf
    for index, time in enumerate(times):
        if time - last >= min_gap:
            kept.append(index)
            last = time
    return kept


def plot_timeline(timeline: Timeline, path: str | Path, *, title: str | None = None) -> None:
    """Draw ``timeline`` to ``path`` (the format follows the suffix: ``.png``, ``.svg``...).

    Top: one band per engine, green while it steps in a wave, orange while its scheduler
    is paused, grey while idle; wave numbers where each wave started; red wake-ups
    (request to every engine running) with their latency. Bottom: requests in flight.
    Needs matplotlib (``pip install 'trio-dpcoord[plot]'``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "drawing a timeline needs matplotlib: pip install 'trio-dpcoord[plot]'"
        ) from exc

    origin = timeline.start
    end = (timeline.end if timeline.end is not None else timeline._last_time()) - origin
    end = max(end, 1e-3)
    engines = timeline.engine_count
    band_height = 0.24 if engines > 8 else 0.45
    top_height = min(9.0, 1.2 + band_height * engines)
    figure = Figure(figsize=(14, top_height + 2.2), layout="constrained")
    axes, flight = figure.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [top_height, 1.8]}
    )
    rows = _draw_engine_bands(axes, timeline, origin, end)
    _draw_wave_numbers(axes, timeline, origin, end, rows)
    _draw_wake_ups(axes, timeline, origin, end, rows)
    if timeline.notifications:
        xs = [t - origin for t in timeline.notifications]
        axes.plot(xs, [rows.notify] * len(xs), "|", color=_NOTIFY_COLOUR, markersize=6)
    _draw_legend(axes, bool(timeline.notifications))
    axes.set_title(title or f"DP waves of {engines} engines (numbers: wave started)")
    axes.tick_params(axis="x", labelbottom=False)
    _draw_in_flight(flight, timeline, origin, end)
    figure.savefig(str(path), dpi=110)


@dataclass(frozen=True, slots=True)
class _Rows:
    """Where the rows above the engine bands sit on the top axes (``unit``: their scale)."""

    wave: float
    notify: float
    wake: float
    unit: float


def _draw_engine_bands(axes: Axes, timeline: Timeline, origin: float, end: float) -> _Rows:
    """Each engine's band: idle background, then its running and paused stretches."""
    engines = timeline.engine_count
    by_rank: dict[tuple[int, SpanState], list[tuple[float, float]]] = {}
    for span in timeline.spans():
        by_rank.setdefault((span.rank, span.state), []).append(
            (span.start - origin, span.end - span.start)
        )
    for rank in range(engines):
        axes.broken_barh([(0.0, end)], (rank - 0.4, 0.8), facecolors=_IDLE_COLOUR)
        for state in ("paused", "running"):
            bars = by_rank.get((rank, state))
            if bars:
                axes.broken_barh(bars, (rank - 0.4, 0.8), facecolors=_COLOURS[state])
    unit = max(1.0, engines * 0.06)
    rows = _Rows(
        wave=-0.5 - 0.25 * unit, notify=-0.5 - 0.8 * unit, wake=-0.5 - 1.3 * unit, unit=unit
    )
    axes.set_ylim(engines - 0.5 + 0.2 * unit, -0.5 - 2.3 * unit)
    step = 1 if engines <= 16 else max(1, engines // 16)
    ranks = list(range(0, engines, step))
    axes.set_yticks([rows.wave, rows.wake, *ranks], ["wave", "wake-up", *map(str, ranks)])
    axes.set_ylabel("engine (DP rank)")
    return rows


def _draw_wave_numbers(
    axes: Axes, timeline: Timeline, origin: float, end: float, rows: _Rows
) -> None:
    """Wave numbers where each wave started, thinned so that labels never overlap."""
    starts = timeline.wave_starts()
    kept = set(_thin([t - origin for t, _ in starts], end / 70.0))
    for index, (time, wave) in enumerate(starts):
        x = time - origin
        axes.axvline(x, color="#555555", linewidth=0.4, alpha=0.5, zorder=0)
        if index in kept:
            axes.text(
                x,
                rows.wave,
                f" {wave}",
                fontsize=7,
                ha="left",
                va="center",
                color="#333333",
                clip_on=True,
            )


def _draw_wake_ups(axes: Axes, timeline: Timeline, origin: float, end: float, rows: _Rows) -> None:
    """Wake-ups: from the request that found every engine asleep to the last one running,
    with their latency where labels do not overlap."""
    latencies = [(s - origin, e - s) for s, e in timeline.wakes]
    for start, latency in latencies:
        axes.plot(
            [start, start + latency],
            [rows.wake, rows.wake],
            color=_WAKE_COLOUR,
            linewidth=3,
            solid_capstyle="butt",
        )
        axes.plot([start], [rows.wake], marker="v", color=_WAKE_COLOUR, markersize=4)
    kept_wakes = set(_thin([s for s, _ in latencies], end / 25.0))
    for index, (start, latency) in enumerate(latencies):
        if index in kept_wakes:
            axes.text(
                start,
                rows.wake - 0.3 * rows.unit,
                f"{latency * 1000:.1f} ms",
                fontsize=6.5,
                color=_WAKE_COLOUR,
                ha="left",
                va="bottom",
                clip_on=True,
            )


def _draw_legend(axes: Axes, with_notifications: bool) -> None:
    from matplotlib.patches import Patch

    legend = [
        Patch(color=_COLOURS["running"], label="running (stepping in a wave)"),
        Patch(color=_IDLE_COLOUR, label="idle (wave over)"),
        Patch(color=_COLOURS["paused"], label="scheduler paused"),
        Patch(color=_WAKE_COLOUR, label="wake-up: request to all engines running (latency)"),
    ]
    if with_notifications:
        legend.append(Patch(color=_NOTIFY_COLOUR, label="front-end notify_first_request"))
    axes.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.02),
        ncol=5,
        fontsize=8,
        frameon=False,
    )


def _draw_in_flight(flight: Axes, timeline: Timeline, origin: float, end: float) -> None:
    """Requests in flight, as a step curve over the whole run."""
    if timeline.in_flight:
        xs = [0.0] + [t - origin for t, _ in timeline.in_flight] + [end]
        ys = [0] + [n for _, n in timeline.in_flight]
        ys.append(ys[-1])
        flight.step(xs, ys, where="post", color="#264653", linewidth=0.9)
        flight.fill_between(xs, ys, step="post", color="#264653", alpha=0.25)
    flight.set_ylabel("in flight")
    flight.set_xlabel("time since start (s)")
    flight.set_xlim(0.0, end)
    flight.grid(axis="y", alpha=0.3)
