"""The library's exceptions: what a caller of the public API may have to catch."""

from __future__ import annotations

__all__ = ["CoordinatorClosedError", "CoordinatorError", "ReadyTimeoutError"]


class CoordinatorError(Exception):
    """The coordinator could not start, or a task inside it failed.

    A failure inside the service's tasks comes out of ``open_coordinator`` as this
    exception, with the original exception group as its ``__cause__``.
    """


class ReadyTimeoutError(CoordinatorError, TimeoutError):
    """The start-up gate did not open in time: too few engines subscribed."""


class CoordinatorClosedError(CoordinatorError):
    """The coordinator has stopped; its handle can no longer be used."""
