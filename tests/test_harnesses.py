"""The vLLM harnesses (``tests/vllm_real``, ``tests/vllm_reference``) are public fronts:
tests, benchmarks and examples import what their packages export (or their public modules,
such as ``tests.vllm_reference.dp_cluster``), never a private ``_x.py`` module or ``_name``.
The private modules stay free to be reshaped; what the outside uses is in each ``__all__``."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HARNESSES = ("tests.vllm_real", "tests.vllm_reference")
OUTSIDE = ("tests", "benchmarks", "examples")


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.endswith("__") for part in dotted.split("."))


def _harness(module: str) -> str | None:
    return next((h for h in HARNESSES if module == h or module.startswith(h + ".")), None)


def harness_imports(path: Path) -> Iterator[tuple[str, str]]:
    """``(where, dotted name)`` for every absolute import in ``path`` of a harness's module
    or of a name from one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = f"{path.relative_to(REPO)}"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if _harness(node.module):
                for alias in node.names:
                    yield f"{where}:{node.lineno}", f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _harness(alias.name):
                    yield f"{where}:{node.lineno}", alias.name


def outside_files() -> list[Path]:
    """Every Python file of tests, benchmarks and examples outside the harnesses."""
    inside = [REPO / "tests" / h.split(".")[1] for h in HARNESSES]
    return [
        path
        for top in OUTSIDE
        for path in sorted((REPO / top).rglob("*.py"))
        if not any(path.is_relative_to(folder) for folder in inside)
    ]


def test_nothing_outside_a_harness_imports_its_private_parts() -> None:
    uses = [(where, name) for path in outside_files() for where, name in harness_imports(path)]
    assert len({name.split(".")[1] for _, name in uses}) == 2, "the scan saw neither harness"
    private = [f"{where}: {name}" for where, name in uses if _private(name)]
    assert not private, "private harness names imported from outside:\n" + "\n".join(private)


@pytest.mark.parametrize("harness", HARNESSES)
def test_what_the_outside_imports_is_exported(harness: str) -> None:
    """A name taken from the package itself is in its ``__all__`` (the curated front), or
    is one of its public modules (``from tests.vllm_reference import make_vectors``)."""
    folder = REPO / Path(*harness.split("."))
    modules = {path.stem for path in folder.glob("*.py")} | {p.name for p in folder.iterdir()}
    exported = set(importlib.import_module(harness).__all__) | modules
    taken = {
        (where, name.rsplit(".", 1)[1])
        for path in outside_files()
        for where, name in harness_imports(path)
        if name.rsplit(".", 1)[0] == harness
    }
    assert taken, f"nothing outside imports {harness}"
    missing = sorted(f"{where}: {name}" for where, name in taken if name not in exported)
    assert not missing, f"imported from {harness} but not in its __all__:\n" + "\n".join(missing)
