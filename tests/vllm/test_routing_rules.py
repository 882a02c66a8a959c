"""The pure rules of ``TRIO_DPCOORD_VLLM_ROUTING`` (no vLLM): vLLM's score, where to subscribe.

The plugin's routing module is private; its rules are tested here directly, through the
test hooks of :mod:`trio_dpcoord.testing` (the behaviour inside vLLM's client is
``tests/vllm/test_routing.py``'s).
"""

from __future__ import annotations

import pytest

from trio_dpcoord.routing import vllm_score
from trio_dpcoord.vllm._routing import routing_options, routing_setting, subscribe_endpoint


@pytest.mark.parametrize(
    ("waiting", "running", "kv_usage", "in_flight", "clients", "expected"),
    [
        (0, 0, 0.0, 0, 1, 0.0),
        (2, 3, 0.2, 1, 1, 5.0),  # the snapshot wins over the in-flight floor
        (0, 1, 0.0, 3, 2, 6.0),  # client_count x in-flight wins
        (4, 0, 0.5, 0, 1, 4.0),  # KV usage at 50 %: no penalty yet
        (4, 0, 1.0, 0, 1, 16.0),  # at 100 %: 3x the waiting count on top
    ],
)
def test_vllm_score_is_vllms(
    waiting: int, running: int, kv_usage: float, in_flight: int, clients: int, expected: float
) -> None:
    assert vllm_score(waiting, running, kv_usage, in_flight, clients) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),
        ("tcp://0.0.0.0:5558", "tcp://127.0.0.1:5558"),
        ("tcp://[::]:5557", "tcp://[::1]:5557"),
        ("tcp://10.1.2.3:6000", "tcp://10.1.2.3:6000"),
        ("ipc:///tmp/kv-0", "ipc:///tmp/kv-0"),
        ("tcp://*:0", None),  # not resolved yet
        ("inproc://cache_dp1", None),  # inside the engine's own process
        ("tcp://*:port", None),
        ("udp://x:1", None),
    ],
)
def test_subscribe_endpoint(endpoint: str, expected: str | None) -> None:
    assert subscribe_endpoint(endpoint) == expected


def test_routing_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRIO_DPCOORD_VLLM_ROUTING", raising=False)
    assert routing_setting() is None
    monkeypatch.setenv("TRIO_DPCOORD_VLLM_ROUTING", "")
    assert routing_setting() is None
    monkeypatch.setenv("TRIO_DPCOORD_VLLM_ROUTING", "prefix")
    assert routing_setting() == "prefix"
    monkeypatch.setenv("TRIO_DPCOORD_VLLM_ROUTING", "on")
    assert routing_setting() == "on"


def test_routing_options(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("TRIO_DPCOORD_VLLM_ROUTING_OPTIONS", raising=False)
    assert routing_options() == {}
    monkeypatch.setenv(
        "TRIO_DPCOORD_VLLM_ROUTING_OPTIONS",
        '{"reuse_weight": 2, "imbalance_rel": 0.5, "feed": "exact", "colour": 1}',
    )
    with caplog.at_level("WARNING", logger="trio_dpcoord.vllm"):
        assert routing_options() == {"reuse_weight": 2}
    # an invalid value, vLLM's own feed and an unknown field: each named in a warning
    assert [r.getMessage().split("=")[0].split(": ")[-1] for r in caplog.records] == [
        "imbalance_rel",
        "feed",
        "colour",
    ]
    monkeypatch.setenv("TRIO_DPCOORD_VLLM_ROUTING_OPTIONS", "[1]")
    assert routing_options() == {}
    monkeypatch.setenv("TRIO_DPCOORD_VLLM_ROUTING_OPTIONS", "{")
    assert routing_options() == {}
