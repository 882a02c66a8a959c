"""Simulated engines that speak vLLM's engine-core protocol, and a fleet of them behind the
trio engine client.

:class:`SimEngineCore` is the simulated DP rank of :mod:`.engine` (the same waiting and
running queues, steps, lock-step collective and coordinator sockets, docs/protocol.md
§6) with the engine side of vLLM's engine-core start-up and request protocol
(docs/protocol.md §14) in place of the simulation's own front-end messages:

* **Handshake.** A DEALER (identity = the rank as two little-endian bytes) to the
  front-end's handshake address says ``{"status": "HELLO", ...}``; the answer
  (``EngineHandshakeMetadata``) gives the request input, the output address and the
  coordinator's two engine sockets, which the engine then connects as
  :class:`~.engine.SimEngine` does. Once the coordinator said READY it sends its
  ``EngineCoreReadyResponse`` first thing on the input DEALER and ``{"status": "READY",
  ..., "parallel_config_hash": ...}`` on the handshake socket.
* **Requests.** ADD (vLLM's ``EngineCoreRequest``, the wave stamp adopted as before),
  ABORT (the requests are dropped and nothing is sent back, as vLLM's engines do for an
  abort from their client), UTILITY (``pause_scheduler`` with vLLM's ``mode``:
  ``"abort"`` first finishes every request with finish reason ``abort``, then the
  two-phase pause of §6.8 answers the call once every rank agreed;
  ``resume_scheduler`` with 0.33's all-rank barrier, ``is_scheduler_paused``,
  ``is_sleeping``, ``get_weight_version``; anything else is answered with vLLM's
  failure message).
* **Outputs.** ``EngineCoreOutputs`` per step with each request's new token id and
  finish reason; utility answers as vLLM's ``UtilityOutput`` ``[call_id, failure,
  [None, result]]``; no status events. A rank whose collective times out (its DP group is
  broken) sends ``ENGINE_CORE_DEAD`` before it exits, as a dying vLLM engine does.

:func:`open_engine_core_fleet` runs ``python -m trio_dpcoord.sim engine
--handshake-address ...`` processes, and :func:`open_sim_engine_client` puts
:func:`trio_dpcoord.open_engine_client` in front of them, so that one code path serves
simulated and real vLLM engines (``examples/launch_cluster.py --engine-protocol vllm``,
``examples/http_frontend.py --engines-from sim``). :func:`run_engine_core_cluster` is the
launcher's bursty load through the client.
"""

from __future__ import annotations

import logging
import random
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Final

import trio
import zmq

from .. import EngineClient, PrivateIpcDirectory, SamplingParams, open_engine_client, protocol
from ..trio_zmq import AsyncSocket, open_context, open_socket
from . import messages
from .cluster_config import ClusterConfig, ClusterReport, log_to_stderr
from .collective import CollectiveTimeoutError
from .engine import SimEngine
from .engine_config import EngineConfig
from .engine_errors import EngineProtocolError
from .engine_sockets import HEARTBEAT_OPTIONS
from .engine_state import FINISH_ABORT, RequestState
from .fleet import EngineFleet, engine_command

__all__ = [
    "ENGINE_CLIENT_MODE",
    "SIM_VLLM_VERSION",
    "EngineCoreFleet",
    "SimEngineCore",
    "free_tcp_address",
    "open_engine_core_fleet",
    "open_sim_engine_client",
    "run_engine_core_cluster",
]

logger = logging.getLogger(__name__)

SIM_VLLM_VERSION: Final = "trio_dpcoord.sim"
"""The ``vllm_version`` a simulated engine reports in its ready response."""

ENGINE_CLIENT_MODE: Final = "engine-client"
""":attr:`ClusterReport.mode` of a run through the engine client (its coordinator inside)."""

_PAUSED_EVENTS: Final = frozenset({messages.EVENT_PAUSED, messages.EVENT_RESUMED})

# What a simulated engine reports of its model and KV cache (nothing depends on them).
_MAX_MODEL_LEN: Final = 1 << 16
_NUM_GPU_BLOCKS: Final = 1 << 12


