"""vLLM 0.33.0's DP engine core, run for real in a torch-free process (one per DP rank).

Run as ``python engine_side.py SPEC_JSON`` with a vLLM import root first on
``PYTHONPATH`` (``dp_cluster.prepare_cluster_root``: the modules it makes inert). The
process calls vLLM's own entry point ``EngineCoreProc.run_engine_core`` exactly as vLLM's
``CoreEngineProcManager`` does, so everything from the startup handshake to the
SIGTERM shutdown is vLLM's code: ``DPEngineCoreProc``'s busy loop, its input/output
socket threads, the READY wait, ``START_DP_WAVE`` handling, ``add_request``'s
``start_wave``, ``_maybe_publish_request_counts``, ``_has_global_unfinished_reqs`` and
the two-phase pause.

Only what needs torch or a GPU is stood in for, each by the smallest thing that keeps
the contract the engine core relies on:

* ``EngineCore.__init__`` (model executor, KV-cache profiling, scheduler construction)
  -> :class:`StandInEngineCore.__init__`, a base class placed between ``EngineCoreProc``
  and ``EngineCore`` in the MRO of :class:`StandInDPEngineCoreProc`, which subclasses
  ``DPEngineCoreProc`` and overrides none of its methods;
* the model executor -> :class:`StandInExecutor`: a forward pass, real or dummy, is one
  round of a real cross-process collective (:class:`LockstepCollective`), so a rank
  left asleep while its peers step blocks them, as MoE all-to-alls do;
* the scheduler -> :class:`StandInScheduler` (a subclass of vLLM's own
  ``SchedulerInterface``): a request needs ``max_tokens`` steps, one token a step;
* the gloo DP process group -> :class:`DPGroup`, the same collective on its own channel;
  ``ParallelConfig.sync_dp_state`` and ``has_unfinished_dp`` are vLLM's own function
  bodies (compiled from ``vllm/config/parallel.py``) with a tiny tensor type and that
  all-reduce in place of torch's;
* ``VllmConfig`` and its parts -> plain objects carrying the fields the engine reads;
* ``vllm.sampling_params`` -> a msgspec struct with the fields a request's are read for
  (``cluster_standins/``).

Two names in ``vllm.v1.engine.core`` are rebound before the engine starts, because vLLM
looks them up there: ``DPEngineCoreProc`` (which ``run_engine_core`` instantiates) to
:class:`StandInDPEngineCoreProc`, and ``ParallelConfig`` (whose ``has_unfinished_dp``
``resume_scheduler`` calls; ``vllm.config`` is inert) to :class:`StandInParallelConfig`.

A profiler records every vLLM function that ran; the process writes a JSON report
(functions called, final wave, any exception) when it exits.
"""

from __future__ import annotations

import ast
import json
import secrets
import sys
import textwrap
import threading
import traceback
import types
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgpack
import vllm.v1.engine.core as vllm_core
import zmq
from vllm.v1.core.sched.interface import (
    PauseState,
    SchedulerInterface,
)
from vllm.v1.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
)
from vllm.v1.request import RequestStatus

FORWARD_CHANNEL = 0
"""Collective channel of forward passes (the MoE all-to-all of every step)."""
DP_GROUP_CHANNEL = 1
"""Collective channel of the DP process group (``sync_dp_state``, ``has_unfinished_dp``)."""


class CollectiveError(RuntimeError):
    """A collective round did not complete: some rank never arrived."""


