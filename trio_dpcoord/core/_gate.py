"""The start-up gate: nothing leaves the coordinator before every expected engine has
subscribed (docs/protocol.md §5.2, vLLM's coordinator reads nothing earlier).

:class:`StartupGate` holds, in order, what the core decided and the commands it received
while closed; opening it hands them back, to come out behind READY. Counting the
subscriptions that open it is :mod:`._subscriptions`' part, the decision to open it the
core's (``_coordinator.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, final

from ._effects import Command, Effect

__all__ = ["StartupGate"]

_NOTHING: Final[tuple[Effect, ...]] = ()


@final
class StartupGate:
    """Closed until :meth:`open`; while closed it keeps effects and commands, in order."""

    __slots__ = ("deferred", "deferred_commands", "is_open")

    def __init__(self) -> None:
        self.is_open = False
        self.deferred: list[Effect] = []
        """Effects decided before the gate opened: they come out behind READY."""
        self.deferred_commands: list[Command] = []
        """Commands received before the gate opened: applied behind READY."""

    def emit(self, effects: list[Effect]) -> Sequence[Effect]:
        """``effects`` if the gate is open; else kept for :meth:`open`, and nothing now."""
        if self.is_open:
            return effects
        self.deferred.extend(effects)
        return _NOTHING

    def hold_command(self, command: Command) -> bool:
        """Keep ``command`` for :meth:`open` if the gate is closed; whether it was kept."""
        if self.is_open:
            return False
        self.deferred_commands.append(command)
        return True

    def open(self) -> tuple[list[Effect], list[Command]]:
        """Open the gate; returns what it kept: the effects, then the commands to apply."""
        self.is_open = True
        effects = self.deferred
        commands = self.deferred_commands
        self.deferred = []
        self.deferred_commands = []
        return effects, commands
