"""The coordinator worker's heartbeat: proof, written from inside its event loop, that it
still runs, for the supervising process to read without a socket (``_supervisor.py``).

Standard library only (the supervisor imports it and nothing of trio or ZeroMQ). The
record lives in the wave file the worker already keeps (``_shell/supervision.WaveFile``
uses its first 24 bytes), at :data:`OFFSET`: four little-endian uint64s, each one
aligned store: the writing worker's pid, a beat counter, flags (:data:`GATE_OPEN`: the
worker's start-up gate opened, READY went out) and the longest silence between two beats
so far, in microseconds. A new worker writes its pid first, so a dead one's record is
never read as the new one's. The supervisor only watches the counter change, on its own
clock: no clock is shared between the processes, and a torn read is at worst a change.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Final

__all__ = ["GATE_OPEN", "OFFSET", "Heartbeat", "HeartbeatWriter", "read_heartbeat"]

OFFSET: Final = 32
"""Where the record starts in the wave file (the wave's own fields end at 24)."""
_RECORD: Final = struct.Struct("<QQQQ")
_FILE_SIZE: Final = OFFSET + _RECORD.size
GATE_OPEN: Final = 1
"""Flag: the worker's start-up gate opened (it is serving its engines)."""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One reading of the record."""

    pid: int
    beats: int
    gate_open: bool
    longest_silence: float
    """Seconds: the longest gap between two beats the worker saw, less the interval."""


class HeartbeatWriter:
    """The worker's side: :meth:`beat` once per interval from a task of its event loop
    (one store per beat, nothing per message), with a clock reading."""

    def __init__(self, path: str, interval: float, pid: int | None = None) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _FILE_SIZE:
                os.ftruncate(fd, _FILE_SIZE)
            self._map = mmap.mmap(fd, _FILE_SIZE)
        finally:
            os.close(fd)
        self.interval = interval
        self.pid = os.getpid() if pid is None else pid
        self.beats = 0
        self.gate_open = False
        self.longest_silence = 0.0
        self._last: float | None = None
        _RECORD.pack_into(self._map, OFFSET, self.pid, 0, 0, 0)

    def beat(self, now: float, gate_open: bool) -> None:
        """The loop ran a beat at ``now``: count it, and how late it came."""
        if self._last is not None:
            self.longest_silence = max(self.longest_silence, now - self._last - self.interval)
        self._last = now
        self.beats += 1
        self.gate_open = self.gate_open or gate_open
        _RECORD.pack_into(
            self._map,
            OFFSET,
            self.pid,
            self.beats,
            GATE_OPEN if self.gate_open else 0,
            round(max(0.0, self.longest_silence) * 1e6),
        )

    def close(self) -> None:
        self._map.close()


def read_heartbeat(fd: int) -> Heartbeat | None:
    """The record in the open file ``fd`` (None while the file is too short)."""
    data = os.pread(fd, _RECORD.size, OFFSET)
    if len(data) < _RECORD.size:
        return None
    pid, beats, flags, silence_us = _RECORD.unpack(data)
    return Heartbeat(pid, beats, bool(flags & GATE_OPEN), silence_us / 1e6)
