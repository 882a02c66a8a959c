"""Engine choice for front-ends: vLLM 0.33.0's ``DPLBAsyncMPClient`` score (§7.2).

One function serves both modes: an embedded front-end feeds it the coordinator's live
loads, a front-end of the standalone process feeds it the latest publish.
"""

from __future__ import annotations

from collections.abc import Sequence

from .protocol import IDLE_LOAD, EngineLoad

__all__ = ["EngineChooser", "engine_score"]


def engine_score(load: EngineLoad, inflight: int, client_count: int) -> float:
    """vLLM's score: queue length or own in-flight share, plus a KV-pressure penalty."""
    waiting = load.waiting
    score = float(max(client_count * inflight, waiting + load.running))
    if waiting > 0:
        score += waiting * 6.0 * max(0.0, load.kv_cache_usage - 0.5)
    return score


class EngineChooser:
    """Chooses the engine for each new request and tracks this front-end's in-flight counts.

    Scans engines in rotated order from a start that advances by one per choice, takes
    the first strictly lowest score, then counts the request as waiting on that engine
    until the next load report replaces the table. With no load reports yet, the
    in-flight counts alone spread requests over all engines instead of piling them on
    rank 0.
    """

    def __init__(self, engine_count: int, *, client_index: int = 0, client_count: int = 1) -> None:
        if engine_count < 1 or client_count < 1 or not 0 <= client_index < client_count:
            raise ValueError("need engine_count >= 1 and 0 <= client_index < client_count")
        self.client_count = client_count
        self._inflight = [0] * engine_count
        self._start = (engine_count * client_index) // client_count
        self._table: tuple[EngineLoad, ...] = ()
        self._local: list[EngineLoad] = [IDLE_LOAD] * engine_count

    @property
    def inflight(self) -> tuple[int, ...]:
        return tuple(self._inflight)

    def _resize(self, engine_count: int) -> None:
        extra = engine_count - len(self._inflight)
        if extra > 0:
            self._inflight.extend([0] * extra)
        elif extra < 0:
            del self._inflight[engine_count:]
        self._start %= engine_count

    def choose(self, loads: Sequence[EngineLoad]) -> int:
        """Pick the engine for one new request given the latest per-engine loads."""
        count = len(loads)
        if count == 0:
            raise ValueError("no engines to choose from")
        if count != len(self._inflight):
            self._resize(count)
        table = tuple(loads)
        if table != self._table:
            self._table = table
            self._local = list(table)
        best_index = -1
        best_score = float("inf")
        start = self._start
        for offset in range(count):
            index = (start + offset) % count
            score = engine_score(self._local[index], self._inflight[index], self.client_count)
            if score < best_score:
                best_index, best_score = index, score
        chosen = self._local[best_index]
        self._local[best_index] = chosen._replace(waiting=chosen.waiting + self.client_count)
        self._inflight[best_index] += 1
        self._start = (start + 1) % count
        return best_index

    def finished(self, engine_index: int) -> None:
        """A request on ``engine_index`` finished (``finished_requests``)."""
        if 0 <= engine_index < len(self._inflight) and self._inflight[engine_index] > 0:
            self._inflight[engine_index] -= 1
