"""``python -m benchmarks report`` (benchmarks/README.md from the latest records) and
``python -m benchmarks plot`` (its pictures)."""
