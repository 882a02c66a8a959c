"""Runner for tests/vllm/test_routing.py: vLLM 0.33.0's ``DPLBAsyncMPClient`` choosing engines.

Run as ``python routing.py CONFIG_JSON`` with the cluster import root
(``tests.vllm_reference.dp_cluster.prepare_cluster_root``) first on ``PYTHONPATH`` and the
project installed. ``CONFIG_JSON``: ``{"plugins": bool, "kv_events_dir": str | null,
"two_servers": {"address": str, "share": bool} | null}`` (two API servers of one
deployment, their shared routes on or off).

Real vLLM code: ``load_general_plugins()`` (which finds our ``vllm.general_plugins`` entry
point and, with ``TRIO_DPCOORD_VLLM_ROUTING=prefix`` in the environment, installs our
choice), ``DPLBAsyncMPClient.get_core_engine_for_request`` (vLLM's or ours, whichever the
class has), ``DPLBAsyncMPClient.process_engine_outputs`` (a finished request leaves the
client's in-flight counts), ``DPLBAsyncMPClient.shutdown`` / ``MPClient.shutdown``, the
request and output structs (``EngineCoreRequest``, ``EngineCoreOutputs``), and for KV
events vLLM's ``KVEventBatch``/``BlockStored``/``BlockRemoved`` encoded by ``msgspec``'s
encoder as ``ZmqEventPublisher`` encodes them, sent in its frames (topic, 8-byte
big-endian seq, payload) over real ZeroMQ sockets.

Stand-ins: the client is made without ``__init__`` (which needs engines, sockets and a
coordinator) and given the state ``__init__`` gives it, for two engines and one API
server: ``core_engines`` (vLLM's identities, the rank as 2 little-endian bytes),
``lb_engines`` (``[waiting, running, kv_usage]`` per engine; the scenario assigns it as
vLLM's stats task does when the coordinator publishes), ``engine_inflight``,
``reqs_in_flight``, ``streaming_reqs``, ``client_count``, ``client_index``,
``eng_start_index``, a ``vllm_config`` with only ``cache_config.block_size``, the asyncio
ZeroMQ context ``ctx``, and ``_kv_event_sources`` (what each engine's handshake reports;
the config objects are plain ones with vLLM's ``KVEventsConfig`` field names, since
``vllm.config`` is inert here); the publishing side of the KV events is this runner's own
XPUB socket per engine (it can wait for our subscription before it publishes, which
vLLM's PUB cannot).

The report (one JSON line on stdout) gives every choice, by step name, as an engine index.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
import traceback
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

ENGINES = 2
BLOCK = 16


def load_kv_events() -> Any:
    """vLLM's ``vllm/distributed/kv_events.py`` from the import root (its package,
    ``vllm.distributed``, is inert there, and the module itself needs nothing torch-bound)."""
    import vllm

    path = Path(vllm.__file__).parent / "distributed" / "kv_events.py"
    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class CacheConfig:
    block_size = BLOCK
    kv_cache_size_tokens = None


class VllmConfig:
    cache_config = CacheConfig()


class KVEventsSource:
    """The fields of vLLM's ``KVEventsConfig`` an engine's handshake reports."""

    def __init__(self, endpoint: str) -> None:
        self.enable_kv_cache_events = True
        self.publisher = "zmq"
        self.endpoint = endpoint
        self.topic = "kv"


def make_client(
    kv_sources: dict[int, KVEventsSource],
    client_count: int = 1,
    client_index: int = 0,
    stats_update_address: str | None = None,
) -> Any:
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    client = object.__new__(DPLBAsyncMPClient)
    client.client_count = client_count
    client.client_index = client_index
    client.stats_update_address = stats_update_address
    client.reqs_in_flight = {}
    client.streaming_reqs = set()
    client.engine_inflight = Counter()
    client.core_engines = [rank.to_bytes(2, "little") for rank in range(ENGINES)]
    client.lb_engines = [[0, 0, 0.0] for _ in range(ENGINES)]
    client.eng_start_index = 0
    client.vllm_config = VllmConfig()
    client.ctx = zmq.asyncio.Context()
    client._kv_event_sources = kv_sources
    # MPClient.shutdown acts once, through its finalizer: here there is nothing to free.
    client._finalizer = weakref.finalize(client.vllm_config, lambda: None)
    client._finalizer.detach()
    return client


def session_tokens(session: int, turn: int) -> list[int]:
    """A chat session's prompt at ``turn``: its own 48-token opening plus 16 per turn."""
    base = 1000 * (session + 1)
    return [base + i for i in range(48 + 16 * turn)]


