"""The engine client's utility calls in flight: ``EngineCore.<method>(*args)`` on one
rank, answered by a ``UtilityOutput`` on that rank's output socket (docs/protocol.md
§14).

:class:`UtilityCalls` holds each pending call by its id (the call ids are the request
table's, ``core/_engine_client.py``), hands the answer to the task awaiting it, and
fails the calls of a rank taken as dead, or all of them when the client closes. The
handle, :class:`~.engine_client.EngineClient`, sends the calls and reads the answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import trio

from .._errors import UtilityCallError
from ..core._engine_client import RequestTable
from ..protocol import ProtocolError, decode_utility_output

__all__ = ["PendingCall", "UtilityCalls"]


@dataclass
class PendingCall:
    """One call awaiting its answer: ``done`` is set once ``result`` or ``error`` is."""

    rank: int
    method: str
    done: trio.Event
    result: Any = None
    error: BaseException | None = None


class UtilityCalls:
    """The calls in flight, by call id (see the module docstring)."""

    __slots__ = ("_calls", "_table")

    def __init__(self, table: RequestTable) -> None:
        self._table = table
        self._calls: dict[int, PendingCall] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def ranks(self) -> set[int]:
        """The ranks with a call in flight."""
        return {call.rank for call in self._calls.values()}

    def start(self, rank: int, method: str) -> tuple[int, PendingCall]:
        """A new call of ``method`` on ``rank``: its id (to send) and what to await."""
        call_id = self._table.new_call(rank)
        call = PendingCall(rank, method, trio.Event())
        self._calls[call_id] = call
        return call_id, call

    def end(self, call_id: int) -> None:
        """The awaiting task is done with ``call_id`` (answered or not: cancelled)."""
        if self._calls.pop(call_id, None) is not None:
            self._table.complete_call(call_id)

    def answer(self, rank: int, raw: object) -> str | None:
        """``rank``'s answer to a call (a ``UtilityOutput``, decoded here): the awaiting
        task gets its result, or a :class:`UtilityCallError` with vLLM's message. Returns
        why it was refused (undecodable, no such call pending), else None."""
        try:
            answer = decode_utility_output(raw)
        except ProtocolError as exc:
            return f"rank {rank}: {exc}"
        call = self._calls.pop(answer.call_id, None)
        if call is None:
            return f"rank {rank}: no call {answer.call_id} pending"
        self._table.complete_call(answer.call_id)
        if answer.failure is not None:
            call.error = UtilityCallError(f"{call.method} failed on rank {rank}: {answer.failure}")
        else:
            call.result = answer.result
        call.done.set()
        return None

    def fail(self, call_ids: Iterable[int], error: Callable[[PendingCall], BaseException]) -> None:
        """Fail the calls ``call_ids`` still pending, each with ``error(call)``."""
        for call_id in call_ids:
            call = self._calls.pop(call_id, None)
            if call is not None:
                call.error = error(call)
                call.done.set()

    def fail_all(self, error: Callable[[PendingCall], BaseException]) -> None:
        """Fail every call pending (the client closes), each with ``error(call)``."""
        for call_id in list(self._calls):
            self._table.complete_call(call_id)
        self.fail(list(self._calls), error)
