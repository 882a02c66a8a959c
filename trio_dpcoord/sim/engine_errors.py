"""How one simulated DP rank fails: the errors it dies of and the exit statuses they give
its process (:mod:`.fleet` reads them, ``python -m trio_dpcoord.sim engine`` sets them).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "DIAGNOSED_EXIT_STATUSES",
    "EXIT_COLLECTIVE_TIMEOUT",
    "EXIT_COORDINATOR_LOST",
    "EXIT_PROTOCOL_ERROR",
    "CoordinatorLostError",
    "EngineProtocolError",
]

# Exit statuses of ``python -m trio_dpcoord.sim engine`` for the failures it diagnoses
# itself; a launcher never restarts such a rank (its DP group is broken).
EXIT_COLLECTIVE_TIMEOUT: Final = 3  # CollectiveTimeoutError
EXIT_PROTOCOL_ERROR: Final = 4  # EngineProtocolError
EXIT_COORDINATOR_LOST: Final = 5  # CoordinatorLostError
DIAGNOSED_EXIT_STATUSES: Final = frozenset(
    {EXIT_COLLECTIVE_TIMEOUT, EXIT_PROTOCOL_ERROR, EXIT_COORDINATOR_LOST}
)


class EngineProtocolError(Exception):
    """The coordinator sent something a vLLM engine would die on (docs/protocol.md §4.1)."""


class CoordinatorLostError(Exception):
    """The connection to the coordinator stayed down for ``coordinator_timeout`` s."""