class LockstepCollective:
    """A rank's side of a real cross-process all-reduce (SUM of two integers).

    Speaks the wire format of :class:`trio_dpcoord.sim.collective.CollectiveHost`, which
    the test runs: a DEALER with identity = rank sends ``[channel, seq, a, b,
    incarnation]``; the host answers once every rank contributed to ``(channel, seq)``,
    or with a failure naming the ranks that never arrived. ``seq`` counts this rank's
    rounds on the channel, so the n-th round of every rank meets the n-th round of its
    peers, as successive collectives on one communicator do. (The host keys its rounds by
    what it calls ``(wave, step)``; here that pair carries ``(channel, seq)``, so its logs
    read "wave 0 step 17" for forward round 17.) Blocking and synchronous: the engine's
    busy loop waits here exactly as it waits in a real all-reduce; a rank that dies leaves
    its peers failing within the host's timeout, as a DP group dies with a member.
    """

    def __init__(self, address: str, rank: int, *, timeout: float) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._rank = rank
        self._timeout = timeout
        self._incarnation = secrets.randbits(62)
        self._sequence = {FORWARD_CHANNEL: 0, DP_GROUP_CHANNEL: 0}
        self.rounds = {FORWARD_CHANNEL: 0, DP_GROUP_CHANNEL: 0}

    def all_reduce(self, channel: int, a: int, b: int) -> tuple[int, int]:
        """SUM over all ranks of ``(a, b)``; blocks until every rank contributed."""
        seq = self._sequence[channel]
        self._sequence[channel] = seq + 1
        self._socket.send(msgpack.packb([channel, seq, a, b, self._incarnation]))
        limit_ms = int((2 * self._timeout + 1.0) * 1000)
        while True:
            if not self._socket.poll(limit_ms):
                raise CollectiveError(
                    f"rank {self._rank}: no answer from the collective host for channel "
                    f"{channel} round {seq}"
                )
            reply = msgpack.unpackb(self._socket.recv())
            if reply[:2] != [channel, seq]:
                continue
            if reply[2] is None:
                raise CollectiveError(
                    f"rank {self._rank}: collective channel {channel} round {seq} failed: "
                    f"ranks {reply[3]} never arrived (the host's failed round: channel "
                    f"{reply[4]} round {reply[5]})"
                )
            self.rounds[channel] += 1
            return int(reply[2]), int(reply[3])

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()


# --- torch stand-in for the two real ParallelConfig function bodies -------------------


class _Tensor:
    """The few tensor operations ``sync_dp_state``/``has_unfinished_dp`` use."""

    def __init__(self, values: list[int]) -> None:
        self.values = values

    def __getitem__(self, index: int) -> _Tensor:
        return _Tensor([self.values[index]])

    def item(self) -> int:
        (value,) = self.values
        return value


class DPGroup:
    """Stand-in for the stateless gloo DP ``ProcessGroup``: the DP-group channel."""

    def __init__(self, collective: LockstepCollective, size: int) -> None:
        self._collective = collective
        self._size = size

    def size(self) -> int:
        return self._size

    def all_reduce_sum(self, tensor: _Tensor) -> None:
        if len(tensor.values) == 1:
            total, _ = self._collective.all_reduce(DP_GROUP_CHANNEL, tensor.values[0], 0)
            tensor.values = [total]
        else:
            first, second = self._collective.all_reduce(DP_GROUP_CHANNEL, *tensor.values)
            tensor.values = [first, second]


def _cpu_all_reduce_(tensor: _Tensor, group: DPGroup, timeout: object = None) -> None:
    group.all_reduce_sum(tensor)


class _ReduceOp:
    SUM = "sum"
    MAX = "max"


def _dist_all_reduce(tensor: _Tensor, op: str = _ReduceOp.SUM, group: Any = None) -> None:
    if op == _ReduceOp.MAX:
        # MAX of 0/1 flags is (SUM > 0): all this stand-in needs to support.
        if any(v not in (0, 1) for v in tensor.values):
            raise ValueError("the stand-in MAX all-reduce supports 0/1 flags only")
        group.all_reduce_sum(tensor)
        tensor.values = [min(v, 1) for v in tensor.values]
    else:
        group.all_reduce_sum(tensor)


_torch_standin = types.SimpleNamespace(
    tensor=lambda values, dtype=None, device=None: _Tensor([int(v) for v in values]),
    int32="int32",
    distributed=types.SimpleNamespace(all_reduce=_dist_all_reduce),
)


