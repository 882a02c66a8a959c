"""Several front-ends (API servers) on the lock-step model: the hit rate each policy keeps.

``python -m benchmarks.tools.front_ends --ranks 2 8 --rate 20 --trace multi-turn
approx1=approximate:1 approx2=approximate:2:rendezvous_slack=1
home=approximate:2:rendezvous_slack=3,rendezvous_home=1 exact2=exact:2:rendezvous_slack=1
shared2=approximate:2:share_routes=1``

Each ``LABEL=POLICY:FRONT_ENDS[:FIELD=VALUE,...]`` is one of
:data:`trio_dpcoord.sim.routing.POLICIES` with that many front-ends
(:class:`~trio_dpcoord.sim.routing.FrontEnds`: each its own chooser and index, every
request drawn at random to one of them, as the kernel spreads connections over API
servers sharing a port) and :class:`~trio_dpcoord.PrefixRouting` overrides, or
``share_routes=1``: the front-ends tell each other their routes (the vLLM plugin's
default with several API servers). The traces
are the ``routing`` benchmark's (quick sizes) at ``--rate`` requests/s a rank: at its
600 a session's turns all arrive within a few steps, before the earlier ones are
computed, unlike a chat whose user waits for each answer; 20 spaces them out.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from benchmarks.sections import routing as rt
from trio_dpcoord import PrefixRouting
from trio_dpcoord.sim.routing import make_policy, run_policy


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tools.front_ends", description=__doc__
    )
    parser.add_argument("variants", nargs="+", help="LABEL=POLICY:FRONT_ENDS[:FIELD=VALUE,...]")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--trace", default="multi-turn", choices=rt.TRACES)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    sizes = replace(rt.ROUTING_QUICK, rate_per_rank=args.rate)
    for ranks in args.ranks:
        for spec in args.variants:
            label, _, rest = spec.partition("=")
            name, fronts, *extra = rest.split(":")
            fields = {
                key: float(value)
                for key, _, value in (item.partition("=") for item in ",".join(extra).split(","))
                if key
            }
            share = bool(fields.pop("share_routes", 0))
            figures = []
            for seed in range(args.seeds):
                trace = rt.make_trace(args.trace, seed, ranks, sizes)
                policy = make_policy(
                    name,
                    ranks,
                    sizes.capacity_blocks,
                    prefix=PrefixRouting(**fields) if name != "vllm" else None,  # type: ignore[arg-type]
                    front_ends=int(fronts),
                    seed=seed,
                    share_routes=share,
                )
                result = run_policy(trace, ranks, policy, sizes.capacity_blocks)
                figures.append(
                    f"hit {result.hit_rate:.3f}, {result.throughput_tokens_per_s:.0f} tok/s"
                )
            print(f"{args.trace}, {ranks} ranks, {label}: " + " | ".join(figures), flush=True)


if __name__ == "__main__":
    main()
