"""``python -m benchmarks report`` (benchmarks/README.md and benchmarks/pages/*.md from the
latest records) and ``python -m benchmarks plot`` (their pictures)."""
