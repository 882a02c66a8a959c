"""What the service handles share: the nursery that runs their tasks.

Both public entry points (``open_coordinator``, ``open_frontend``) yield a handle while
a nursery runs background tasks. :func:`open_task_nursery` is that nursery, with the
error contract they promise: the block's own exception comes out unchanged, a failure
of a background task comes out as one library exception (not a raw ExceptionGroup of
internals), cancellation passes through.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["open_task_nursery"]


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
