"""The lock-step collective of simulated DP ranks, for real, between processes.

Its messages are this simulation's own protocol (vLLM's ranks meet in torch.distributed
collectives, not over ZeroMQ), so they are written and read here, not in
:mod:`trio_dpcoord.protocol`; only the ranks' identities are vLLM's
(:func:`~trio_dpcoord.protocol.engine_identity`).

MoE DP ranks run every forward pass as a collective (all-to-all plus a token-count
all-reduce) and every ``dp_sync_interval`` steps an all-reduce of
``[has_unfinished, pending_pause]`` (docs/protocol.md §6.5). A rank that is asleep while its
peers step makes them block: exactly the failure a wave coordinator must prevent. To
reproduce it, the simulation runs one rendezvous per step over ZeroMQ:

* DP rank 0's process hosts a ROUTER (:class:`CollectiveHost`, a task independent of
  rank 0's engine loop, so it keeps serving while rank 0's engine sleeps);
* every rank, rank 0 included, has a DEALER with identity = rank (2 bytes little-endian)
  (:class:`CollectiveClient`) and sends one contribution per step:
  msgpack ``[wave, step, has_unfinished, pending_pause, incarnation]``;
* a round is keyed by the group position ``(wave, step)``, which every rank of a healthy
  group agrees on (waves start and end on the same collective step everywhere). So a rank
  restarted at a wave boundary, which adopts the group's wave from START_DP_WAVE or a
  stamped request (docs/protocol.md §6.3/§6.4), meets its peers in the same rounds;
* once every rank contributed to ``(wave, step)`` the host answers each with the sums
  ``[wave, step, sum_unfinished, sum_pending_pause]`` (the SUM all-reduce; non-sync steps
  simply ignore it); a client accepts only the answer to its own ``(wave, step)``;
* ``incarnation`` is a random number per client object (per process): a rank that
  contributes with a new incarnation was restarted, so the contributions of its dead
  predecessor to rounds still open are stale and dropped (the new one replaces them, and a
  round left with only stale contributions does not time out). The same incarnation
  contributing twice to one round is a duplicate: logged and dropped;
* if some rank has not arrived ``timeout`` seconds after the first contribution to a
  round, the host logs an error and answers the ranks that did arrive with
  ``[wave, step, None, missing_ranks, wave, step]``; they raise
  :class:`CollectiveTimeoutError` naming the ranks that never arrived. The group is then
  broken for good: any later contribution gets the same failure answer (a rank that dies
  mid-wave leaves its peers blocked in a round it never reaches, as a real DP group dies
  with a member).
"""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

import msgpack
import trio

from ..protocol import engine_identity
from ..trio_zmq import AsyncSocket

__all__ = [
    "AllReduceResult",
    "CollectiveClient",
    "CollectiveHost",
    "CollectiveTimeoutError",
]

logger = logging.getLogger(__name__)


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


_Key = tuple[int, int]
"""A round's group position: ``(wave, step)``."""


@dataclass(frozen=True, slots=True)
class _Arrival:
    unfinished: int
    pause: int
    incarnation: int


