"""What the sections share: the suite's rows and sizes, the measurements of sections 1-8,
processes and clocks, the wake probe, the front-end tap, and the results on disk."""
