"""What a caller of :meth:`~trio_dpcoord.EngineClient.generate` holds: the request's
stream of outputs, each :class:`RequestOutput`, the :class:`Completion` it ends with, and
the client's :class:`EngineClientStatistics`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, final

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
    rank: int


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
    """

    def __init__(
        self,
        client: StreamOwner,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        rank: int | None,
        priority: int,
        buffer: int,
    ) -> None:
        self._client = client
        self.request_id = request_id
        self._prompt = list(prompt_token_ids)
        self._params = params
        self._pinned = rank
        self._priority = priority
        self.rank: int | None = None
        """The DP rank the request went to (set once entered)."""
        self._send, self._receive = trio.open_memory_channel[RequestOutput](buffer)
        self._error: BaseException | None = None
        self._entered = False
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
        self._receive.close()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._entered:
            raise RuntimeError("enter the stream (async with) before reading it")
        try:
            output = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            if self._error is not None:
                raise self._error from None
            raise StopAsyncIteration from None
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
        return output

    # called by the client's tasks (never block)
    def _deliver(self, output: RequestOutput) -> bool:
        """Queue one output; False when the reader is ``buffer`` outputs behind."""
        try:
            self._send.send_nowait(output)
        except trio.WouldBlock:
            return False
        except trio.BrokenResourceError:  # the reader left; the release aborts it
            return True
        if output.finished:
            self._send.close()
        return True

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._send.close()


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
    dead_ranks: frozenset[int]
    requests_sent: int
    requests_aborted: int
    rejected: dict[str, int]
    """Inputs from the engines refused (bad frames, unknown call ids...), by reason;
    each was logged at WARNING (rate-limited) and dropped."""
