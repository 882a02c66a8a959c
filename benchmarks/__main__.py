"""``python -m benchmarks``: run the benchmark suite (see ``benchmarks/README.md``)."""

from __future__ import annotations

import sys

from benchmarks.run import main

if __name__ == "__main__":
    sys.exit(main())
