"""What the plugin's asyncio tasks in vLLM's loop share (the KV-event follower of
:mod:`._routing`, the shared routes of :mod:`._peers`): a ``zmq.asyncio`` view of vLLM's
ZeroMQ context, a cancel that works from any thread, and a count tests can wait on.

zmq is imported inside the functions: the plugin is imported by every vLLM process, and
only API servers that opted in need it.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Tally", "asyncio_context", "cancel_from_any_thread"]


def asyncio_context(context: Any) -> Any:
    """``context`` as a ``zmq.asyncio.Context`` (a shadow of it if it is a plain one, as
    vLLM's async client holds its context either way)."""
    import zmq.asyncio

    return context if isinstance(context, zmq.asyncio.Context) else zmq.asyncio.Context(context)


def cancel_from_any_thread(task: asyncio.Task[None]) -> None:
    """Cancel ``task``, directly in its own loop, else through that loop's thread-safe
    call (vLLM may shut a client down from another thread); nothing if the loop closed."""
    loop = task.get_loop()
    if loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        task.cancel()
    else:
        loop.call_soon_threadsafe(task.cancel)


class Tally:
    """A count that only goes up, which a task of the same loop can wait to reach."""

    def __init__(self) -> None:
        self.value = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def add(self) -> None:
        """One more; wakes the waits it reaches."""
        self.value += 1
        if not self._waiters:
            return
        ready = [future for count, future in self._waiters if count <= self.value]
        self._waiters = [(c, f) for c, f in self._waiters if c > self.value]
        for future in ready:
            if not future.done():
                future.set_result(None)

    async def reached(self, count: int) -> None:
        """Return once the count is at least ``count``."""
        if self.value >= count:
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((count, future))
        await future
