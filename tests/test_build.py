"""The build of the compiled twins (setup.py): it names the kernels the package names,
and where no C compiler runs it leaves the pure-Python package with one INFO line
saying which twins were not built and why (issue 45: "falls back to the twin, with one
INFO line, where the build cannot run")."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from trio_dpcoord._compiled import KERNEL_SOURCES

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_LINE = "trio-dpcoord build:"


def setup_kernel_sources() -> dict[str, str]:
    """setup.py's own ``KERNEL_SOURCES`` (it imports no package, so it keeps a copy)."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "KERNEL_SOURCES"
            for target in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, dict)
            return value
    raise AssertionError("setup.py has no KERNEL_SOURCES")


def test_setup_builds_the_kernels_the_package_names() -> None:
    assert setup_kernel_sources() == KERNEL_SOURCES
    for source in KERNEL_SOURCES.values():
        assert (REPO_ROOT / source).is_file(), source


def test_without_a_compiler_the_build_falls_back_in_one_info_line(tmp_path: Path) -> None:
    """``setup.py build_ext`` with every compiler and linker a failing program: the
    command still succeeds, builds no extension, and writes exactly one line of ours,
    naming every kernel not built."""
    env = dict(os.environ, CC="/bin/false", CXX="/bin/false", LDSHARED="/bin/false")
    env.pop("TRIO_DPCOORD_NO_COMPILE", None)
    result = subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(tmp_path / "lib"),
            "--build-temp",
            str(tmp_path / "temp"),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-2000:]
    ours = [line for line in output.splitlines() if line.startswith(BUILD_LINE)]
    assert len(ours) == 1, output[-2000:]
    line = ours[0]
    assert line.startswith(f"{BUILD_LINE} INFO not built: ")
    assert "the pure-Python modules will run" in line
    for module in KERNEL_SOURCES:
        assert module.rsplit(".", 1)[-1] in line
    assert not list((tmp_path / "lib").rglob("*.so"))
