"""One-off entry points for investigations (``python -m benchmarks.tools.NAME``): several
front-ends on the model, checkouts against each other on the fleet, where a decision's time
goes. Their figures are not part of a suite run."""
