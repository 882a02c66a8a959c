"""``TRIO_DPCOORD_VLLM_ROUTING=prefix`` in vLLM 0.33.0's real ``DPLBAsyncMPClient``, torch-free.

Each test runs ``tests/vllm_reference/runners/routing.py`` in the cluster import root with
this project installed, so vLLM's real ``load_general_plugins()`` finds our entry point and
vLLM's real client class chooses the engines (the runner's docstring lists what is real
and what stands in). The runner reports every choice; the tests assert them.
"""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.vllm_reference import RUNNERS_DIR, VLLM_VERSION, VllmUnavailable, runner_command
from tests.vllm_reference import vllm_env as reference_env
from tests.vllm_reference.dp_cluster import prepare_cluster_root

pytestmark = pytest.mark.vllm

RUNNER = RUNNERS_DIR / "routing.py"
TIMEOUT = 120  # a loaded 2-core machine; vLLM's imports take a few seconds
VLLMS = "vllm.v1.engine.core_client.DPLBAsyncMPClient.get_core_engine_for_request"
SESSIONS, TURNS = 3, 4


@pytest.fixture(scope="module")
def routing_root() -> Path:
    plugins = entry_points(group="vllm.general_plugins")
    if not any(plugin.value == "trio_dpcoord.vllm:register" for plugin in plugins):
        pytest.fail("trio-dpcoord is not installed (pip install -e .): no entry point for vLLM")
    try:
        return prepare_cluster_root()
    except VllmUnavailable as error:
        pytest.skip(f"vLLM {VLLM_VERSION}'s wheel cannot be had: {error}")


