"""The coordinator's ingest of load reports: held as read, written once per piece.

A sans-IO room of :class:`~._coordinator.CoordinatorCore`. The engine-output listener
hands the core its messages a batch at a time (``receive_engine_outputs``); every load
report in it is checked and counted at once and *held* here, and as the core lets the
piece go, only each engine's newest report is written to the :class:`LoadTable`
(``LoadTable.apply_records``: the table ends as if every report had been applied one by
one, its lock-step snapshot included). Nobody can read the table in between: the shell
holds its lock across the piece.

The hot path, :meth:`HeldStats.take`, is the loop over a batch's stats reports: one
decode per message straight into a flat record (``decode_ingest_stats``), one append, no
other call or object per message; whatever is not a stats report in the shape engines
send is left to the core's general path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

from ..protocol._output_decoder import decode_ingest_stats
from ._counters import Tally
from ._wave import LoadTable, StatsRecord

__all__ = ["HeldStats"]

logger = logging.getLogger(__name__)


class HeldStats:
    """Load reports checked and counted but not yet written to the table."""

    __slots__ = ("_heard_from", "_loads", "_tally", "failed_message", "records")

    def __init__(self, loads: LoadTable, tally: Tally, heard_from: set[int]) -> None:
        self._loads = loads
        self._tally = tally
        self._heard_from = heard_from
        self.records: list[StatsRecord] = []
        self.failed_message: int | None = None
        """Where :meth:`take` raised (a bug: bad input is never an exception)."""

    def take(self, messages: Sequence[Sequence[bytes]], index: int, engines: int) -> int:
        """Hold the stats reports from ``messages[index]`` on while they are in the shape
        engines send (one frame, the common stats shape, an engine index below
        ``engines``); returns the position of the first message that is not (the core
        judges it), or the end. Counted as received and applied."""
        decode = decode_ingest_stats
        hold = self.records.append
        heard = self._heard_from.add
        start, end = index, len(messages)
        try:
            while index < end:
                frames = messages[index]
                if len(frames) != 1:
                    break
                record = decode(frames[0])
                if record is None or record[0] >= engines:
                    break
                hold(record)
                heard(record[0])
                index += 1
        except BaseException:
            self.failed_message = index
            raise
        finally:
            self._tally.engine_messages += index - start
            self._tally.stats_applied += index - start
        return index

    def hold(self, record: StatsRecord) -> None:
        """Hold one report the core decoded itself (counted by the core)."""
        self.records.append(record)

    def write(self) -> Sequence[int]:
        """Write the held reports: the newest of each engine in the table, the superseded
        ones counted in ``stats_coalesced``, the out-of-order ones logged at DEBUG.
        Returns the engine indices of the reports dropped for being beyond the table (a
        resize came between; no longer counted as applied): the core rejects them."""
        held = self.records
        if not held:
            return _NONE
        self.records = []
        count = self._loads.engine_count
        dropped = [record[0] for record in held if record[0] >= count]
        if dropped:
            self._tally.stats_applied -= len(dropped)
            held = [record for record in held if record[0] < count]
        superseded, out_of_order = self._loads.apply_records(held)
        self._tally.stats_coalesced += superseded
        for index in out_of_order:
            log_out_of_order(held[index][0], held[index][4], held[index][5])
        return dropped


_NONE: Final[tuple[int, ...]] = ()


def log_out_of_order(engine_index: int, wave: int, step: int) -> None:
    """A report older than its engine's previous one (R10): applied, logged at DEBUG."""
    logger.debug("out-of-order stats from engine %d: wave %d step %d", engine_index, wave, step)
