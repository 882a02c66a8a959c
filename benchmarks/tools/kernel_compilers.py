"""Two ways to compile the prompt's block keys, on one benchmark:
``python -m benchmarks.tools.kernel_compilers`` (issue 45: "measure at least two ways to
compile the decision kernel and say why you chose").

The same keys of 4,096-token prompts (256 blocks of 16 tokens), three builds alternated
in one process, best and median of 7 passes of 2,000 calls:

- ``pure``: ``block_keys`` of ``trio_dpcoord/routing/_keys.py`` from its source (the
  pure twin: ``zip`` groups the tokens, ``map(hash, ...)``, ``accumulate(xor)``, all
  C-level bulk calls already);
- ``cython``: the package's kernel (``routing/_keys_kernel.pyx``), CPython's tuple hash
  computed over the list in place, no tuple built per block;
- ``mypyc``: the same keys as an explicit typed loop (what mypyc compiles; it cannot
  compile the bulk idiom any better than CPython runs it), built here into a temporary
  directory with the ``mypyc`` of the dev install (about 20 s).

All three must give equal keys (checked first). Why Cython (docs/design.md): mypyc
compiles Python-level loops and calls, but a tuple must still be built and hashed per
block, which is what costs; Cython reaches CPython's objects in place.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

MYPYC_SOURCE = textwrap.dedent(
    """
    from typing import List


    def block_keys(
        token_ids: List[int], block_size: int, salts: List[int], parent: int = 0, depth: int = 0
    ) -> List[int]:
        blocks = len(token_ids) // block_size
        out: List[int] = []
        key = parent
        at = 0
        for block in range(blocks):
            key ^= hash(tuple(token_ids[at : at + block_size]) + (salts[depth + block],))
            out.append(key)
            at += block_size
        return out
    """
)

TOKENS = 4096
BLOCK = 16
CALLS = 2000
PASSES = 7


def build_mypyc(directory: Path) -> Callable[[list[int], int, list[int]], list[int]]:
    source = directory / "keys_mypyc.py"
    source.write_text(MYPYC_SOURCE)
    mypyc = shutil.which("mypyc")
    if mypyc is None:
        raise SystemExit("mypyc not found (pip install -e '.[dev]' installs mypy with it)")
    subprocess.run([mypyc, source.name], cwd=directory, check=True, capture_output=True)
    sys.path.insert(0, str(directory))
    import keys_mypyc  # type: ignore[import-not-found]

    return keys_mypyc.block_keys  # type: ignore[no-any-return]


def main() -> None:
    from tests.pure_twin import package_module
    from tests.routing.pure_twin import hot_path

    pure = hot_path(True).block_keys
    compiled = hot_path(False).block_keys
    salts = package_module("routing._keys")._salts(TOKENS)
    rng = random.Random(45)
    prompts = [[rng.getrandbits(15) for _ in range(TOKENS)] for _ in range(50)]
    with tempfile.TemporaryDirectory(prefix="mypyc-keys-") as directory:
        mypyc_keys = build_mypyc(Path(directory))
        builds: dict[str, Callable[[list[int]], list[int]]] = {
            "pure": lambda p: pure(p, BLOCK),
            "cython": lambda p: compiled(p, BLOCK),
            "mypyc": lambda p: mypyc_keys(p, BLOCK, salts),
        }
        for prompt in prompts[:5]:
            keys = {name: build(prompt) for name, build in builds.items()}
            assert len({tuple(k) for k in keys.values()}) == 1, "the builds differ"
        passes: dict[str, list[float]] = {name: [] for name in builds}
        for _ in range(PASSES):
            for name, build in builds.items():
                start = time.perf_counter()
                for call in range(CALLS):
                    build(prompts[call % len(prompts)])
                passes[name].append((time.perf_counter() - start) / CALLS * 1e6)
    print(f"block keys of a {TOKENS:,}-token prompt, us per call (load {os.getloadavg()[0]:.1f})")
    for name, times in passes.items():
        times.sort()
        print(f"  {name:7s} best {times[0]:7.1f}  median {times[PASSES // 2]:7.1f}")


if __name__ == "__main__":
    main()
