"""Running Python code in a process whose ``vllm`` is vLLM's real source plus stand-ins."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from ._root import prepare_import_root

RUNNERS_DIR = Path(__file__).resolve().parent / "runners"


def vllm_env(root: Path | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a vLLM process: ``root`` (default: the project's import root)
    first on ``PYTHONPATH``, vLLM's logs on stderr (stdout stays for runner results),
    no usage statistics."""
    if root is None:
        root = prepare_import_root()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.fspath(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env.update(
        {
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


def runner_command(runner: str | Path, *args: str) -> list[str]:
    """``python <runner> args``: a name is a file of ``runners/`` (``"coordinator"``), a
    path is any script. The script must import nothing from ``tests``: it runs in the
    vLLM world, where only the import root and installed packages are importable."""
    path = Path(runner)
    if not path.suffix:
        path = RUNNERS_DIR / f"{runner}.py"
    return [sys.executable, os.fspath(path), *args]
