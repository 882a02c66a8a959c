"""What goes into the coordinator's core besides frames, and what comes out of it: its
commands (a front-end's first request, elastic EP's scale), its effects (broadcast,
publish, reject) and the causes of a wave start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ._wave import FirstRequest, WaveStart

__all__ = [
    "MAX_ENGINES",
    "MAX_WAVE",
    "Broadcast",
    "Command",
    "Effect",
    "Publish",
    "Reject",
    "ScaleRequest",
    "WaveStartCause",
]

MAX_WAVE: Final = (1 << 64) - 1
"""Waves travel as msgpack uint64: a wave_complete for this one has no next wave to send."""
MAX_ENGINES: Final = 1 << 16
"""Engine ranks are 2-byte identities (§6.1): a larger SCALE_ELASTIC_EP cannot be real."""


class WaveStartCause:
    """Why a START_DP_WAVE went out: the keys of ``CoordinatorStatistics.wave_starts_by_cause``."""

    ENGINE_START_WAVE: Final = "engine_start_wave"
    """An engine got a request while paused and reported ``start_wave`` (vLLM >= 0.33)."""
    FIRST_REQUEST: Final = "first_request"
    """The embedded handle's :meth:`~Coordinator.notify_first_request`."""
    LEGACY_FIRST_REQUEST: Final = "legacy_first_request"
    """A pre-0.33 front-end's FIRST_REQ on the front socket."""
    LATE_SUBSCRIPTION: Final = "late_subscription"
    """An engine (re)subscribed while a wave runs: it missed that wave's START_DP_WAVE."""
    RECOVERY: Final = "recovery"
    """A coordinator restarted after a failure woke the engines at the wave it took over,
    or at the wave an engine's load report showed running (docs/protocol.md §16)."""


@dataclass(frozen=True, slots=True)
class ScaleRequest:
    """Elastic EP: resize the load table to ``engine_count`` engines (§5.8)."""

    engine_count: int


Command = FirstRequest | ScaleRequest
"""What :meth:`CoordinatorCore.receive_command` applies: the handle's claims, and the
front-ends' FIRST_REQ and SCALE_ELASTIC_EP (applied by ``receive_front_frame``)."""


# --- effects -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Broadcast:
    """Send ``frames`` on the engine broadcast socket, then call ``broadcast_sent``.

    ``wave_start`` is None for READY. ``decided_at`` is the clock reading of the decision,
    so the send's latency can be measured; ``cause`` is a :class:`WaveStartCause` value.
    """

    frames: list[bytes]
    wave_start: WaveStart | None
    decided_at: float
    cause: str | None = None


@dataclass(frozen=True, slots=True)
class Publish:
    """Send ``payload`` (an encoded front publish) on the front socket."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class Reject:
    """An input was rejected (already counted under ``reason``); log ``detail``."""

    reason: str
    detail: str


Effect = Broadcast | Publish | Reject
"""What the core returns: every effect goes out on a socket or to the log."""