@dataclass(slots=True)
class _Round:
    started: float
    arrivals: dict[int, _Arrival] = field(default_factory=dict)


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
        self._rounds: dict[_Key, _Round] = {}
        self._incarnations: dict[int, int] = {}
        self.failure: CollectiveTimeoutError | None = None
        self.completed_rounds = 0
        self.duplicates = 0
        """Contributions dropped because the same rank process already contributed."""
        self.rejoins = 0
        """Times a rank contributed with a new incarnation (it was restarted)."""
        self.stale_dropped = 0
        """Contributions of dead predecessors dropped from open rounds on a rejoin."""

    def open_rounds(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """The rounds waiting for ranks: ``(wave, step)`` -> ranks that arrived."""
        return {key: tuple(sorted(r.arrivals)) for key, r in sorted(self._rounds.items())}

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
            wave, step, unfinished, pause, incarnation = msgpack.unpackb(frames[1])
            if not all(type(v) is int for v in (wave, step, unfinished, pause, incarnation)):
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
        key = (wave, step)
        if self.failure is not None:
            await self._reply(
                rank,
                [
                    wave,
                    step,
                    None,
                    list(self.failure.missing),
                    self.failure.wave,
                    self.failure.step,
                ],
            )
            return
        self._note_incarnation(rank, incarnation, wave)
        rnd = self._rounds.get(key)
        if rnd is None:
            rnd = self._rounds[key] = _Round(trio.current_time())
        if rank in rnd.arrivals:
            self.duplicates += 1
            logger.warning(
                "collective host: rank %d contributed twice to wave %d step %d; dropping the "
                "second contribution",
                rank,
                wave,
                step,
            )
            return
        rnd.arrivals[rank] = _Arrival(unfinished, pause, incarnation)
        if len(rnd.arrivals) < self._rank_count:
            return
        del self._rounds[key]
        sum_unfinished = sum(a.unfinished for a in rnd.arrivals.values())
        sum_pause = sum(a.pause for a in rnd.arrivals.values())
        self.completed_rounds += 1
        reply = [wave, step, sum_unfinished, sum_pause]
        for peer in sorted(rnd.arrivals):
            await self._reply(peer, reply)

    def _note_incarnation(self, rank: int, incarnation: int, wave: int) -> None:
        """A new incarnation of ``rank`` means its previous process is gone: drop what that
        process contributed to rounds still open (nobody waits for those answers)."""
        previous = self._incarnations.get(rank)
        self._incarnations[rank] = incarnation
        if previous is None or previous == incarnation:
            return
        self.rejoins += 1
        stale: list[_Key] = []
        for key, rnd in list(self._rounds.items()):
            arrival = rnd.arrivals.get(rank)
            if arrival is not None and arrival.incarnation != incarnation:
                del rnd.arrivals[rank]
                stale.append(key)
                if not rnd.arrivals:
                    del self._rounds[key]
        self.stale_dropped += len(stale)
        logger.warning(
            "collective host: rank %d rejoined (restarted) at wave %d; dropped its dead "
            "predecessor's contributions to open rounds %s",
            rank,
            wave,
            stale,
        )

    async def _expire(self, now: float) -> None:
        for key, rnd in sorted(self._rounds.items()):
            if rnd.started + self._timeout > now:
                continue
            del self._rounds[key]
            wave, step = key
            missing = tuple(r for r in range(self._rank_count) if r not in rnd.arrivals)
            message = _timeout_message(wave, step, missing, self._timeout)
            others = {k: sorted(r.arrivals) for k, r in self._rounds.items()}
            logger.error(
                "%s; ranks %s are blocked (other open rounds (wave, step) -> ranks: %s)",
                message,
                sorted(rnd.arrivals),
                others,
            )
            if self.failure is None:
                self.failure = CollectiveTimeoutError(
                    message, wave=wave, step=step, missing=missing
                )
            for peer in sorted(rnd.arrivals):
                await self._reply(peer, [wave, step, None, list(missing), wave, step])

    async def _reply(self, rank: int, payload: list[Any]) -> None:
        await self._socket.send_multipart([engine_identity(rank), msgpack.packb(payload)])


class CollectiveClient:
    """One rank's side of the per-step rendezvous (a DEALER connected to the host).

    ``incarnation`` tells this rank process from a previous or later one of the same rank
    (default: random); see the module docstring.
    """

    def __init__(
        self, socket: AsyncSocket, rank: int, *, timeout: float, incarnation: int | None = None
    ) -> None:
        self._socket = socket
        self._rank = rank
        self._timeout = timeout
        self.incarnation = secrets.randbits(62) if incarnation is None else incarnation

    async def step(
        self, *, wave: int, step: int, has_unfinished: bool, pending_pause: bool
    ) -> AllReduceResult:
        """Contribute this rank's step and wait until every rank did; raise on timeout."""
        await self._socket.send(
            msgpack.packb([wave, step, int(has_unfinished), int(pending_pause), self.incarnation])
        )
        # The host answers within its own timeout of the first arrival; allow it that much
        # again before blaming the host itself.
        limit = 2 * self._timeout + 1.0
        with trio.move_on_after(limit):
            while True:
                reply = msgpack.unpackb(await self._socket.recv())
                if not isinstance(reply, list) or len(reply) < 4 or reply[:2] != [wave, step]:
                    # e.g. the answer to a round a dead predecessor of this rank joined
                    logger.warning(
                        "rank %d: unexpected collective reply %r at wave %d step %d",
                        self._rank,
                        reply,
                        wave,
                        step,
                    )
                    continue
                if reply[2] is None:
                    missing = tuple(int(r) for r in reply[3])
                    host_wave = int(reply[4]) if len(reply) > 4 else wave
                    host_step = int(reply[5]) if len(reply) > 5 else step
                    raise CollectiveTimeoutError(
                        _timeout_message(host_wave, host_step, missing, self._timeout),
                        wave=host_wave,
                        step=host_step,
                        missing=missing,
                    )
                return AllReduceResult(int(reply[2]), int(reply[3]))
        raise CollectiveTimeoutError(
            f"collective timeout at wave {wave} step {step}: no answer from the collective "
            f"host (DP rank 0's process) within {limit:g} s",
            wave=wave,
            step=step,
            missing=(),
        )