class SimEngineCore(SimEngine):
    """A simulated DP rank that learns its addresses from vLLM's engine handshake.

    ``config``'s four front-end and coordinator addresses are ignored: the handshake
    answer replaces them (the collective address, the step model and the rest stay).
    """

    def __init__(self, config: EngineConfig, handshake_address: str) -> None:
        super().__init__(config)
        self.handshake_address = handshake_address
        self._handshake: AsyncSocket | None = None

    @property
    def _parallel_config_hash(self) -> str:
        cfg = self.config
        return f"sim-dp{cfg.engine_count}-sync{cfg.sync_interval}-run{cfg.max_running}"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """HELLO, take the addresses, then run as :meth:`SimEngine.run` (READY is sent
        from :meth:`_greet_frontend`, once the coordinator let the engine in)."""
        identity = protocol.engine_identity(self.rank)
        async with (
            open_context() as context,
            open_socket(
                context,
                zmq.DEALER,
                connect=self.handshake_address,
                options={zmq.IDENTITY: identity, **HEARTBEAT_OPTIONS},
            ) as handshake,
        ):
            # as vLLM's headless engines say it (``local = not headless``): vLLM's own
            # front-end refuses a HELLO whose ``local`` it does not expect
            await handshake.send(protocol.encode_handshake_hello(local=False, headless=True))
            answer = await handshake.recv()
            self.config = _configured(self.config, answer)
            logger.debug("rank %d: handshake answered: %s", self.rank, self.config)
            self._handshake = handshake
            await super().run(task_status=task_status)

    async def _greet_frontend(self, dealer: AsyncSocket) -> None:
        assert self._handshake is not None
        cfg = self.config
        await dealer.send(
            protocol.encode_ready_response(
                max_model_len=_MAX_MODEL_LEN,
                num_gpu_blocks=_NUM_GPU_BLOCKS,
                data_parallel_rank=self.rank,
                vllm_version=SIM_VLLM_VERSION,
                data_parallel_size=cfg.engine_count,
                max_num_seqs=cfg.max_running,
                max_num_batched_tokens=cfg.token_budget,
                instance_id=f"sim-{self.rank}",
            )
        )
        await self._handshake.send(
            protocol.encode_handshake_ready(
                num_gpu_blocks=_NUM_GPU_BLOCKS,
                parallel_config_hash=self._parallel_config_hash,
                local=False,
                headless=True,
            )
        )

    async def _status(self, event: str, wave: int, call_id: int = 0) -> None:
        # vLLM's engines send no status events; the answers to pause and resume are
        # the utility calls' results.
        if event in _PAUSED_EVENTS:
            await self._utility_answer(call_id, None, None)

    async def _utility_answer(self, call_id: int, failure: str | None, result: Any) -> None:
        answer = protocol.encode_utility_output(call_id, failure, result)
        await self._to_frontend(
            protocol.encode_engine_core_outputs(
                protocol.EngineCoreOutputs(engine_index=self.rank, utility_output=answer)
            )
        )

    async def _on_utility(self, call: protocol.UtilityCall) -> None:
        if call.method == messages.RESUME_SCHEDULER:
            await self._resume_with_barrier(call)
            return
        if call.method == messages.PAUSE_SCHEDULER:
            mode = call.args[0] if call.args else "abort"
            if mode not in ("abort", "keep", "wait"):
                await self._utility_answer(
                    call.call_id, f"Call to pause_scheduler method failed: mode {mode!r}", None
                )
                return
            if mode == "abort":
                # vLLM: every request finishes aborted, and its client is told so.
                dropped = [*self.waiting, *self.running]
                self.waiting.clear()
                self.running = []
                if dropped:
                    await self._send_outputs([(r, FINISH_ABORT) for r in dropped])
        await super()._on_utility(call)

    async def _resume_with_barrier(self, call: protocol.UtilityCall) -> None:
        """vLLM 0.33's ``DPEngineCoreProc.resume_scheduler``: an engine that is not
        stepping resumes, then meets every rank in an all-reduce (the resume call goes to
        all of them) so that none starts stepping while a peer would still drop the
        coordinator's ``START_DP_WAVE``; the group steps if any rank kept requests."""
        if not self.engines_running:
            self.scheduler_paused = False
            self.ignore_start_dp_wave = False
            assert self._collective is not None
            result = await self._collective.step(
                wave=self.current_wave,
                step=0,  # no step of a wave is 0: the barrier is a round of its own
                has_unfinished=self._has_unfinished(),
                pending_pause=False,
            )
            self.engines_running = result.unfinished > 0
            logger.debug(
                "rank %d: resumed at wave %d (group running: %s)",
                self.rank,
                self.current_wave,
                self.engines_running,
            )
        await self._utility_answer(call.call_id, None, None)

    async def _other_utility(self, call: protocol.UtilityCall) -> None:
        answers: dict[str, Callable[[], object]] = {
            "is_scheduler_paused": lambda: self.scheduler_paused,
            "is_sleeping": lambda: False,
            "get_weight_version": lambda: "default",
        }
        answer = answers.get(call.method)
        if answer is None:
            self.counters.bad_requests += 1
            logger.warning("rank %d: no utility method %r", self.rank, call.method)
            await self._utility_answer(
                call.call_id,
                f"Call to {call.method} method failed: the simulated engine has no "
                f"method {call.method!r}",
                None,
            )
            return
        await self._utility_answer(call.call_id, None, answer())

    async def _report_aborted(self, dropped: list[RequestState]) -> None:
        logger.debug("rank %d: aborted %d request(s)", self.rank, len(dropped))

    async def _busy_loop(self) -> None:
        try:
            await super()._busy_loop()
        except CollectiveTimeoutError:
            # What a vLLM engine's output thread sends as the engine dies of an error.
            await self._to_frontend(protocol.ENGINE_CORE_DEAD)
            raise


