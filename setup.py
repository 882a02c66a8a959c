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
    "trio_dpcoord.routing._prefix_router_kernel": (
        "trio_dpcoord/routing/_prefix_router_kernel.pyx"
    ),
    "trio_dpcoord.routing._chooser_kernel": "trio_dpcoord/routing/_chooser_kernel.pyx",
    "trio_dpcoord.protocol._output_decoder_kernel": (
        "trio_dpcoord/protocol/_output_decoder_kernel.pyx"
    ),
    "trio_dpcoord.trio_zmq._socket_kernel": "trio_dpcoord/trio_zmq/_socket_kernel.pyx",
}

SKIP_ENV = "TRIO_DPCOORD_NO_COMPILE"
"""Set (to anything but "" or "0"): build no compiled twin at all."""


class OptionalBuildExt(build_ext):
    """build_ext whose failure (no compiler, no headers, a compile error) leaves the
    pure-Python package, with one line saying so."""

    failed: bool = False

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # the compiler's errors are of several kinds
            if not self.failed:  # (else told already; the copy of what failed fails too)
                self._fall_back(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self.failed = True
            self._fall_back(exc, ext.name)

    @staticmethod
    def _fall_back(exc: BaseException, name: str = "the compiled twins") -> None:
        logger.info(
            "%s not built (%s: %s): the pure-Python modules will run",
            name,
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
        )


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
