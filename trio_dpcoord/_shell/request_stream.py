"""What a caller of :meth:`~trio_dpcoord.EngineClient.generate` holds: the request's
stream of outputs, each :class:`RequestOutput`, the :class:`Completion` it ends with, and
the client's :class:`EngineClientStatistics`."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, final

import trio

from ..protocol import (
    SamplingParams,
)

__all__ = ["Completion", "EngineClientStatistics", "RequestOutput", "RequestStream"]


class StreamOwner(Protocol):
    """What a stream needs of the client that made it: to send its request when the
    block is entered and to take it back (abort or forget it) when the block is left. A
    protocol, so that this module does not import the client that imports it."""

    def _add(self, stream: RequestStream) -> None: ...

    def _release(self, stream: RequestStream) -> None: ...


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One step's output of one request: its new token ids, and once it ends the
    finish reason (vLLM's words: ``stop``, ``length``, ``abort``, ``error``,
    ``repetition``) and stop reason (a stop token id or string, if one ended it)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole request's token ids and finish reason (:meth:`EngineClient.complete`)."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str
    engine_index: int


_new = object.__new__
_output_slots = tuple(getattr(RequestOutput, f).__set__ for f in RequestOutput.__slots__)


def _request_output(
    request_id: str,
    new_token_ids: tuple[int, ...],
    finish_reason: str | None,
    _s: tuple[Any, ...] = _output_slots,
) -> RequestOutput:
    """``RequestOutput(request_id, new_token_ids, finish_reason)``, built the way the
    protocol's hot-path constructors are (one per token: a frozen dataclass's
    ``__init__`` goes through ``object.__setattr__`` per field, twice the cost)."""
    output = _new(RequestOutput)
    _s[0](output, request_id)
    _s[1](output, new_token_ids)
    _s[2](output, finish_reason)
    _s[3](output, None)
    return output


@final
class RequestStream:
    """One request's outputs, as an async iterator; enter it to send the request.

    ``async with client.generate(prompt, params) as stream: async for out in stream:``.
    The request goes to the engine when the block is entered; leaving the block before
    the request finished (a ``break``, an error, a cancellation) aborts it on the engine.
    Iteration ends after the output that carries the finish reason; it raises
    :class:`EngineDeadError` if the engine goes, :class:`RequestAbortedError` if the
    request was aborted under it (the caller fell ``buffer`` outputs behind, or the client
    closed).

    Reading is a cancellation point; it waits (a schedule point) only when no output is
    waiting: outputs that arrived together are read without a task switch each.
    """

    def __init__(
        self,
        client: StreamOwner,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        engine_index: int | None,
        priority: int,
        buffer: int,
    ) -> None:
        self._client = client
        self.request_id = request_id
        self._prompt = list(prompt_token_ids)
        self._params = params
        self._pinned = engine_index
        self._priority = priority
        self.engine_index: int | None = None
        """The engine (DP rank) the request went to (set once entered)."""
        self._buffer: deque[RequestOutput] = deque()
        self._capacity = buffer
        self._reader: trio.lowlevel.Task | None = None
        """The task waiting in :meth:`__anext__`, if one is."""
        self._handed = 0
        """1 while the output that woke the reader waits for it to run: handed over, not
        buffered (as a memory channel counts it)."""
        self._ended = False
        """No output comes after those buffered (the last one came, or a failure)."""
        self._left = False
        self._error: BaseException | None = None
        self._entered = False
        self._collected: list[int] | None = None
        """:meth:`EngineClient.complete`'s token ids: kept here as they come, no output
        objects, no wake-up before the end."""
        self.finish_reason: str | None = None

    async def __aenter__(self) -> RequestStream:
        if self._entered:
            raise RuntimeError("a RequestStream can be entered once")
        self._entered = True
        self._client._add(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._client._release(self)
        self._left = True
        self._buffer.clear()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._entered:
            raise RuntimeError("enter the stream (async with) before reading it")
        buffer = self._buffer
        if buffer and not self._left:
            await trio.lowlevel.checkpoint_if_cancelled()  # waiting below is one too
        while not buffer or self._left:
            if self._ended or self._left:
                if self._error is not None:
                    raise self._error from None
                raise StopAsyncIteration
            self._reader = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._stop_waiting)
            self._handed = 0
        output = buffer.popleft()
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
        return output

    async def rest(self) -> tuple[int, ...]:
        """The token ids of every output not read yet, once the request has ended: the
        task wakes once, at the end, however many outputs come (they are gathered as
        they arrive, no output object each). Read the first outputs with ``async for``
        or ``anext`` (time to first token), then the rest with this: two wake-ups a
        request, as a front-end that waits for the first token and the end has.

        Afterwards :attr:`finish_reason` is set and the stream yields nothing more;
        raises as iteration does (:class:`EngineDeadError`, :class:`RequestAbortedError`).
        Taken once: a cancelled call loses what it gathered (the request runs on until
        the block is left).
        """
        if not self._entered:
            raise RuntimeError("enter the stream (async with) before reading it")
        if self._collected is not None:
            raise RuntimeError("the rest of a stream can be taken once")
        tokens: list[int] = []
        for output in self._buffer:  # arrived unread: theirs come first, in order
            tokens += output.new_token_ids
            if output.finish_reason is not None:
                self.finish_reason = output.finish_reason
        self._buffer.clear()
        self._handed = 0
        self._collected = tokens
        await self._until_ended()
        return tuple(tokens)

    async def _until_ended(self) -> None:
        """:meth:`rest`'s wait: until the last output came (its tokens in
        ``_collected``), or the failure, raised."""
        if self._ended or self._left:
            await trio.lowlevel.checkpoint()
        while not self._ended and not self._left:
            self._reader = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._stop_waiting)
        if self._error is not None:
            raise self._error from None

    def _stop_waiting(self, raise_cancel: object) -> trio.lowlevel.Abort:
        self._reader = None
        return trio.lowlevel.Abort.SUCCEEDED

    # called by the client's tasks (never block)
    def _push(self, new_token_ids: tuple[int, ...], finish_reason: str | None) -> bool:
        """One step's output; False when the reader is ``buffer`` outputs behind."""
        if self._left or self._ended:  # the reader left: the release aborts it
            return True
        collected = self._collected
        if collected is not None:
            collected += new_token_ids
            if finish_reason is None:
                return True
            self.finish_reason = finish_reason
            self._ended = True
            reader = self._reader
            if reader is not None:
                self._reader = None
                trio.lowlevel.reschedule(reader)
            return True
        buffer = self._buffer
        if len(buffer) - self._handed >= self._capacity:
            return False
        buffer.append(_request_output(self.request_id, new_token_ids, finish_reason))
        if finish_reason is not None:
            self._ended = True
        reader = self._reader
        if reader is not None:
            self._reader = None
            self._handed = 1
            trio.lowlevel.reschedule(reader)
        return True

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._ended = True
        reader = self._reader
        if reader is not None:
            self._reader = None
            trio.lowlevel.reschedule(reader)


@dataclass(frozen=True, slots=True)
class EngineClientStatistics:
    """What :meth:`EngineClient.statistics` reads: the client's live bookkeeping (all
    zero once the work is done, which is how a test or a health check sees that nothing
    leaked) and its running totals."""

    requests_in_flight: int
    """Requests sent and not finished, aborted or failed yet."""
    streams_open: int
    """Request streams the client still delivers outputs to."""
    calls_pending: int
    """Utility calls sent and not answered yet."""
    dead_engines: frozenset[int]
    requests_sent: int
    requests_aborted: int
    rejected: dict[str, int]
    """Inputs from the engines refused (bad frames, unknown call ids...), by reason;
    each was logged at WARNING (rate-limited) and dropped."""