def _configured(config: EngineConfig, answer: bytes) -> EngineConfig:
    """``config`` with the addresses of a handshake answer; :class:`EngineProtocolError`
    for an answer a vLLM engine could not decode, or one without the addresses it needs."""
    try:
        metadata = protocol.decode_handshake_metadata(answer)
    except (protocol.ProtocolError, protocol.EngineHandshakeError) as exc:
        raise EngineProtocolError(
            f"rank {config.rank}: unusable handshake answer: {exc!r:.200}"
        ) from exc
    back_publish, back_output = metadata.coordinator_input, metadata.coordinator_output
    if not metadata.inputs or not metadata.outputs or back_publish is None or back_output is None:
        raise EngineProtocolError(
            f"rank {config.rank}: the handshake answer lacks an address: {metadata!r:.200}"
        )
    return replace(
        config,
        request_address=metadata.inputs[0],
        completion_address=metadata.outputs[0],
        back_publish_address=back_publish,
        back_output_address=back_output,
    )


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """``tcp://HOST:PORT`` with a port free right now (for a handshake address that the
    engines must know before the client binds it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    bracketed = f"[{host}]" if ":" in host else host
    return f"tcp://{bracketed}:{port}"


@dataclass
class EngineCoreFleet:
    """The engine processes of :func:`open_engine_core_fleet`."""

    handshake_address: str
    report: ClusterReport
    _fleet: EngineFleet

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(self.report.engine_pids)

    async def stop(self) -> None:
        """Stop and reap every engine now (stdin EOF, then SIGTERM, then SIGKILL); their
        going is then no failure."""
        await self._fleet.stop()


@asynccontextmanager
async def open_engine_core_fleet(
    config: ClusterConfig,
    handshake_address: str,
    *,
    on_failure: Callable[[str], None],
    log_line: Callable[[str], None] = log_to_stderr,
    report: ClusterReport | None = None,
) -> AsyncIterator[EngineCoreFleet]:
    """``config.engines`` engine-core processes that connect to ``handshake_address``.

    They wait for the front-end (ZeroMQ retries the connection until it is bound). An
    engine process that exits while the block runs is reported to ``on_failure`` (a line
    naming its rank, pid and exit status). Leaving the block stops and reaps every one.
    """
    if report is None:
        report = ClusterReport(ENGINE_CLIENT_MODE, config.engines, "both", 0, 0)
    workdir = PrivateIpcDirectory()
    collective = config.collective_address or workdir.address("collective")

    def command(rank: int) -> list[str]:
        addresses = [f"--handshake-address={handshake_address}"]
        return engine_command(config, rank, [*addresses, f"--collective-address={collective}"])

    fleet = EngineFleet(report, log_line, None, command=command)
    fleet.on_failure = lambda: on_failure(report.engine_failures[-1])
    try:
        async with trio.open_nursery() as nursery:
            try:
                for rank in range(config.engines):
                    await fleet.spawn(rank, nursery)
                yield EngineCoreFleet(handshake_address, report, fleet)
            finally:
                with trio.CancelScope(shield=True):
                    await fleet.stop()
    finally:
        workdir.cleanup()


@asynccontextmanager
async def open_sim_engine_client(
    config: ClusterConfig,
    *,
    on_failure: Callable[[str], None],
    handshake_address: str | None = None,
    log_line: Callable[[str], None] = log_to_stderr,
    report: ClusterReport | None = None,
    **client_options: Any,
) -> AsyncIterator[tuple[EngineClient, EngineCoreFleet]]:
    """Simulated engine-core processes and :func:`open_engine_client` in front of them.

    The client is the one real vLLM engines get (``client_options`` are its options);
    ``startup_timeout`` defaults to ``config.ready_timeout``. On leaving, the engines
    are stopped first (the coordinator expects it), then the client.
    """
    address = handshake_address or free_tcp_address(config.host or "127.0.0.1")
    client_options.setdefault("startup_timeout", config.ready_timeout)
    if config.host not in (None, "127.0.0.1", "::1", "localhost"):
        client_options.setdefault("allow_remote", True)
    async with open_engine_core_fleet(
        config, address, on_failure=on_failure, log_line=log_line, report=report
    ) as fleet:
        async with open_engine_client(config.engines, address, **client_options) as client:
            try:
                yield client, fleet
            finally:
                client.expect_shutdown()
                with trio.CancelScope(shield=True):
                    await fleet.stop()


async def run_engine_core_cluster(
    config: ClusterConfig, *, log_line: Callable[[str], None] = log_to_stderr
) -> ClusterReport:
    """The launcher's run through the engine client: ``config.load``'s bursts with idle
    gaps (and a pause and resume every ``pause_every`` bursts) sent to simulated
    engine-core processes by :func:`open_engine_client`; failures end the run and are
    recorded in the report, not raised."""
    plan = config.load
    # the client notifies the first request to a paused fleet, and the engines report
    # start_wave (vLLM >= 0.33): both wake paths
    report = ClusterReport(ENGINE_CLIENT_MODE, config.engines, "both", plan.seed, plan.requests)
    started = trio.current_time()
    client: EngineClient | None = None
    try:
        with trio.CancelScope() as run_scope:

            def engine_failed(message: str) -> None:
                run_scope.cancel()

            async with open_sim_engine_client(
                config, on_failure=engine_failed, log_line=log_line, report=report
            ) as (client, _):
                await _client_load(client, config, report)
                with trio.move_on_after(1.0):  # count the last wave too
                    await client.coordinator.wait_for(lambda c: not c.snapshot().engines_running)
                report.coordinator_errors = client.coordinator.statistics().errors
                report.waves = client.coordinator.statistics().waves_completed
    except Exception as exc:  # an engine-client error, or a request's (in a group)
        report.failures.append(f"{type(exc).__name__}: {exc}")
        logger.exception("engine-core cluster run failed")
    report.duration = trio.current_time() - started
    return report


async def _client_load(client: EngineClient, config: ClusterConfig, report: ClusterReport) -> None:
    """:func:`.frontend.generate_load`'s schedule, through the engine client."""
    plan = config.load
    rng = random.Random(plan.seed)
    bursts = 0

    async def one(max_tokens: int) -> None:
        done = await client.complete([1, 2, 3, 4], _params(max_tokens))
        if len(done.token_ids) == max_tokens and done.finish_reason == "length":
            report.completed += 1
        else:
            report.failures.append(
                f"request {done.request_id}: {len(done.token_ids)} of {max_tokens} tokens, "
                f"finish reason {done.finish_reason}"
            )

    while report.requests < plan.requests:
        size = min(rng.randint(*plan.burst), plan.requests - report.requests)
        async with trio.open_nursery() as nursery:
            for _ in range(size):
                nursery.start_soon(one, rng.randint(*plan.tokens))
                report.requests += 1
                await trio.sleep(rng.uniform(0.0, 0.003) if rng.random() < 0.2 else 0)
        bursts += 1
        if report.requests >= plan.requests:
            break
        if plan.pause_every and bursts % plan.pause_every == 0:
            await client.pause_scheduler("keep")
            await client.resume_scheduler()
            report.pauses += 1
        await trio.sleep(rng.uniform(*plan.gap))


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
