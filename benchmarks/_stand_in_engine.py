"""The names ``tests/test_client_ceiling.py`` imports from the benchmarks' old flat layout.

Kept only until that test imports :mod:`benchmarks.programs.stand_in_engine` itself (the
benchmarks now live in rooms: ``benchmarks/README.md``); nothing else uses it.
"""

from benchmarks.programs.stand_in_engine import (
    TOKEN,
    WireSpeedEngineCore,
    decode_add,
    outputs_frame,
    step_frame,
    wire_request,
)

__all__ = [
    "TOKEN",
    "WireSpeedEngineCore",
    "decode_add",
    "outputs_frame",
    "step_frame",
    "wire_request",
]
