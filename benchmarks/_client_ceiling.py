"""The names ``tests/test_client_ceiling.py`` imports from the benchmarks' old flat layout.

Kept only until that test imports :mod:`benchmarks.sections.client_ceiling_profile`
itself (the benchmarks now live in rooms: ``benchmarks/README.md``); nothing else uses it.
"""

from benchmarks.sections.client_ceiling_profile import SCHEDULER, STARTUP, breakdown

__all__ = ["SCHEDULER", "STARTUP", "breakdown"]
