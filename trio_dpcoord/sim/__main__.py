"""``python -m trio_dpcoord.sim engine --rank R ...``: run one simulated DP rank.

With ``--handshake-address tcp://HOST:PORT`` the rank speaks vLLM's engine-core protocol
(:mod:`.engine_core`) to the front-end there (``open_engine_client``), which hands it
the other addresses.

Exit status: 0 when stopped (SIGTERM, SIGINT, or stdin closed with
``--exit-on-stdin-eof``), 3 on a collective timeout, 4 when the coordinator sent an
invalid broadcast, 5 when the coordinator stayed unreachable for
``--coordinator-timeout`` seconds, 2 on bad arguments. The failure is printed as one stderr line
starting with ``trio_dpcoord.sim engine rank R:``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Sequence

import trio

from ..cli import cancel_at_stdin_eof
from .collective import CollectiveTimeoutError
from .engine import run_engine, run_sim_engine
from .engine_config import EngineConfig
from .engine_core import SimEngineCore
from .engine_errors import (
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_COORDINATOR_LOST,
    EXIT_PROTOCOL_ERROR,
    CoordinatorLostError,
    EngineProtocolError,
)

logger = logging.getLogger("trio_dpcoord.sim")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trio_dpcoord.sim")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("engine", help="run one simulated DP engine (one rank)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--engines", type=int, required=True, help="DP size")
    p.add_argument("--back-pub", default="", help="the coordinator's back-publish socket (XPUB)")
    p.add_argument("--back-out", default="", help="the coordinator's back-output socket (PULL)")
    p.add_argument("--request-address", default="", help="front-end request ROUTER")
    p.add_argument("--completion-address", default="", help="front-end completion PULL")
    p.add_argument(
        "--handshake-address",
        default=None,
        help="speak vLLM's engine-core protocol: HELLO to this front-end handshake "
        "address (tcp://HOST:PORT), which answers with the four addresses above",
    )
    p.add_argument("--collective-address", required=True, help="rank 0 binds, all connect")
    p.add_argument("--step-time", type=float, default=0.002, help="seconds per step")
    p.add_argument("--tokens", type=int, default=8, help="tokens for requests without max")
    p.add_argument("--max-running", type=int, default=8, help="requests advanced per step")
    p.add_argument("--sync-interval", type=int, default=16, help="dp_sync_interval")
    p.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=0,
        help="an LRU prefix cache of N blocks, chunked prefill of the uncached prompt "
        "tokens and steps that grow with their tokens (default 0: the fixed-step toy)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument(
        "--token-budget", type=int, default=2048, help="tokens per step (max_num_batched_tokens)"
    )
    p.add_argument(
        "--step-per-token", type=float, default=0.0, help="seconds each token adds to a step"
    )
    p.add_argument(
        "--kv-events-address",
        default=None,
        help="bind a PUB socket here and publish vLLM KV-cache events (needs the prefix cache)",
    )
    p.add_argument("--collective-timeout", type=float, default=10.0)
    p.add_argument(
        "--coordinator-timeout",
        type=float,
        default=None,
        help="exit (status 5) when the coordinator stays unreachable this long "
        "(default: log the loss and keep waiting)",
    )
    p.add_argument(
        "--curve-server-key",
        default=None,
        help="the coordinator's Z85 CURVE public key, when it runs with CURVE",
    )
    p.add_argument(
        "--legacy-wake",
        action="store_true",
        help="pre-0.33 engine: no start_wave for requests stamped with the current wave",
    )
    p.add_argument(
        "--exit-on-stdin-eof",
        action="store_true",
        help="exit when stdin closes (the parent died): no orphan engines",
    )
    p.add_argument("--log-level", default="WARNING")
    soak = commands.add_parser("soak", help="run the long soak against `trio-dpcoord serve`")
    soak.add_argument("--waves", type=int, default=10_000)
    soak.add_argument("--messages", type=int, default=1_000_000)
    soak.add_argument("--engines", type=int, default=4)
    soak.add_argument("--warmup-waves", type=int, default=1_000)
    soak.add_argument("--pause-every", type=int, default=200)
    soak.add_argument("--push-pause", type=float, default=0.01)
    soak.add_argument("--log-level", default="INFO")
    return parser


async def _watch_signals(cancel: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            cancel.cancel()
            return


async def _main(config: EngineConfig, exit_on_eof: bool, handshake: str | None = None) -> None:
    failure: CollectiveTimeoutError | EngineProtocolError | CoordinatorLostError | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_signals, nursery.cancel_scope)
        if exit_on_eof:
            nursery.start_soon(cancel_at_stdin_eof, nursery.cancel_scope, logger)
        try:
            if handshake is None:
                await run_engine(config)
            else:
                await run_sim_engine(SimEngineCore(config, handshake))
        except (CollectiveTimeoutError, EngineProtocolError, CoordinatorLostError) as exc:
            failure = exc
        finally:
            nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


def _soak(args: argparse.Namespace) -> int:
    from .soak import SoakConfig, run_soak

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = SoakConfig(
        waves=args.waves,
        messages=args.messages,
        engines=args.engines,
        warmup_waves=args.warmup_waves,
        pause_every=args.pause_every,
        push_pause=args.push_pause,
    )
    report = trio.run(run_soak, config)
    print(json.dumps(report.to_json()), flush=True)
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "soak":
        return _soak(args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s rank {args.rank} %(levelname)s %(name)s: %(message)s",
    )
    addresses = (
        args.back_pub,
        args.back_out,
        args.request_address,
        args.completion_address,
    )
    if args.handshake_address is None and not all(addresses):
        print(
            "trio_dpcoord.sim engine: give --handshake-address, or all of "
            "--back-pub, --back-out, --request-address and "
            "--completion-address",
            file=sys.stderr,
        )
        return 2
    try:
        config = EngineConfig(
            rank=args.rank,
            engine_count=args.engines,
            back_publish_address=args.back_pub,
            back_output_address=args.back_out,
            request_address=args.request_address,
            completion_address=args.completion_address,
            collective_address=args.collective_address,
            step_time=args.step_time,
            tokens_per_request=args.tokens,
            max_running=args.max_running,
            sync_interval=args.sync_interval,
            collective_timeout=args.collective_timeout,
            report_start_wave=not args.legacy_wake,
            coordinator_timeout=args.coordinator_timeout,
            prefix_cache_blocks=args.prefix_cache_blocks,
            block_size=args.block_size,
            token_budget=args.token_budget,
            step_per_token=args.step_per_token,
            kv_events_address=args.kv_events_address,
            curve_server_key=None
            if args.curve_server_key is None
            else args.curve_server_key.encode(),
        )
    except ValueError as exc:
        print(f"trio_dpcoord.sim engine: {exc}", file=sys.stderr)
        return 2
    prefix = f"trio_dpcoord.sim engine rank {args.rank}:"
    try:
        trio.run(_main, config, args.exit_on_stdin_eof, args.handshake_address)
    except CollectiveTimeoutError as exc:
        print(f"{prefix} {exc}", file=sys.stderr, flush=True)
        return EXIT_COLLECTIVE_TIMEOUT
    except EngineProtocolError as exc:
        print(f"{prefix} {exc}", file=sys.stderr, flush=True)
        return EXIT_PROTOCOL_ERROR
    except CoordinatorLostError as exc:
        print(f"{prefix} {exc}", file=sys.stderr, flush=True)
        return EXIT_COORDINATOR_LOST
    return 0


if __name__ == "__main__":
    sys.exit(main())
