"""A pytest plugin measuring how long trio's event loops went without looking at the
clock, test by test: ``python -m pytest -p tests.shell.scripts.loop_silence ...``.

A task due to run at some time (the supervised worker's heartbeat, a timer) waits at
least as long as the batch of task steps running when that time comes: trio checks its
deadlines only between batches (after each I/O wait). So the longest batch, from
``after_io_wait`` to the next ``before_io_wait`` on the real clock, is the longest
silence a heartbeat in that loop could have shown. Measured in every ``trio.run`` of the
test process (pytest-trio's included: ``trio.run`` is wrapped with an instrument); the
ten longest, with their tests, are written to the file ``LOOP_SILENCE_OUT`` names (else
only printed in the terminal summary). It measures; it asserts nothing.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import pytest
import trio

_longest: dict[str, float] = {}
_current = ["(outside a test)"]


class _LongestBatch(trio.abc.Instrument):
    def __init__(self) -> None:
        self.woke: float | None = None

    def after_io_wait(self, timeout: float) -> None:
        self.woke = time.perf_counter()

    def before_io_wait(self, timeout: float) -> None:
        if self.woke is not None:
            batch = time.perf_counter() - self.woke
            name = _current[0]
            if batch > _longest.get(name, 0.0):
                _longest[name] = batch


def pytest_configure(config: pytest.Config) -> None:
    original = trio.run

    @functools.wraps(original)
    def run(*args: Any, instruments: Any = (), **kwargs: Any) -> Any:
        return original(*args, instruments=[*instruments, _LongestBatch()], **kwargs)

    trio.run = run  # type: ignore[assignment]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    _current[0] = item.nodeid
    try:
        return (yield)
    finally:
        _current[0] = "(outside a test)"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    top = sorted(_longest.items(), key=lambda pair: -pair[1])[:10]
    terminalreporter.write_line("longest trio loop batches (seconds):")
    for name, seconds in top:
        terminalreporter.write_line(f"  {seconds:8.3f}  {name}")
    target = os.environ.get("LOOP_SILENCE_OUT")
    if target:
        with open(target, "w") as out:
            json.dump({"tests": len(_longest), "longest": top}, out, indent=1)
