"""The lock-step collective of simulated DP ranks, for real, between processes.

MoE DP ranks run every forward pass as a collective (all-to-all plus a token-count
all-reduce) and every ``dp_sync_interval`` steps an all-reduce of
``[has_unfinished, pending_pause]`` (PROTOCOL.md §6.5). A rank that is asleep while its
peers step makes them block: exactly the failure a wave coordinator must prevent. To
reproduce it, the simulation runs one rendezvous per step over ZeroMQ:

* DP rank 0's process hosts a ROUTER (:class:`CollectiveHost`, a task independent of
  rank 0's engine loop, so it keeps serving while rank 0's engine sleeps);
* every rank, rank 0 included, has a DEALER with identity = rank (2 bytes little-endian)
  (:class:`CollectiveClient`) and sends one contribution per step:
  msgpack ``[seq, wave, step, has_unfinished, pending_pause]``;
* once every rank contributed to ``seq`` the host answers each with the sums
  ``[seq, sum_unfinished, sum_pending_pause]`` (the SUM all-reduce; non-sync steps simply
  ignore it);
* if some rank has not arrived ``timeout`` seconds after the first contribution to
  ``seq``, the host logs an error and answers the ranks that did arrive with
  ``[seq, None, missing_ranks, wave, step]``; they raise :class:`CollectiveTimeoutError`
  naming the ranks that never arrived. The group is then broken for good: any later
  contribution gets the same failure answer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import trio

from ..trio_zmq import AsyncSocket

__all__ = [
    "AllReduceResult",
    "CollectiveClient",
    "CollectiveHost",
    "CollectiveTimeoutError",
    "rank_identity",
]

logger = logging.getLogger(__name__)


def rank_identity(rank: int) -> bytes:
    """A DP rank's ZeroMQ identity, as vLLM engines set it: 2 bytes little-endian."""
    return rank.to_bytes(2, "little")


class CollectiveTimeoutError(Exception):
    """A collective step did not complete: some ranks never arrived (or the host vanished).

    ``missing`` lists the ranks that never arrived (empty when the host did not answer).
    """

    def __init__(self, message: str, *, wave: int, step: int, missing: tuple[int, ...]) -> None:
        super().__init__(message)
        self.wave = wave
        self.step = step
        self.missing = missing


@dataclass(frozen=True, slots=True)
class AllReduceResult:
    """The SUM over all ranks of ``[has_unfinished, pending_pause]`` for one step."""

    unfinished: int
    pending_pause: int


def _timeout_message(wave: int, step: int, missing: tuple[int, ...], timeout: float) -> str:
    return (
        f"collective timeout at wave {wave} step {step}: ranks {list(missing)} never arrived "
        f"(waited {timeout:g} s)"
    )


@dataclass(slots=True)
class _Round:
    started: float
    arrivals: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)