class Scenario:
    def __init__(self, client: Any) -> None:
        self.client = client
        self.counter = 0
        self.choices: dict[str, int] = {}

    def route(self, step: str, tokens: list[int], rank: int | None = None) -> str:
        from vllm.v1.engine import EngineCoreRequest

        self.counter += 1
        request = EngineCoreRequest(
            request_id=f"req-{self.counter}",
            prompt_token_ids=tokens,
            mm_features=None,
            sampling_params=None,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=rank,
        )
        engine = self.client.get_core_engine_for_request(request)
        self.choices[step] = self.client.core_engines.index(engine)
        return str(request.request_id)

    async def finish(self, request_ids: list[str]) -> None:
        """The requests finish (vLLM's output path), then the coordinator publishes idle
        engines (vLLM's stats task rebinds ``lb_engines``)."""
        from vllm.v1.engine import EngineCoreOutputs
        from vllm.v1.engine.core_client import DPLBAsyncMPClient

        await DPLBAsyncMPClient.process_engine_outputs(
            self.client, EngineCoreOutputs(finished_requests=set(request_ids))
        )
        self.client.lb_engines = [[0, 0, 0.0] for _ in range(ENGINES)]


async def sessions(scenario: Scenario) -> None:
    """Three chat sessions, four turns each, a turn of every session per round."""
    for turn in range(4):
        ids = [
            scenario.route(f"s{session}t{turn}", session_tokens(session, turn))
            for session in range(3)
        ]
        await scenario.finish(ids)
    # A pinned rank wins over the cache: session 0 lives on one engine, pin the other.
    home = scenario.choices["s0t3"]
    pinned = scenario.route("pinned", session_tokens(0, 4), rank=1 - home)
    await scenario.finish([pinned])
    # Loads win over the cache: session 1's engine is far busier (vLLM's lb state).
    home = scenario.choices["s1t3"]
    scenario.client.lb_engines[home] = [40, 40, 0.9]
    busy = scenario.route("busy", session_tokens(1, 4))
    await scenario.finish([busy])


