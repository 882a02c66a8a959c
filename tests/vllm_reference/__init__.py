"""vLLM 0.33.0's real code, run without torch, for tests and benchmarks.

See ``README.md`` here. In short: :func:`prepare_import_root` builds (once, cached) a
directory holding every ``.py`` file of vLLM's wheel with stand-ins written over the
torch-importing modules; a process with that directory first on ``PYTHONPATH``
(:func:`vllm_env`) imports vLLM's real modules. vLLM code only ever runs in such
subprocesses, never in pytest's own process.
"""

from ._process import RUNNERS_DIR, runner_command, vllm_env
from ._root import (
    CACHE_ENV,
    DEFAULT_INERT,
    OFFLINE_ENV,
    STANDINS_DIR,
    VLLM_VERSION,
    VllmUnavailable,
    cache_dir,
    prepare_import_root,
    wheel_path,
)
from .coordinator import (
    CoordinatorOptions,
    VllmCoordinator,
    VllmCoordinatorAddresses,
    coordinator_command,
    open_vllm_coordinator,
    start_vllm_coordinator,
)

__all__ = [
    "CACHE_ENV",
    "DEFAULT_INERT",
    "OFFLINE_ENV",
    "RUNNERS_DIR",
    "STANDINS_DIR",
    "VLLM_VERSION",
    "CoordinatorOptions",
    "VllmCoordinator",
    "VllmCoordinatorAddresses",
    "VllmUnavailable",
    "cache_dir",
    "coordinator_command",
    "open_vllm_coordinator",
    "prepare_import_root",
    "runner_command",
    "start_vllm_coordinator",
    "vllm_env",
    "wheel_path",
]
