"""Benchmarks of trio_dpcoord, each figure next to a baseline measured in the same run.

Run from the repository root: ``python -m benchmarks [--quick] [--json PATH]``.
See ``benchmarks/README.md`` for what each figure means and how it is measured.
"""
