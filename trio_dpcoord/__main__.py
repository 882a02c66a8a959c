"""``python -m trio_dpcoord serve ...``: the standalone coordinator, see :mod:`.cli`."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
