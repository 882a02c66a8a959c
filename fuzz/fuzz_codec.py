"""Long-running codec fuzzer, outside CI: ``python fuzz/fuzz_codec.py --seconds 60``.

Uses Hypothesis' fuzz mode (``test.hypothesis.fuzz_one_input``) driven by random bytes,
seeded with mutations of vLLM's vectors. Checks that every decoder either returns or
raises ProtocolError (nothing else may escape), and that what decodes re-encodes to a
frame that decodes to the same value (encoders round-trip).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_dpcoord import protocol

VECTORS = Path(__file__).resolve().parents[1] / "tests" / "data" / "vectors.json"


def _vector_frames() -> list[bytes]:
    return [bytes.fromhex(h) for v in json.loads(VECTORS.read_text()) for h in v["frames_hex"]]


FRAMES = _vector_frames()
outcomes: Counter[str] = Counter()

_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda c: st.lists(c, max_size=12) | st.dictionaries(st.text(max_size=8), c, max_size=6),
    max_leaves=40,
)


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    how = draw(st.sampled_from(["vector", "msgpack", "bytes"]))
    if how == "msgpack":
        return bytes(msgpack.packb(draw(_values), use_bin_type=True))
    if how == "bytes":
        return draw(st.binary(max_size=200))
    data = bytearray(draw(st.sampled_from(FRAMES)))
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and at < len(data):
            data[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[at : at + draw(st.integers(1, 6))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=6))
    return bytes(data)


def _roundtrip(name: str, decoded: Any) -> None:
    """Re-encode what decoded and decode it again: the value must survive."""
    if isinstance(decoded, protocol.EngineCoreOutputs):
        again = protocol.decode_engine_core_outputs(protocol.encode_engine_core_outputs(decoded))
        # the encoder writes the full stats map and 19-slot outputs: compare the model
        assert again == decoded, (name, decoded, again)
    elif isinstance(decoded, protocol.FrontPublish):
        assert protocol.decode_front_publish(protocol.encode_front_publish(decoded)) == decoded
    elif isinstance(decoded, protocol.ScaleElasticEP):
        frame = protocol.encode_scale_elastic_ep(decoded.new_engine_count)
        assert protocol.decode_front_message(frame) == decoded
    elif isinstance(decoded, protocol.LegacyFirstRequest):
        frame = protocol.encode_legacy_first_request(decoded.engine, decoded.wave)
        assert protocol.decode_front_message(frame) == decoded
    elif isinstance(decoded, protocol.StartDPWave):
        wire = protocol.encode_start_dp_wave(decoded.wave, decoded.exclude_engine_index)
        assert protocol.decode_start_dp_wave(wire) == decoded
    elif isinstance(decoded, protocol.EngineCoreRequest):
        assert protocol.decode_engine_request(protocol.encode_add_request(decoded)) == decoded


def check_frame(frame: bytes, second: bytes) -> None:
    decoders: dict[str, Callable[[], object]] = {
        "engine_core_outputs": lambda: protocol.decode_engine_core_outputs(frame),
        "front_publish": lambda: protocol.decode_front_publish(frame),
        "front_message": lambda: protocol.decode_front_message(frame),
        "subscription": lambda: protocol.decode_subscription(frame),
        "request_type": lambda: protocol.decode_request_type(frame[:1]),
        "start_dp_wave": lambda: protocol.decode_start_dp_wave([b"\x02", frame]),
        "engine_broadcast": lambda: protocol.decode_engine_broadcast([second, frame]),
        "engine_request": lambda: protocol.decode_engine_request([b"\x00", frame]),
    }
    for name, decode in decoders.items():
        try:
            decoded = decode()
        except protocol.ProtocolError:
            outcomes[f"{name}: rejected"] += 1
            continue
        outcomes[f"{name}: decoded"] += 1
        if isinstance(decoded, protocol.EngineCoreOutputs):
            protocol.classify_output(decoded)
        _roundtrip(name, decoded)


@settings(database=None, suppress_health_check=list(HealthCheck), deadline=None)
@given(frames(), st.sampled_from([b"\x02", b"READY", b"", b"\x00"]))
def fuzz_codec(frame: bytes, second: bytes) -> None:
    check_frame(frame, second)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    # hypothesis adds ``.hypothesis`` to the test it wraps; its typed decorator does not say so
    wrapped: Any = fuzz_codec
    fuzz_one = wrapped.hypothesis.fuzz_one_input
    deadline = time.monotonic() + args.seconds
    runs = 0
    print(f"fuzzing the codec for {args.seconds:g} s (seed {seed})", flush=True)
    while time.monotonic() < deadline:
        fuzz_one(rng.randbytes(rng.randint(1, 512)))
        runs += 1
    print(f"{runs} inputs, no failure")
    for key, count in sorted(outcomes.items()):
        print(f"  {key:36s} {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
