"""Build the compiled twins of the hot path (``trio_dpcoord._compiled.KERNEL_SOURCES``),
or none, with one line, where they cannot be built: the package is whole without them.

Everything else about the package is in pyproject.toml. Why setuptools: its build_ext
builds C extensions with the platform's compiler, in place for ``pip install -e .``,
and a build command can catch a failed compile and go on, which keeps the pure-Python
install where there is no compiler (hatchling has no extension builder of its own).
"""

from __future__ import annotations

import logging
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

logger = logging.getLogger("trio_dpcoord.build")
logger.setLevel(logging.INFO)
logger.propagate = False  # our one line, not setuptools' own log
_handler = logging.StreamHandler()
_handler.setFormatter(logging.Formatter("trio-dpcoord build: %(levelname)s %(message)s"))
logger.addHandler(_handler)

KERNEL_SOURCES = {  # as trio_dpcoord/_compiled.py names them (setup.py imports no package)
    "trio_dpcoord.routing._keys_kernel": "trio_dpcoord/routing/_keys_kernel.pyx",
    "trio_dpcoord.routing._prefix_index_kernel": "trio_dpcoord/routing/_prefix_index_kernel.pyx",
    "trio_dpcoord.routing._walk_kernel": "trio_dpcoord/routing/_walk_kernel.pyx",
    "trio_dpcoord.protocol._output_decoder_kernel": (
        "trio_dpcoord/protocol/_output_decoder_kernel.pyx"
    ),
    "trio_dpcoord.trio_zmq._socket_kernel": "trio_dpcoord/trio_zmq/_socket_kernel.pyx",
}

SKIP_ENV = "TRIO_DPCOORD_NO_COMPILE"
"""Set (to anything but "" or "0"): build no compiled twin at all."""


class OptionalBuildExt(build_ext):
    """build_ext whose failure (no compiler, no headers, a compile error) leaves the
    pure-Python package, with one line in all saying which twins were not built and why
    (the first error: with no compiler, every kernel fails the same way)."""

    def run(self) -> None:
        self.not_built: list[str] = []
        self.first_error: BaseException | None = None
        try:
            super().run()
        except Exception as exc:  # the compiler's errors are of several kinds
            # (the copy of what failed, for an in-place build, fails too: told already)
            self._failed(exc)
        if self.first_error is not None:
            names = ", ".join(self.not_built) or "the compiled twins"
            error = self.first_error
            last = str(error).strip().splitlines()[-1] if str(error).strip() else ""
            logger.info(
                "not built: %s (%s: %s): the pure-Python modules will run",
                names,
                type(error).__name__,
                last,
            )

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._failed(exc, ext.name.rsplit(".", 1)[-1])

    def _failed(self, exc: BaseException, name: str | None = None) -> None:
        if self.first_error is None:
            self.first_error = exc
        if name is not None:
            self.not_built.append(name)


def _extensions() -> list[Extension]:
    if os.environ.get(SKIP_ENV, "").strip() not in ("", "0"):
        logger.info("%s is set: no compiled twin built, the pure-Python modules will run", SKIP_ENV)
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        logger.info("Cython is not installed: the pure-Python modules will run")
        return []
    extensions = [Extension(name, [source]) for name, source in KERNEL_SOURCES.items()]
    try:
        # The generated C goes to build/, never next to the sources (git-ignored anyway).
        return list(
            cythonize(
                extensions,
                build_dir="build/cython",
                compiler_directives={"language_level": 3},
                quiet=True,
            )
        )
    except Exception as exc:  # Cython's own compile error
        logger.info("Cython failed (%s): the pure-Python modules will run", exc)
        return []


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
