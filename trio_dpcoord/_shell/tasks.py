"""What the service handles share: the nursery that runs their tasks, and rejection logs.

Both public entry points (``open_coordinator``, ``open_frontend``) yield a handle while
a nursery runs background tasks. :func:`open_task_nursery` is that nursery, with the
error contract they promise: the block's own exception comes out unchanged, a failure
of a background task comes out as one library exception (not a raw ExceptionGroup of
internals), cancellation passes through.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Final

import trio

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["RejectLog", "cancel_at_stdin_eof", "open_task_nursery"]


def _cancelled(exc: BaseException) -> bool:
    return isinstance(exc, trio.Cancelled)


@asynccontextmanager
async def open_task_nursery(
    *,
    on_exit: Callable[[], None],
    failure: Callable[[BaseExceptionGroup[BaseException]], BaseException],
) -> AsyncIterator[trio.Nursery]:
    """A nursery for a handle's background tasks, cancelled when the block ends.

    ``on_exit`` runs first when the block ends (however it ends), so the handle refuses
    further use before its tasks stop. If background tasks failed, ``failure(group)``
    builds the exception to raise (chained to the group); the block's own exception,
    if that is all there is, propagates as it was raised.
    """
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                yield nursery
            except BaseException as exc:
                body_error = exc
                raise
            finally:
                on_exit()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if group.split(_cancelled)[1] is None:
            raise
        internal = group.split(lambda e: e is body_error or _cancelled(e))[1]
        if internal is not None:
            raise failure(internal) from internal
    if body_error is not None:
        # The block's own exception, unwrapped from the nursery's group.
        raise body_error


class RejectLog:
    """Logs rejected inputs at WARNING, rate-limited per reason (the caller counts them:
    the coordinator's core, the front-end's ``rejected()``)."""

    INTERVAL: Final = 5.0

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._last_logged: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def __call__(self, reason: str, detail: str) -> None:
        now = time.monotonic()
        if now - self._last_logged.get(reason, -math.inf) >= self.INTERVAL:
            suppressed = self._suppressed.pop(reason, 0)
            more = f" ({suppressed} more since last report)" if suppressed else ""
            self._logger.warning("rejected input [%s]: %s%s", reason, detail, more)
            self._last_logged[reason] = now
        else:
            self._suppressed[reason] += 1


async def cancel_at_stdin_eof(scope: trio.CancelScope, logger: logging.Logger) -> None:
    """Cancel ``scope`` when stdin reaches end of file: the parent holding its other end
    has gone (even by SIGKILL), so a child process must not outlive it as an orphan."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stdin:
        while await stdin.receive_some(4096):
            pass
    logger.info("standard input closed: stopping (the parent is gone)")
    scope.cancel()