async def run_routing(
    root: Path,
    routing: str | None,
    *,
    plugins: bool = True,
    kv_events_dir: Path | None = None,
    two_servers: dict[str, Any] | None = None,
    peers: str | None = None,
) -> tuple[dict[str, Any], str]:
    """The runner's report and its stderr (vLLM's logs and ours)."""
    env = reference_env(root)
    env.pop("TRIO_DPCOORD_VLLM", None)
    env.pop("TRIO_DPCOORD_VLLM_ROUTING", None)
    env.pop("TRIO_DPCOORD_VLLM_ROUTING_PEERS", None)
    if routing is not None:
        env["TRIO_DPCOORD_VLLM_ROUTING"] = routing
    if peers is not None:
        env["TRIO_DPCOORD_VLLM_ROUTING_PEERS"] = peers
    events_dir = None if kv_events_dir is None else str(kv_events_dir)
    config = {"plugins": plugins, "kv_events_dir": events_dir, "two_servers": two_servers}
    with trio.fail_after(TIMEOUT):
        done = await trio.run_process(
            runner_command(RUNNER, json.dumps(config)),
            env=env,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    stderr = done.stderr.decode(errors="replace")
    lines = done.stdout.decode().splitlines()
    assert done.returncode == 0 and lines, (done.returncode, lines, stderr)
    report: dict[str, Any] = json.loads(lines[-1])
    return report, stderr


def session_engines(choices: dict[str, int], session: int) -> list[int]:
    return [choices[f"s{session}t{turn}"] for turn in range(TURNS)]


async def test_prefix_routing_keeps_sessions_where_their_history_is(routing_root: Path) -> None:
    report, stderr = await run_routing(routing_root, "prefix")
    assert report["method"].startswith("trio_dpcoord.vllm."), report  # ours, not vLLM's
    assert "prefix-aware engine choice over 2 engines (approximate" in stderr, stderr
    choices = report["choices"]
    for session in range(SESSIONS):
        engines = session_engines(choices, session)
        assert len(set(engines)) == 1, (session, engines, choices)
    # both engines serve sessions: affinity does not pile everything on one
    assert {session_engines(choices, s)[0] for s in range(SESSIONS)} == {0, 1}, choices
    # a pinned data_parallel_rank is vLLM's rule and wins over the cached history
    assert choices["pinned"] == 1 - choices["s0t3"], choices
    # a far busier engine (vLLM's lb state: waiting, running, KV usage) loses the session
    assert choices["busy"] == 1 - choices["s1t3"], choices
    # vLLM's bookkeeping: every finished request left the client's in-flight map
    assert report["in_flight"] == {}, report


async def test_vllm_choice_untouched_when_unset(routing_root: Path) -> None:
    with_plugin, stderr = await run_routing(routing_root, None)
    without_plugin, _ = await run_routing(routing_root, None, plugins=False)
    assert with_plugin["method"] == without_plugin["method"] == VLLMS
    assert with_plugin["choices"] == without_plugin["choices"]
    assert "trio_dpcoord" not in stderr, stderr
    # the trace is one vLLM scatters: its rotating start moves sessions between engines
    choices = with_plugin["choices"]
    scattered = [s for s in range(SESSIONS) if len(set(session_engines(choices, s))) > 1]
    assert scattered, with_plugin["choices"]


async def test_unknown_value_is_ignored_with_a_warning(routing_root: Path) -> None:
    report, stderr = await run_routing(routing_root, "yes")
    assert report["method"] == VLLMS
    assert "TRIO_DPCOORD_VLLM_ROUTING='yes' is ignored" in stderr, stderr


async def test_exact_mode_follows_vllms_kv_events(routing_root: Path, tmp_path: Path) -> None:
    report, stderr = await run_routing(routing_root, "prefix", kv_events_dir=tmp_path)
    assert report["kv"] == {"feed": "exact", "event_batches": 2, "rejected_event_batches": 1}
    assert "2 frames, not (topic, seq, batch); ignored" in stderr, stderr
    # the client's shutdown (vLLM's, with ours first) stops the followers and says so
    assert "(exact): 4 decisions, 0 guard fallbacks, 2 KV event batches applied, 1 rejected" in (
        stderr
    ), stderr
    choices = report["choices"]
    # ties go by rotation: engine 1 was next, but engine 0 reported the prompt's blocks
    assert choices["warm_up"] == 0 and choices["after_stored"] == 0, choices
    assert choices["unrelated"] == 1, choices
    # once engine 0 reports them removed, rotation decides again (engine 1 is next)
    assert choices["after_removed"] == 1, choices


async def test_two_api_servers_share_their_routes(routing_root: Path, tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/coordinator-publish"
    report, stderr = await run_routing(
        routing_root, "prefix", two_servers={"address": address, "share": True}
    )
    assert "sharing routes with 1 other API server(s)" in stderr, stderr
    assert report["slack"] == [0.0, 0.0], report  # the rendezvous is not needed
    choices = report["choices"]
    # every turn went through the other server than the turn before, and each found
    # the history where the previous server had sent it
    for session in range(SESSIONS):
        engines = session_engines(choices, session)
        assert len(set(engines)) == 1, (session, engines, choices)
    assert {session_engines(choices, s)[0] for s in range(SESSIONS)} == {0, 1}, choices
    sent = [peer["sent"] for peer in report["peers"]]
    received = [peer["received"] for peer in report["peers"]]
    assert all(peer["rejected"] == 0 for peer in report["peers"]), report
    # what one sent after the warm-up, the other applied; nothing beyond what was sent
    assert received[0] <= sent[1] and received[1] <= sent[0], report
    assert received[0] >= 6 and received[1] >= 6, report  # six turns each way
    assert "shared routes: " in stderr and " refused" in stderr, stderr  # the stop's tally


async def test_two_api_servers_without_shared_routes_use_the_rendezvous(
    routing_root: Path, tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/coordinator-publish"
    report, stderr = await run_routing(
        routing_root, "prefix", two_servers={"address": address, "share": False}, peers="0"
    )
    assert "sharing routes" not in stderr, stderr
    assert report["peers"] == [None, None], report
    assert report["slack"] == [1.0, 1.0], report
    assert "rendezvous slack 1)" in stderr, stderr
