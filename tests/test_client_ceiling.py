"""The client-ceiling benchmark's own parts (benchmarks/sections/client_ceiling.py): its stand-in
engines write the bytes the protocol's encoder writes, and its profile breakdown sorts
py-spy's stacks into the request path's parts. (Its figures are measured, never asserted.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.programs.stand_in_engine import (
    TOKEN,
    decode_add,
    outputs_frame,
    step_frame,
    wire_request,
)
from benchmarks.sections.client_ceiling_profile import SCHEDULER, STARTUP, breakdown
from trio_dpcoord import SamplingParams, protocol

items = st.lists(
    st.tuples(st.text(max_size=8), st.integers(0, 2**32), st.sampled_from([None, 1, 2])),
    max_size=6,
)


@given(items, st.integers(0, 3), st.floats(0, 1e9))
def test_the_stand_in_engines_write_the_encoders_bytes(
    rows: list[tuple[str, int, int | None]], rank: int, timestamp: float
) -> None:
    """One ``msgpack.packb`` per step, the same bytes as the simulated engine's checked
    encoder (an aborted request, finish reason 2, carries no token)."""
    expected = protocol.encode_engine_core_outputs(
        protocol.EngineCoreOutputs(
            engine_index=rank,
            outputs=tuple(
                protocol.EngineCoreOutput(rid, (token,) if reason != 2 else (), reason)
                for rid, token, reason in rows
            ),
            timestamp=timestamp,
            finished_requests=tuple(rid for rid, _, reason in rows if reason is not None) or None,
            weight_version="default",
        )
    )
    assert outputs_frame(rank, rows, timestamp) == expected


LENGTH = protocol.FINISH_REASONS.index("length")


@given(
    st.lists(
        st.tuples(st.text(max_size=12), st.integers(1, 3)), max_size=40, unique_by=lambda t: t[0]
    ),
    st.integers(0, 3),
    st.floats(0, 1e9),
)
def test_a_pre_encoded_step_is_the_encoders_bytes(
    requests: list[tuple[str, int]], rank: int, timestamp: float
) -> None:
    """Each step of pre-encoded outputs, joined, is the frame the checked encoder writes
    for the same outputs (token :data:`TOKEN`, the last with finish reason ``length``);
    a request leaves the running set with its last output, and the frames of one set of
    requests count down to none (up to 40 outputs: msgpack's 16-item header edge)."""
    running = [wire_request(rid, tokens) for rid, tokens in requests]
    left = {rid: max(1, tokens) for rid, tokens in requests}
    steps = 0
    while running:
        rows = [
            (
                r.request_id,
                TOKEN,
                None if left[r.request_id] > 1 else protocol.FINISH_REASONS.index("length"),
            )
            for r in running
        ]
        frame, running = step_frame(rank, running, timestamp)
        assert frame == outputs_frame(rank, rows, timestamp)
        for r in rows:
            left[r[0]] -= 1
        assert [r.request_id for r in running] == [r[0] for r in rows if left[r[0]] > 0]
        steps += 1
    assert steps == max((t for _, t in requests), default=0)


def test_the_stand_in_reads_an_add_as_the_checked_decoder_does() -> None:
    """The stand-in's one msgspec call takes from an ADD what the checked decoder does:
    the request id, ``max_tokens`` (vLLM's default 16 when the map omits it), the wave."""
    for params, wave in ((SamplingParams(max_tokens=5), 3), (SamplingParams(), 0)):
        frames = protocol.encode_add("r-1", [1, 2, 3], params, arrival_time=1.0, current_wave=wave)
        checked = protocol.decode_engine_request(frames)
        assert decode_add(frames[1]) == (
            checked.request_id,
            checked.max_tokens,
            checked.current_wave,
        )


def stack(*frames: str) -> str:
    return ";".join(frames)


TRIO = ("<module> (benchmarks/programs/engine_client.py:1)", "run (trio/_core/_run.py:2532)")
LOOP = "unrolled_run (trio/_core/_run.py:2866)"


def test_the_breakdown_sorts_stacks_into_the_request_path(tmp_path: Path) -> None:
    raw = tmp_path / "profile.txt"
    lines = [
        # start-up and waiting in epoll are left out
        (stack(*TRIO, "_find_and_load (<frozen importlib._bootstrap>:1)"), 50),
        (stack(*TRIO, "EpollIOManager.get_events (trio/_core/_io_epoll.py:243)"), 70),
        # the loop's own code
        (stack(*TRIO, LOOP), 10),
        # a request task: the innermost part named decides
        (
            stack(
                *TRIO,
                LOOP,
                "_run.<locals>.load.<locals>.worker (benchmarks/programs/engine_client.py:9)",
                "_run.<locals>.one (benchmarks/programs/engine_client.py:9)",
                "RequestStream.__aenter__ (trio_dpcoord/_shell/request_stream.py:1)",
                "EngineClient._add (trio_dpcoord/_shell/engine_client.py:1)",
                "encode_add (trio_dpcoord/protocol/_engine_core.py:1)",
            ),
            20,
        ),
        (
            stack(
                *TRIO,
                LOOP,
                "_output_listener (trio_dpcoord/_shell/engine_io.py:1)",
                "EngineClient._receive_outputs (trio_dpcoord/_shell/engine_client.py:1)",
                "decode_client_frames (trio_dpcoord/protocol/_client_decoder.py:1)",
            ),
            15,
        ),
        (stack(*TRIO, LOOP, "Pumps.engine_output_listener (coordinator.py:1)"), 5),
        ("a line cut short (no count", 0),
    ]
    raw.write_text("".join(f"{s} {n}\n" if n else f"{s}\n" for s, n in lines))
    shares = breakdown(raw)
    assert STARTUP not in shares
    assert shares == pytest.approx(
        {
            "encode ADD": 20 / 50,
            "decode engine outputs": 15 / 50,
            SCHEDULER: 10 / 50,
            "embedded coordinator (its ingest of stats, waves)": 5 / 50,
        }
    )
    assert list(shares) == sorted(shares, key=lambda name: -shares[name])


@pytest.mark.trio
async def test_the_client_gets_every_token_from_the_stand_in_engines(tmp_path: Path) -> None:
    """Two stand-in engines (in this process) behind the real engine client, over real
    sockets: every request gets exactly its ``max_tokens`` outputs (token :data:`TOKEN`,
    finish reason ``length``) whether its tokens are gathered, read one by one, or pinned
    to a rank, with many requests in flight (ADDs batched per receive, steps of many
    outputs); a stream left early is aborted and the engines go on serving the rest."""
    import trio

    from benchmarks.programs.stand_in_engine import WireSpeedEngineCore
    from tests.vllm_real import free_port
    from trio_dpcoord import SamplingParams, open_engine_client
    from trio_dpcoord.sim.engine_config import EngineConfig

    address = f"tcp://127.0.0.1:{free_port()}"
    engines = [
        WireSpeedEngineCore(
            EngineConfig(
                rank=rank,
                engine_count=2,
                back_publish_address="",
                back_output_address="",
                request_address="",
                completion_address="",
                collective_address=f"ipc://{tmp_path}/collective",
                step_time=0.001,
                max_running=256,
            ),
            address,
        )
        for rank in range(2)
    ]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for engine in engines:
                nursery.start_soon(engine.run)  # it says HELLO once the client listens
            async with open_engine_client(2, address) as client:
                results: list[tuple[int, tuple[int, ...], str]] = []

                async def gathered(tokens: int, rank: int | None) -> None:
                    done = await client.complete(
                        [1, 2, 3], SamplingParams(max_tokens=tokens), engine_index=rank
                    )
                    results.append((tokens, done.token_ids, done.finish_reason))

                async def read(tokens: int) -> None:
                    got: list[int] = []
                    async with client.generate([4, 5], SamplingParams(max_tokens=tokens)) as stream:
                        async for output in stream:
                            got += output.new_token_ids
                    assert stream.finish_reason is not None
                    results.append((tokens, tuple(got), stream.finish_reason))

                async with trio.open_nursery() as load:
                    for i in range(200):
                        if i % 2:
                            load.start_soon(read, 1 + i % 7)
                        else:
                            load.start_soon(
                                gathered, 1 + i % 5, (i // 2) % 2 if i % 10 == 0 else None
                            )
                async with client.generate([6], SamplingParams(max_tokens=10_000)) as stream:
                    async for _ in stream:
                        break  # left early: aborted on its engine
                await gathered(3, None)  # the engines still serve
                assert client.in_flight() == []
            nursery.cancel_scope.cancel()
    assert len(results) == 201
    for tokens, token_ids, reason in results:
        assert token_ids == (TOKEN,) * tokens and reason == "length"