def real_parallel_config_functions() -> dict[str, Any]:
    """vLLM's own ``ParallelConfig.has_unfinished_dp`` and ``sync_dp_state`` bodies,
    compiled from ``vllm/config/parallel.py`` with the tensor stand-in above as torch."""
    import vllm

    source_path = Path(vllm.__file__).parent / "config" / "parallel.py"
    tree = ast.parse(source_path.read_text())
    (cls,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ParallelConfig")
    wanted = {"has_unfinished_dp", "sync_dp_state"}
    namespace: dict[str, Any] = {
        "torch": _torch_standin,
        "ReduceOp": _ReduceOp,
        "cpu_all_reduce_": _cpu_all_reduce_,
        "ProcessGroup": DPGroup,
    }
    source = source_path.read_text()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in wanted:
            # the segment starts at ``def``: decorators (@staticmethod) are left out
            code = textwrap.dedent(ast.get_source_segment(source, node) or "")
            exec(compile(code, str(source_path), "exec"), namespace)
            wanted.discard(node.name)
    if wanted:
        raise RuntimeError(f"vllm/config/parallel.py has no ParallelConfig.{sorted(wanted)}")
    return {name: namespace[name] for name in ("has_unfinished_dp", "sync_dp_state")}


# --- configuration stand-ins ---------------------------------------------------------


class _Config:
    """A plain attribute bag standing in for one of vLLM's config dataclasses."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> Any:  # fields set in __init__ (for mypy)
        raise AttributeError(name)


_REAL = real_parallel_config_functions()


class StandInParallelConfig(_Config):
    """The ``ParallelConfig`` fields and methods the DP engine core uses; the two DP
    synchronisation functions are vLLM's own bodies."""

    has_unfinished_dp = staticmethod(_REAL["has_unfinished_dp"])
    sync_dp_state = _REAL["sync_dp_state"]

    collective: LockstepCollective | None = None

    def stateless_init_dp_group(self, return_store: bool = False) -> Any:
        assert self.collective is not None
        group = DPGroup(self.collective, self.data_parallel_size)
        return (group, None) if return_store else group

    def compute_hash(self) -> str:
        return f"stand-in dp{self.data_parallel_size}"

    def reconfigure_for_independent_dp_rank(self) -> None:
        raise AssertionError("a MoE model never runs independent DP ranks")


class StandInVllmConfig(_Config):
    def __post_init__(self) -> None:
        """vLLM re-validates its config after the handshake; nothing to redo here."""


def make_vllm_config(spec: dict[str, Any]) -> StandInVllmConfig:
    dp_size = int(spec["dp_size"])
    parallel = StandInParallelConfig(
        data_parallel_size=dp_size,
        data_parallel_size_local=dp_size,
        data_parallel_rank=0,
        data_parallel_rank_local=None,
        data_parallel_index=0,
        data_parallel_external_lb=False,
        data_parallel_hybrid_lb=False,
        data_parallel_master_ip="127.0.0.1",
        data_parallel_master_port=0,
        _data_parallel_master_port_list=[],
        _coord_store_port=0,
        local_engines_only=False,
        dp_sync_interval=int(spec["dp_sync_interval"]),
        cpu_distributed_timeout=None,
        enable_fault_tolerance=False,
        enable_elastic_ep=False,
        numa_bind=False,
        world_size=1,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
    )
    return StandInVllmConfig(
        parallel_config=parallel,
        model_config=_Config(
            is_moe=True,
            max_model_len=4096,
            dtype="bfloat16",
            enable_sleep_mode=False,
            runner_type="generate",
            is_diffusion=False,
            multimodal_config=None,
        ),
        cache_config=_Config(
            num_gpu_blocks=1024,
            block_size=16,
            mamba_block_size=None,
            effective_attention_block_size=16,
            kv_cache_size_tokens=16384,
            kv_cache_max_concurrency=64.0,
            enable_prefix_caching=False,
        ),
        scheduler_config=_Config(
            prefill_schedule_interval=1,
            max_num_seqs=int(spec.get("max_num_seqs", 64)),
            max_num_batched_tokens=8192,
            async_scheduling=False,
        ),
        observability_config=_Config(enable_logging_iteration_details=False),
        kv_transfer_config=None,
        lora_config=None,
        weight_transfer_config=None,
        speculative_config=None,
        instance_id=f"stand-in-{spec['rank']}",
        shutdown_timeout=0,
        watchdog_config=_Config(dump_dir=None),
        max_concurrent_batches=1,
        is_mm_encoder_only=False,
    )


# --- scheduler and executor stand-ins -------------------------------------------------


class StandInSchedulerOutput:
    """What a step scheduled: one token for each listed request."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.total_num_scheduled_tokens = len(request_ids)


class _Entry:
    def __init__(self, request: Any) -> None:
        self.request = request
        self.generated = 0


class StandInScheduler(SchedulerInterface):  # type: ignore[misc]
    """A FIFO scheduler over vLLM's ``SchedulerInterface``: every running request gets
    one token a step and finishes after ``sampling_params.max_tokens`` of them. Pause
    states behave as vLLM's ``Scheduler``'s: PAUSED_NEW admits nothing new but drains
    the running requests, PAUSED_ALL schedules nothing and reports nothing unfinished.
    """

    def __init__(self, max_num_seqs: int, include_finished_set: bool) -> None:
        self.max_num_seqs = max_num_seqs
        self.include_finished_set = include_finished_set
        self.waiting: deque[_Entry] = deque()
        self.running: dict[str, _Entry] = {}
        self.finished_req_ids: set[str] = set()
        self._pause_state = PauseState.UNPAUSED
        self.connector = None
        self.ec_connector = None

    def schedule(self, throttle_prefills: bool = False) -> StandInSchedulerOutput:
        if self._pause_state == PauseState.PAUSED_ALL:
            return StandInSchedulerOutput([])
        if self._pause_state == PauseState.UNPAUSED and not throttle_prefills:
            while self.waiting and len(self.running) < self.max_num_seqs:
                entry = self.waiting.popleft()
                entry.request.status = RequestStatus.RUNNING
                self.running[entry.request.request_id] = entry
        return StandInSchedulerOutput(list(self.running))

    def get_grammar_bitmask(self, scheduler_output: Any) -> None:
        return None

    def update_from_output(
        self, scheduler_output: StandInSchedulerOutput, model_runner_output: Any
    ) -> dict[int, Any]:
        outputs: dict[int, list[Any]] = {}
        finished: dict[int, set[str]] = {}
        for request_id in scheduler_output.request_ids:
            entry = self.running.get(request_id)
            if entry is None:  # aborted while the step ran
                continue
            entry.generated += 1
            client = entry.request.client_index
            done = entry.generated >= entry.request.max_tokens
            if done:
                del self.running[request_id]
                entry.request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                finished.setdefault(client, set()).add(request_id)
            outputs.setdefault(client, []).append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[entry.generated],
                    finish_reason=FinishReason.LENGTH if done else None,
                )
            )
        self.finished_req_ids.clear()
        return {
            client: EngineCoreOutputs(
                outputs=outs,
                finished_requests=(finished.get(client) if self.include_finished_set else None),
            )
            for client, outs in outputs.items()
        }

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        raise AssertionError("no speculative decoding here")

    def update_draft_token_ids_in_output(self, draft_token_ids: Any, scheduler_output: Any) -> None:
        raise AssertionError("no speculative decoding here")

    def add_request(self, request: Any) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(_Entry(request))

    def has_request(self, request_id: str) -> bool:
        return request_id in self.running or any(
            e.request.request_id == request_id for e in self.waiting
        )

    def finish_requests(self, request_ids: Any, finished_status: Any) -> list[Any]:
        ids = (
            None
            if request_ids is None
            else set([request_ids] if isinstance(request_ids, str) else request_ids)
        )
        removed: list[Any] = []
        for request_id in list(self.running):
            if ids is None or request_id in ids:
                removed.append(self.running.pop(request_id).request)
        kept: deque[_Entry] = deque()
        for entry in self.waiting:
            if ids is None or entry.request.request_id in ids:
                removed.append(entry.request)
            else:
                kept.append(entry)
        self.waiting = kept
        for request in removed:
            request.status = finished_status
            self.finished_req_ids.add(request.request_id)
        return removed

    def get_num_unfinished_requests(self) -> int:
        if self._pause_state == PauseState.PAUSED_ALL:
            return 0
        if self._pause_state == PauseState.PAUSED_NEW:
            return len(self.running)
        return len(self.running) + len(self.waiting)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    @property
    def pause_state(self) -> Any:
        return self._pause_state

    def set_pause_state(self, pause_state: Any) -> None:
        self._pause_state = pause_state

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return True

    def reset_encoder_cache(self) -> None:
        pass

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def get_kv_cache_usage(self) -> float:
        return len(self.running) / self.max_num_seqs

    def make_stats(self) -> None:
        return None

    def get_kv_connector(self) -> None:
        return None

    def get_ec_connector(self) -> None:
        return None

    def get_kv_event_publisher_config(self) -> None:
        return None

    def shutdown(self) -> None:
        pass


DP_WAVE_STATE_RPC = "dp_wave_state"
"""The harness's probe (not a vLLM method): the front-end's ``collective_rpc`` of this
name, through vLLM's utility path, answers ``[[current_wave, engines_running]]`` as the
engine's busy loop sees them between two steps."""


class StandInExecutor:
    """The model executor: each forward pass with tokens, and each dummy batch, is one
    round of the forward-pass collective (a step with nothing scheduled runs no forward,
    as vLLM's model runner returns early on it). Its ``collective_rpc`` also answers the
    harness's :data:`DP_WAVE_STATE_RPC` probe."""

    is_sleeping = False

    def __init__(self, vllm_config: Any) -> None:
        collective = vllm_config.parallel_config.collective
        assert collective is not None
        self.collective: LockstepCollective = collective
        self.forward_passes = 0
        self.dummy_batches = 0

    def _forward(self) -> None:
        self.collective.all_reduce(FORWARD_CHANNEL, 0, 0)

    def register_failure_callback(self, callback: Any) -> None:
        self.failure_callback = callback

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        if scheduler_output.total_num_scheduled_tokens > 0:
            self._forward()
            self.forward_passes += 1
        done: Future[Any] = Future()
        done.set_result(types.SimpleNamespace(sampled=scheduler_output.request_ids))
        return done if non_block else done.result()

    def sample_tokens(self, grammar_output: Any) -> Any:
        raise AssertionError("execute_model always returns its output")

    def execute_dummy_batch(self) -> None:
        self._forward()
        self.dummy_batches += 1

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        if method == DP_WAVE_STATE_RPC:
            # the harness's probe, run by vLLM's busy loop between two steps
            (engine,) = ENGINES
            return [[engine.current_wave, engine.engines_running]]
        if method != "synchronize_device":
            raise AssertionError(f"unexpected collective_rpc {method!r}")
        return [None]

    def take_draft_token_ids(self) -> None:
        return None

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    def supports_draft_weight_updates(self) -> bool:
        return False

    def shutdown(self) -> None:
        pass


# --- the engine -----------------------------------------------------------------------

ENGINES: list[Any] = []
"""The engine core built in this process (for the exit report)."""


class StandInEngineCore(vllm_core.EngineCore):  # type: ignore[misc]
    """Replaces ``EngineCore.__init__`` only: the attributes vLLM's constructor sets,
    with the executor and scheduler stand-ins instead of a model, a KV cache and vLLM's
    ``Scheduler``. Every other ``EngineCore`` method is vLLM's."""

    def __init__(
        self,
        vllm_config: Any,
        executor_class: Any,
        log_stats: bool,
        executor_fail_callback: Any = None,
        include_finished_set: bool = False,
    ) -> None:
        ENGINES.append(self)
        self.vllm_config = vllm_config
        self.log_stats = log_stats
        self._weight_version = "default"
        self.model_executor = executor_class(vllm_config)
        self._pooler_config_logged = False
        if executor_fail_callback is not None:
            self.model_executor.register_failure_callback(executor_fail_callback)
        self.available_gpu_memory_for_kv_cache = -1
        self.structured_output_manager = vllm_core.StructuredOutputManager(vllm_config)
        self.scheduler = StandInScheduler(
            vllm_config.scheduler_config.max_num_seqs, include_finished_set
        )
        self.use_spec_decode = False
        self.check_for_draft_tokens = False
        self.mm_receiver_cache = None
        self.batch_queue_size = 1
        self.batch_queue = None
        self.is_mm_encoder_only = False
        self.is_pooling_model = False
        self.request_block_hasher = None
        self.step_fn = self.step
        self.async_scheduling = False
        self.aborts_queue = vllm_core.queue.Queue()
        self._idle_state_callbacks: list[Any] = []


class StandInDPEngineCoreProc(vllm_core.DPEngineCoreProc, StandInEngineCore):  # type: ignore[misc]
    """vLLM's ``DPEngineCoreProc``, whole: its MRO runs ``EngineCoreProc.__init__``'s
    ``super().__init__`` into :class:`StandInEngineCore`. Overrides nothing."""


# --- call tracing and the exit report -------------------------------------------------


class CallTracer:
    """Records every vLLM function (by qualified name) that ran, in any thread."""

    def __init__(self, source_root: str) -> None:
        self._prefix = source_root.rstrip("/") + "/vllm/"
        self._codes: set[types.CodeType] = set()
        self._lock = threading.Lock()

    def _profile(self, frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call":
            code = frame.f_code
            if code not in self._codes and code.co_filename.startswith(self._prefix):
                with self._lock:
                    self._codes.add(code)

    def start(self) -> None:
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)

    def called(self) -> list[str]:
        with self._lock:
            codes = list(self._codes)
        names = set()
        for code in codes:
            module = code.co_filename[len(self._prefix) - len("vllm/") :].removesuffix(".py")
            names.add(f"{module.replace('/', '.')}:{code.co_qualname}")
        return sorted(names)


def main() -> int:
    spec = json.loads(sys.argv[1])
    rank = int(spec["rank"])
    report: dict[str, Any] = {"rank": rank, "exception": None}
    import vllm

    tracer = CallTracer(str(Path(vllm.__file__).parent.parent))
    vllm_config = make_vllm_config(spec)
    collective = LockstepCollective(spec["collective_address"], rank, timeout=spec["timeout"])
    vllm_config.parallel_config.collective = collective
    # run_engine_core builds the class it finds under this name: ours, which is vLLM's
    # DPEngineCoreProc with the torch-free EngineCore constructor underneath.
    vllm_core.DPEngineCoreProc = StandInDPEngineCoreProc
    # ... and resume_scheduler calls ParallelConfig.has_unfinished_dp by class name.
    vllm_core.ParallelConfig = StandInParallelConfig
    tracer.start()
    try:
        vllm_core.EngineCoreProc.run_engine_core(
            vllm_config=vllm_config,
            local_client=True,
            handshake_address=spec["handshake_address"],
            executor_class=StandInExecutor,
            log_stats=False,
            dp_rank=rank,
            local_dp_rank=rank,
        )
    except SystemExit as exc:
        report["exit"] = str(exc.code)
    except BaseException as exc:  # the report must carry whatever ended the engine
        report["exception"] = "".join(traceback.format_exception(exc))
    finally:
        tracer.stop()
        if ENGINES:
            engine = ENGINES[0]
            report.update(
                current_wave=engine.current_wave,
                engines_running=engine.engines_running,
                step_counter=engine.step_counter,
                forward_passes=engine.model_executor.forward_passes,
                dummy_batches=engine.model_executor.dummy_batches,
            )
        report["collective_rounds"] = {
            "forward": collective.rounds[FORWARD_CHANNEL],
            "dp_group": collective.rounds[DP_GROUP_CHANNEL],
        }
        report["called"] = tracer.called()
        collective.close()
        Path(spec["report_path"]).write_text(json.dumps(report, indent=1))
    return 0 if report["exception"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
