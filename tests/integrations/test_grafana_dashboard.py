"""The Grafana dashboard shipped in docs/grafana/ against the exporter it is drawn from.

A real ``trio-dpcoord serve --metrics-address`` is scraped over HTTP; every PromQL query
of the dashboard (its panels' targets and its template variables) must name only metrics
that scrape serves, so a renamed or removed metric fails here rather than as an empty
panel. The names come from the scrape itself (its ``# TYPE`` lines and samples), never
from a list kept in this test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from trio_dpcoord import protocol
from trio_dpcoord.testing import connect_engines, open_serve

GUARD = 30.0  # generous: a subprocess and real sockets on a shared 2-core machine
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "trio_dpcoord.json"

_STRINGS = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|`[^`]*`")
_LABEL_LISTS = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "inf", "nan"}
    | {"by", "without", "on", "ignoring", "group_left", "group_right"}
)
# The sample names each family type exposes (the parser drops a counter's _total).
_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "untyped": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings,
    label lists (``by (...)``), label matchers, ranges and durations are taken out,
    other than functions, aggregations (an identifier before ``(``) and keywords."""
    text = _STRINGS.sub(" ", expr)
    text = _LABEL_LISTS.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        before = text[match.start() - 1] if match.start() else " "
        if before.isdigit() or before in ".$":  # 1e-3, 0.5, a Grafana $variable
            continue
        if text[match.end() :].lstrip().startswith("("):  # rate(, sum (, histogram_quantile(
            continue
        if match.group().lower() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def served_names(exposition: str) -> set[str]:
    """Every sample name the scrape serves, and those its typed families declare (a
    labelled counter with no sample yet, such as rejections by reason, is served)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Panels, and the panels inside collapsed rows."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(where, PromQL)`` for every panel target."""
    for panel in all_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['id']} ({panel['title']}) {target['refId']}", target["expr"]


def test_the_promql_reader_finds_metrics_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (instance, le) (rate(a_bucket{x=~"$i", y="}"}'
        "[$__rate_interval]))) / on(instance) group_left b_total offset 5m > bool 1e-3"
    )
    assert metric_names(expr) == {"a_bucket", "b_total"}
    assert metric_names("sum without (engine) (c) and d unless e or f") == {"c", "d", "e", "f"}


def test_the_dashboard_is_grafana_json_with_a_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = list(all_panels(dashboard["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(ids)}"
    drawn = [panel for panel in panels if panel["type"] != "row"]
    assert drawn and all(panel["targets"] for panel in drawn)
    for panel in drawn:
        sources = [panel["datasource"], *(target["datasource"] for target in panel["targets"])]
        assert all(source["uid"] == "${datasource}" for source in sources), panel["title"]
    for panel in panels:  # every panel inside the 24-column grid
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]


async def test_every_dashboard_query_names_a_metric_the_exporter_serves() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    with trio.fail_after(GUARD):
        options = ("--engines=1", "--metrics-address=127.0.0.1:0", "--log-level=WARNING")
        async with open_serve(*options) as serve:
            endpoints = serve.endpoints
            async with connect_engines(endpoints["back_pub"], endpoints["back_out"], 1) as (
                engine,
            ):
                # One wave, so that the histogram and the labelled counters have samples.
                assert await engine.next_broadcast_frames() == [protocol.READY]
                await engine.stats(1, 1, 0.5, wave=0, step=1)
                await engine.start_wave(0)
                assert await engine.next_broadcast() == protocol.StartDPWave(0, 0)
                async with httpx.AsyncClient() as client:
                    response = await client.get(endpoints["metrics"])
            assert response.status_code == 200
    served = served_names(response.text)
    assert "trio_dpcoord_wake_latency_seconds_bucket" in {
        sample.name
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }

    unknown: dict[str, set[str]] = {}
    for where, expr in queries(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        if names - served:
            unknown[where] = names - served
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if variable["type"] == "query":
            text = query["query"] if isinstance(query, dict) else query
            selected = set(_LABEL_VALUES.findall(text))
            assert selected, f"variable {variable['name']}: no metric in {text!r}"
            if selected - served:
                unknown[f"variable {variable['name']}"] = selected - served
    assert not unknown, f"queries name metrics the exporter does not serve: {unknown}"