async def kv_events(scenario: Scenario, publishers: list[zmq.asyncio.Socket]) -> dict[str, Any]:
    """Exact mode: what the engines' KV events say decides, not the router's own choices."""
    # a test hook: the state the routing plugin keeps on vLLM's client (its KV-event
    # follower), which no public API exposes
    from trio_dpcoord.vllm._routing import routing_state

    events = load_kv_events()
    encoder = msgspec.msgpack.Encoder()
    seqs = [0] * ENGINES

    async def publish(engine: int, *batch_events: Any) -> None:
        batch = events.KVEventBatch(ts=time.time(), events=list(batch_events))
        batch.data_parallel_rank = engine
        frames = [b"kv", seqs[engine].to_bytes(8, "big"), encoder.encode(batch)]
        seqs[engine] += 1
        await publishers[engine].send_multipart(frames)

    warm_up = scenario.route("warm_up", [7] * 40)  # starts the followers
    state = routing_state(scenario.client)
    assert state is not None and state.follower is not None
    for publisher in publishers:
        subscription = await publisher.recv()
        assert subscription == b"\x01kv", subscription
    await scenario.finish([warm_up])
    # Not a batch (two frames): logged, counted, and the follower goes on.
    await publishers[0].send_multipart([b"kv", b"garbage"])
    tokens = session_tokens(5, 2)
    hashes = [hash(("block", i)) % (1 << 60) for i in range(len(tokens) // BLOCK)]
    await publish(
        0,
        events.BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=tokens[: len(hashes) * BLOCK],
            block_size=BLOCK,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
    )
    await state.follower.wait_applied(2)
    stored = scenario.route("after_stored", [*tokens, 1, 2, 3])
    other = scenario.route("unrelated", [9] * 40)
    await scenario.finish([stored, other])
    await publish(0, events.BlockRemoved(block_hashes=hashes, medium="GPU"))
    await state.follower.wait_applied(3)
    removed = scenario.route("after_removed", [*tokens, 4, 5, 6])
    await scenario.finish([removed])
    counters = state.router.counters
    return {
        "feed": state.router.feed,
        "event_batches": counters.event_batches,
        "rejected_event_batches": counters.rejected_event_batches,
    }


async def two_servers(address: str, share: bool) -> dict[str, Any]:
    """Two API servers (``client_count`` 2) of one deployment (one coordinator address);
    each turn of each session goes to the other server than the turn before, as the
    kernel may spread a user's connections. With shared routes each server waits for the
    other's announcement of a turn before the next (the test's order; a real server does
    not wait)."""
    from trio_dpcoord.vllm._routing import routing_state

    clients = [make_client({}, 2, index, address) for index in range(2)]
    scenarios = [Scenario(client) for client in clients]
    report: dict[str, Any] = {}
    try:
        if share:
            # A SUB connects asynchronously: announcements before it are lost (a real
            # server's first request comes long after). Warm each direction up.
            for sender in range(2):
                other = 1 - sender
                heard = 0
                for attempt in range(200):
                    ids = [scenarios[sender].route(f"warm{sender}", [4, 4, sender] * 20)]
                    await scenarios[sender].finish(ids)
                    receiver = routing_state(clients[other])
                    if receiver is None:  # no choice made there yet: start its reader
                        await scenarios[other].finish([scenarios[other].route("start", [6] * 8)])
                        continue
                    assert receiver.peers is not None
                    try:
                        await asyncio.wait_for(receiver.peers.wait_received(1), 0.05)
                    except asyncio.TimeoutError:
                        continue
                    heard = attempt + 1
                    break
                report[f"warm_up_{sender}"] = heard
        for turn in range(4):
            for session in range(3):
                server = (session + turn) % 2
                scenario = scenarios[server]
                ids = [scenario.route(f"s{session}t{turn}", session_tokens(session, turn))]
                if share:
                    receiver = routing_state(clients[1 - server])
                    assert receiver is not None and receiver.peers is not None
                    await asyncio.wait_for(
                        receiver.peers.wait_received(receiver.peers.received + 1), 10
                    )
                await scenario.finish(ids)
        states = [routing_state(client) for client in clients]
        report["peers"] = [
            None
            if state is None or state.peers is None
            else {
                "sent": state.peers.sent,
                "received": state.peers.received,
                "rejected": state.peers.rejected,
            }
            for state in states
        ]
        report["slack"] = [
            None if state is None else state.router.routing.rendezvous_slack for state in states
        ]
    finally:
        for client in clients:
            client.shutdown()
    report["choices"] = {k: v for scenario in scenarios for k, v in scenario.choices.items()}
    return report


async def run(config: dict[str, Any]) -> dict[str, Any]:
    if config["plugins"]:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    method = DPLBAsyncMPClient.get_core_engine_for_request
    report: dict[str, Any] = {"method": f"{method.__module__}.{method.__qualname__}"}
    if config.get("two_servers") is not None:
        two = config["two_servers"]
        report.update(await two_servers(two["address"], two["share"]))
        return report
    publishers: list[zmq.asyncio.Socket] = []
    kv_sources: dict[int, KVEventsSource] = {}
    context = zmq.asyncio.Context()
    if config["kv_events_dir"] is not None:
        for rank in range(ENGINES):
            endpoint = f"ipc://{config['kv_events_dir']}/kv-{rank}"
            publisher = context.socket(zmq.XPUB)
            publisher.bind(endpoint)
            publishers.append(publisher)
            kv_sources[rank] = KVEventsSource(endpoint)
    client = make_client(kv_sources)
    scenario = Scenario(client)
    try:
        if publishers:
            report["kv"] = await kv_events(scenario, publishers)
        else:
            await sessions(scenario)
    finally:
        client.shutdown()  # ours stops the followers, then vLLM's (here a no-op)
        for publisher in publishers:
            publisher.close(linger=0)
    report["choices"] = scenario.choices
    report["in_flight"] = {str(k): v for k, v in client.reqs_in_flight.items()}
    return report


def main() -> None:
    config = json.loads(sys.argv[1])
    try:
        report = asyncio.run(run(config))
    except Exception:
        print(json.dumps({"error": traceback.format_exc()}), flush=True)
        raise SystemExit(1) from None
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
