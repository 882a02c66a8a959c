"""Embed the DP wave coordinator in a trio front-end.

Runs an in-process coordinator for two engines, plays the engines' coordinator-facing
sockets by hand (trio_dpcoord.testing), and walks through two waves: a front-end's
first request wakes the paused engines (excluding the engine that got the request),
rank 0 completes the wave, then an engine that got a request while idle starts the
next wave itself (vLLM 0.33's path) and the coordinator wakes the others.

    python examples/embed_coordinator.py
"""

from __future__ import annotations

import logging

import trio

from trio_dpcoord import open_coordinator, protocol
from trio_dpcoord.testing import connect_engines


async def main() -> None:
    async with open_coordinator(2, ready_timeout=10) as coordinator:
        print(f"engines connect to {coordinator.back_publish_address} (XSUB)")
        print(f"           and push to {coordinator.back_output_address} (PUSH)")
        async with connect_engines(
            coordinator.back_publish_address, coordinator.back_output_address, 2
        ) as engines:
            await coordinator.wait_ready()
            for engine in engines:
                assert await engine.next_broadcast() == "READY"
            print("gate open: READY sent to both engines")

            # A front-end routes a request in one call: the engine (vLLM's score over the
            # live loads), the wave to stamp on it, and the wake of paused engines.
            route = coordinator.choose()
            print(f"request stamped wave {route.wave} -> engine {route.engine_index}")
            for engine in engines:
                print(f"  engine {engine.index} got {await engine.next_broadcast()}")

            # Rank 0 reports the end of the wave: the coordinator moves to the next one.
            coordinator.finished(route.engine_index)  # the request is done (finished_requests)
            await engines[0].wave_complete(route.wave)
            await coordinator.wait_for(lambda c: not c.snapshot().engines_running)
            print(f"wave complete: now {coordinator.snapshot()}")

            # An engine that got a request while idle starts the next wave itself.
            await engines[1].start_wave(coordinator.snapshot().current_wave)
            for engine in engines:
                message = await engine.next_broadcast()
                assert isinstance(message, protocol.StartDPWave)
                print(f"  engine {engine.index} got {message}")
            await coordinator.wait_for(lambda c: c.snapshot().engines_running)
            print(f"engine-started wave: now {coordinator.snapshot()}")
            print(f"statistics: {coordinator.statistics()}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    trio.run(main)
