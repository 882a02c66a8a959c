"""The library's exceptions: what a caller of the public API may have to catch."""

from __future__ import annotations

__all__ = [
    "CoordinatorClosedError",
    "CoordinatorError",
    "EngineClientClosedError",
    "EngineClientError",
    "EngineDeadError",
    "EngineStartupError",
    "ReadyTimeoutError",
    "RequestAbortedError",
    "UtilityCallError",
]


class CoordinatorError(Exception):
    """The coordinator could not start, or a task inside it failed.

    A failure inside the service's tasks comes out of ``open_coordinator`` as this
    exception, with the original exception group as its ``__cause__``.
    """


class ReadyTimeoutError(CoordinatorError, TimeoutError):
    """The start-up gate did not open in time: too few engines subscribed."""


class CoordinatorClosedError(CoordinatorError):
    """The coordinator has stopped; its handle can no longer be used."""


class EngineClientError(Exception):
    """The engine client's one exception: start-up, a dead engine, an aborted request.

    A failure inside the client's own tasks comes out of ``open_engine_client`` as this
    exception, with the original exception group as its ``__cause__``.
    """


class EngineStartupError(EngineClientError):
    """Engines did not complete vLLM's handshake (in time, or consistently).

    ``missing`` holds the ranks that never said READY (empty when the cause is another)."""

    def __init__(self, message: str, missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing: list[int] = list(missing or [])


class EngineDeadError(EngineClientError):
    """The engine ``engine_index`` (its DP rank) died or went silent: its requests and
    calls failed."""

    def __init__(self, engine_index: int, reason: str) -> None:
        super().__init__(f"engine rank {engine_index} is gone ({reason})")
        self.engine_index = engine_index
        self.reason = reason


class RequestAbortedError(EngineClientError):
    """A request was aborted before it finished (the caller fell behind, or the client
    closed), so its stream ends without a finish reason."""


class UtilityCallError(EngineClientError):
    """An engine answered a utility call with a failure (vLLM's message)."""


class EngineClientClosedError(EngineClientError):
    """The engine client has stopped; its handle can no longer be used."""
