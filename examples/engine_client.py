"""Stream tokens from real vLLM engines through trio_dpcoord's engine client
(the front-end's side of vLLM's engine protocol, with the wave coordinator embedded).

Start the engines first (any hosts; here one): ``vllm serve MODEL --headless
--data-parallel-size 2 --data-parallel-address 127.0.0.1 --data-parallel-rpc-port 13345``,
then ``python examples/engine_client.py 2 tcp://127.0.0.1:13345``.
"""

import sys

import trio

from trio_dpcoord import SamplingParams, open_engine_client


async def main(engine_count: int, handshake_address: str) -> None:
    async with open_engine_client(engine_count, handshake_address) as client:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        for prompt in ([3, 4, 5, 6], [7, 8, 9]):
            async with client.generate(prompt, params) as stream:
                async for output in stream:
                    print(
                        f"rank {stream.engine_index}:", output.new_token_ids, output.finish_reason
                    )
        print("wave now", client.coordinator.snapshot().current_wave)


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), sys.argv[2])