class CollectiveHost:
    """The rendezvous every rank meets at, on each step; runs in DP rank 0's process."""

    def __init__(self, socket: AsyncSocket, rank_count: int, *, timeout: float) -> None:
        if rank_count < 1:
            raise ValueError("rank_count must be >= 1")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self._socket = socket
        self._rank_count = rank_count
        self._timeout = timeout
        self._rounds: dict[int, _Round] = {}
        self.failure: CollectiveTimeoutError | None = None
        self.completed_rounds = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve rounds forever (until cancelled)."""
        task_status.started()
        while True:
            deadline = min(
                (r.started + self._timeout for r in self._rounds.values()), default=math.inf
            )
            frames: list[bytes] | None = None
            with trio.move_on_at(deadline):
                frames = await self._socket.recv_multipart()
            if frames is None:
                await self._expire(trio.current_time())
            else:
                await self._handle(frames)

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or len(frames[0]) != 2:
            logger.warning(
                "collective host: dropping a malformed message of %d frames", len(frames)
            )
            return
        rank = int.from_bytes(frames[0], "little")
        try:
            seq, wave, step, unfinished, pause = msgpack.unpackb(frames[1])
            if not all(type(v) is int for v in (seq, wave, step, unfinished, pause)):
                raise TypeError("non-int field")
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            logger.warning(
                "collective host: dropping an undecodable contribution from rank %d (%s)", rank, exc
            )
            return
        if not 0 <= rank < self._rank_count:
            logger.warning(
                "collective host: contribution from unknown rank %d at wave %d", rank, wave
            )
            return
        if self.failure is not None:
            await self._reply(
                rank, [seq, None, list(self.failure.missing), self.failure.wave, self.failure.step]
            )
            return
        rnd = self._rounds.get(seq)
        if rnd is None:
            rnd = self._rounds[seq] = _Round(trio.current_time())
        if rank in rnd.arrivals:
            logger.warning(
                "collective host: rank %d contributed twice to round %d (wave %d)", rank, seq, wave
            )
            return
        rnd.arrivals[rank] = (wave, step, unfinished, pause)
        if len(rnd.arrivals) < self._rank_count:
            return
        del self._rounds[seq]
        positions = {(w, s) for w, s, _, _ in rnd.arrivals.values()}
        if len(positions) > 1:
            logger.warning(
                "collective round %d: ranks disagree on (wave, step): %s", seq, sorted(positions)
            )
        sum_unfinished = sum(a[2] for a in rnd.arrivals.values())
        sum_pause = sum(a[3] for a in rnd.arrivals.values())
        self.completed_rounds += 1
        reply = [seq, sum_unfinished, sum_pause]
        for peer in sorted(rnd.arrivals):
            await self._reply(peer, reply)

    async def _expire(self, now: float) -> None:
        for seq, rnd in sorted(self._rounds.items()):
            if rnd.started + self._timeout > now:
                continue
            del self._rounds[seq]
            missing = tuple(r for r in range(self._rank_count) if r not in rnd.arrivals)
            wave = max(a[0] for a in rnd.arrivals.values())
            step = max(a[1] for a in rnd.arrivals.values())
            message = _timeout_message(wave, step, missing, self._timeout)
            logger.error("%s; ranks %s are blocked", message, sorted(rnd.arrivals))
            if self.failure is None:
                self.failure = CollectiveTimeoutError(
                    message, wave=wave, step=step, missing=missing
                )
            for peer in sorted(rnd.arrivals):
                await self._reply(peer, [seq, None, list(missing), wave, step])

    async def _reply(self, rank: int, payload: list[Any]) -> None:
        await self._socket.send_multipart([rank_identity(rank), msgpack.packb(payload)])


class CollectiveClient:
    """One rank's side of the per-step rendezvous (a DEALER connected to the host)."""

    def __init__(self, socket: AsyncSocket, rank: int, *, timeout: float) -> None:
        self._socket = socket
        self._rank = rank
        self._timeout = timeout
        self._seq = 0

    async def step(
        self, *, wave: int, step: int, has_unfinished: bool, pending_pause: bool
    ) -> AllReduceResult:
        """Contribute this rank's step and wait until every rank did; raise on timeout."""
        seq = self._seq
        self._seq += 1
        await self._socket.send(
            msgpack.packb([seq, wave, step, int(has_unfinished), int(pending_pause)])
        )
        # The host answers within its own timeout of the first arrival; allow it that much
        # again before blaming the host itself.
        limit = 2 * self._timeout + 1.0
        with trio.move_on_after(limit):
            while True:
                reply = msgpack.unpackb(await self._socket.recv())
                if not isinstance(reply, list) or len(reply) < 3 or reply[0] != seq:
                    logger.warning(
                        "rank %d: unexpected collective reply %r at wave %d step %d",
                        self._rank,
                        reply,
                        wave,
                        step,
                    )
                    continue
                if reply[1] is None:
                    missing = tuple(int(r) for r in reply[2])
                    host_wave = int(reply[3]) if len(reply) > 3 else wave
                    host_step = int(reply[4]) if len(reply) > 4 else step
                    raise CollectiveTimeoutError(
                        _timeout_message(host_wave, host_step, missing, self._timeout),
                        wave=host_wave,
                        step=host_step,
                        missing=missing,
                    )
                return AllReduceResult(int(reply[1]), int(reply[2]))
        raise CollectiveTimeoutError(
            f"collective timeout at wave {wave} step {step}: no answer from the collective "
            f"host (DP rank 0's process) within {limit:g} s",
            wave=wave,
            step=step,
            missing=(),
        )
