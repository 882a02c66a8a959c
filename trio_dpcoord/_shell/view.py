"""What both handles offer a front-end that routes requests: one typing Protocol, and the
:class:`Route` of :meth:`~trio_dpcoord.Coordinator.choose`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..core._wave import WaveSnapshot
from ..protocol import EngineLoad

__all__ = ["CoordinatorView", "Route"]


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes (:meth:`~trio_dpcoord.Coordinator.choose`): the engine
    ``engine_index`` to send it to, and the ``wave`` to stamp on it (vLLM's
    ``current_wave``)."""

    engine_index: int
    wave: int


class CoordinatorView(Protocol):
    """The coordinator as a request router sees it, embedded or standalone.

    Both :class:`~trio_dpcoord.Coordinator` (embedded, authoritative) and
    :class:`~trio_dpcoord.Frontend` (following a standalone coordinator's publishes)
    satisfy it, so routing code such as the simulator's front-end works with either.
    """

    def snapshot(self) -> WaveSnapshot:
        """The wave to stamp on a new request, and whether the engines run."""
        ...

    def engine_loads(self) -> Sequence[EngineLoad]:
        """Every engine's latest load, in rank order."""
        ...

    def notify_first_request(self, engine_index: int) -> None:
        """A request is being routed to ``engine_index``: wake the engines if they sleep.

        ``TypeError`` for a non-int, ``ValueError`` for an index outside the engines,
        :class:`~trio_dpcoord.CoordinatorClosedError` once the handle has stopped.
        """
        ...
