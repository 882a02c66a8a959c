"""``trio-dpcoord serve``: the coordinator as a standalone process, for vLLM-style peers.

A drop-in for vLLM's ``DPCoordinatorProc``: the same :func:`open_coordinator` service an
embedded front-end uses, with the front socket enabled. A launcher reads the endpoints
from the first line on stdout, points engines at ``back_pub``/``back_out`` and
front-ends at ``front``, and stops it with SIGINT or SIGTERM; the last line on stdout
then holds the counters, so the launcher can check that nothing was rejected.

With ``--supervised`` the process is a small supervisor (``_supervisor.py``) and the
coordinator a worker process it restarts on the same addresses when it dies; the worker
keeps its wave in a file (the hidden ``--wave-file``) for its successor to take over
from (docs/protocol.md §16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import NoReturn
from urllib.parse import urlsplit

import trio

from ._compiled import log_build
from ._errors import CoordinatorError
from ._shell.coordinator import Coordinator, open_coordinator
from ._shell.endpoints import DEFAULT_LIVENESS, Liveness
from ._shell.supervision import inject_failure, keep_heartbeat
from ._supervisor import RULE, SILENCE_DEADLINE
from .core._pacing import ProgressPacer

__all__ = ["cancel_at_stdin_eof", "main"]

logger = logging.getLogger(__name__)

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


async def cancel_at_stdin_eof(scope: trio.CancelScope, logger: logging.Logger) -> None:
    """Cancel ``scope`` when stdin reaches end of file: the parent holding its other end
    has gone (even by SIGKILL), so a child process must not outlive it as an orphan."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stdin:
        while await stdin.receive_some(4096):
            pass
    logger.info("standard input closed: stopping (the parent is gone)")
    scope.cancel()


class _OneLineParser(argparse.ArgumentParser):
    """Reports a bad option as one line on stderr (exit status 2), not usage plus error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _seconds_or_off(text: str) -> float | None:
    """A positive number of seconds, or 0 for "off"."""
    if text.strip() in ("0", "0.0", "off"):
        return None
    return _positive_float(text)


def _liveness(args: argparse.Namespace) -> Liveness:
    keepalive = args.tcp_keepalive_idle
    try:
        return Liveness(
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_timeout=args.heartbeat_timeout,
            tcp_keepalive_idle=None if keepalive is None else max(1, round(keepalive)),
            local_heartbeats=args.local_heartbeats,
        )
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _curve_secret_key(path: str) -> bytes:
    try:
        with open(path, "rb") as key_file:
            key = key_file.read().strip()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {exc.strerror}") from None
    if len(key) != 40:
        raise argparse.ArgumentTypeError(f"{path!r} does not hold a 40-character Z85 key")
    return key


def _build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="trio-dpcoord",
        description="A trio-native data-parallel wave coordinator, wire-compatible with "
        "vLLM 0.33.0's DP engine protocol.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the coordinator as a standalone process (a drop-in for vLLM's DPCoordinatorProc)",
        description="Run the coordinator until SIGINT or SIGTERM. Once the three sockets "
        'are bound, the first line on stdout is {"front": ..., "back_pub": ..., '
        '"back_out": ...} with the real endpoints (tcp port 0 resolved). On a clean exit '
        'the last line is {"counters": {...}}. Logs go to stderr. Addresses are '
        "tcp://HOST:PORT, ipc://PATH or inproc://NAME; ipc socket files are created "
        "readable by this user only.",
    )
    _add_endpoint_arguments(serve)
    _add_wave_arguments(serve)
    _add_liveness_arguments(serve)
    _add_access_arguments(serve)
    _add_process_arguments(serve)
    return parser


def _add_endpoint_arguments(serve: argparse.ArgumentParser) -> None:
    """The engine count and the three sockets' bind addresses."""
    serve.add_argument(
        "--engines",
        type=_positive_int,
        required=True,
        metavar="N",
        help="number of DP engines: READY is broadcast once N engines have subscribed "
        "to back-pub (the start-up gate waits without a time limit)",
    )
    serve.add_argument(
        "--front",
        metavar="ADDR",
        default="",
        help="bind address of the front-end socket (XPUB: publishes [counts, wave, "
        "running]; accepts SCALE_ELASTIC_EP and legacy FIRST_REQ); front-ends connect "
        "their XSUB here (default: a private ipc:// path)",
    )
    serve.add_argument(
        "--back-pub",
        metavar="ADDR",
        default="",
        help="bind address of the engine broadcast socket (XPUB: READY, START_DP_WAVE); "
        "engines connect their XSUB here (default: a private ipc:// path)",
    )
    serve.add_argument(
        "--back-out",
        metavar="ADDR",
        default="",
        help="bind address of the engine output socket (PULL: stats, wave_complete, "
        "start_wave); engines connect their PUSH here (default: a private ipc:// path)",
    )


def _add_wave_arguments(serve: argparse.ArgumentParser) -> None:
    """How loads are published and waves coordinated."""
    serve.add_argument(
        "--stats-interval-ms",
        type=_positive_float,
        default=100.0,
        metavar="MS",
        help="publish load counts to front-ends about this long after a change "
        "(default: %(default)s; a heartbeat goes out every 5 s otherwise)",
    )
    serve.add_argument(
        "--no-wave-coordination",
        dest="wave_coordination",
        action="store_false",
        help="stats only, for non-MoE engines: wave fields are ignored and every publish "
        "is [counts, 0, false]",
    )
    serve.add_argument(
        "--wake-confirm-timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="a wave started by a legacy FIRST_REQ that no engine confirms within this "
        "time (paused engines drop START_DP_WAVE) is taken as paused again, instead of "
        "engines_running staying latched (default: %(default)s)",
    )


def _add_liveness_arguments(serve: argparse.ArgumentParser) -> None:
    """Heartbeats and keepalive: how soon a silent peer is dropped."""
    serve.add_argument(
        "--heartbeat-interval",
        type=_seconds_or_off,
        default=DEFAULT_LIVENESS.heartbeat_interval,
        metavar="SECONDS",
        help="send a ZMTP heartbeat on every tcp:// connection this often; 0 turns heartbeats "
        "off (default: %(default)s). A peer that goes silent without closing (a "
        "partition, a node that lost power) is dropped after --heartbeat-timeout, shows "
        "as an unsubscription and is logged; vLLM engines answer heartbeats as they are",
    )
    serve.add_argument(
        "--local-heartbeats",
        action="store_true",
        help="send heartbeats on ipc:// and inproc:// connections too (by default only on "
        "tcp://: locally the kernel reports a dead peer at once and no partition can "
        "happen; only a frozen, SIGSTOPped local engine goes unnoticed without them)",
    )
    serve.add_argument(
        "--heartbeat-timeout",
        type=_positive_float,
        default=DEFAULT_LIVENESS.heartbeat_timeout,
        metavar="SECONDS",
        help="drop a connection that carried nothing, not even a heartbeat answer, this "
        "long; peers are asked to do the same (default: %(default)s)",
    )
    serve.add_argument(
        "--tcp-keepalive-idle",
        type=_seconds_or_off,
        default=DEFAULT_LIVENESS.tcp_keepalive_idle,
        metavar="SECONDS",
        help="TCP keepalive probes after this many idle seconds (every "
        f"{DEFAULT_LIVENESS.tcp_keepalive_interval} s, {DEFAULT_LIVENESS.tcp_keepalive_count}"
        " unanswered drop the connection); 0 leaves the system default (default: %(default)s)",
    )


def _add_access_arguments(serve: argparse.ArgumentParser) -> None:
    """Who may reach the sockets."""
    serve.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow binding tcp addresses beyond loopback (ZeroMQ traffic is "
        "unauthenticated: anyone who can reach the sockets can drive the engines)",
    )
    serve.add_argument(
        "--curve-secret-key-file",
        type=_curve_secret_key,
        default=None,
        metavar="PATH",
        help="off by default (vLLM engines cannot use it): a file holding a Z85 CURVE "
        "secret key (40 characters); every socket then requires CURVE, only peers that "
        "know the matching public key (printed as curve_public_key in the endpoints "
        "line) can connect, and traffic is encrypted",
    )


def _add_process_arguments(serve: argparse.ArgumentParser) -> None:
    """The process around the service: metrics, lifetime, logging."""
    serve.add_argument(
        "--metrics-address",
        metavar="HOST:PORT",
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (needs the metrics "
        "extra: pip install 'trio-dpcoord[metrics]'); loopback unless --allow-remote; "
        'port 0 picks a free port; the endpoints line then holds "metrics": URL',
    )
    serve.add_argument(
        "--supervised",
        action="store_true",
        help="run the coordinator as a worker process and start another on the same "
        "addresses within a second when it dies (a crash, kill -9) or hangs: it takes over "
        f"at the wave the dead one had reached and the engines reconnect to it. The rule: "
        f"{RULE}. This process only supervises; killing it ends the worker",
    )
    serve.add_argument(
        "--watchdog-timeout",
        type=_seconds_or_off,
        default=SILENCE_DEADLINE,
        metavar="SECONDS",
        help="with --supervised: kill and replace a worker whose event loop was silent "
        "this long (no heartbeat); 0 turns the watchdog off (default: %(default)s)",
    )
    serve.add_argument("--wave-file", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--standby", action="store_true", help=argparse.SUPPRESS)
    serve.add_argument(
        "--exit-on-stdin-eof",
        action="store_true",
        help="stop cleanly when standard input reaches end of file, so a launcher that "
        "dies (even by SIGKILL) leaves no orphan coordinator behind",
    )
    serve.add_argument(
        "--log-level",
        type=str.upper,
        choices=_LOG_LEVELS,
        default="INFO",
        help="logging threshold for messages on stderr (default: %(default)s)",
    )
    serve.add_argument(
        "--log-format",
        choices=("plain", "vllm"),
        default="plain",
        help="the layout of log lines: plain (time, level, logger) or vllm (vLLM's own "
        "layout, as the coordinator worker that vLLM's plugin supervises writes them)",
    )


def _emit(record: dict[str, object]) -> None:
    """One JSON line on stdout, flushed at once: launchers read it line by line."""
    try:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        # the launcher stopped reading: the coordinator keeps serving the engines
        logger.warning("stdout is closed; cannot report %s", ", ".join(record))


def _gate_moved(seen: int) -> Callable[[Coordinator], bool]:
    return lambda c: c.subscriptions().current != seen or c.subscriptions().gate_open


GATE_PROGRESS_INTERVAL = 1.0
"""Seconds between two start-up gate progress lines at most (the opening is always told)."""


def _gate_is_open(coordinator: Coordinator) -> bool:
    return coordinator.subscriptions().gate_open


async def _log_gate_progress(coordinator: Coordinator, engine_count: int) -> None:
    """Say how far the start-up gate got until READY: the first subscription change, then
    the newest count at most once per :data:`GATE_PROGRESS_INTERVAL`, so that thousands of
    engines subscribing write a few lines, not one each. The core logs the opening."""
    logger.info(
        "waiting for %d engines to subscribe to %s", engine_count, coordinator.back_publish_address
    )
    pacer = ProgressPacer(GATE_PROGRESS_INTERVAL, logged=0)
    seen = 0
    while True:
        with trio.move_on_at(pacer.next_due(seen)):  # wake to tell a count kept back
            await coordinator.wait_for(_gate_moved(seen))
        view = coordinator.subscriptions()
        if view.gate_open:
            return
        seen = view.current
        if pacer.should_log(seen, trio.current_time()):
            logger.info("start-up gate: %d of %d engines subscribed", seen, engine_count)


def _metrics_address(args: argparse.Namespace) -> tuple[str, int] | None:
    """``--metrics-address``, checked before anything binds (a bad one exits 2)."""
    if args.metrics_address is None:
        return None
    try:
        from .metrics import parse_metrics_address
    except ImportError as exc:
        raise CoordinatorError(
            f"--metrics-address needs the metrics extra: pip install 'trio-dpcoord[metrics]' "
            f"({exc})"
        ) from None
    return parse_metrics_address(args.metrics_address, allow_remote=args.allow_remote)


async def _serve(args: argparse.Namespace) -> int:
    # The signal receiver is installed before the endpoints line goes out and stays until
    # the counters line is written, so a launcher's signal never interrupts either.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        started = False
        try:
            metrics_address = _metrics_address(args)
            async with open_coordinator(
                args.engines,
                back_publish_address=args.back_pub or None,
                back_output_address=args.back_out or None,
                front_address=args.front,
                ready_timeout=None,
                wave_coordination=args.wave_coordination,
                stats_interval=args.stats_interval_ms / 1000.0,
                allow_remote=args.allow_remote,
                wake_confirm_timeout=args.wake_confirm_timeout,
                curve_secret_key=args.curve_secret_key_file,
                liveness=args.liveness,
                wave_file=args.wave_file,
            ) as coordinator:
                endpoints: dict[str, object] = {
                    "front": coordinator.front_address,
                    "back_pub": coordinator.back_publish_address,
                    "back_out": coordinator.back_output_address,
                }
                if coordinator.curve_public_key is not None:
                    endpoints["curve_public_key"] = coordinator.curve_public_key.decode()
                metrics = None
                if metrics_address is not None:
                    from .metrics import MetricsEndpoint, coordinator_registry

                    metrics = await MetricsEndpoint.bind(
                        coordinator_registry(coordinator), *metrics_address
                    )
                    endpoints["metrics"] = metrics.url
                _emit(endpoints)
                started = True
                log_build()  # which build of the hot path runs: compiled, or the pure twin
                async with trio.open_nursery() as nursery:
                    if metrics is not None:
                        await nursery.start(metrics.serve)
                    nursery.start_soon(_log_gate_progress, coordinator, args.engines)
                    if args.wave_file is not None:  # supervised: the watchdog reads it
                        nursery.start_soon(
                            partial(
                                keep_heartbeat,
                                wait_gate_open=partial(coordinator.wait_for, _gate_is_open),
                            ),
                            args.wave_file,
                            partial(_gate_is_open, coordinator),
                            coordinator.restarts().process_restarts == 0,
                            lambda: inject_failure(coordinator._pumps, "engine_output"),
                        )
                    if args.exit_on_stdin_eof:
                        nursery.start_soon(cancel_at_stdin_eof, nursery.cancel_scope, logger)
                    async for signum in signals:
                        logger.info("%s received: stopping", signal.Signals(signum).name)
                        break
                    nursery.cancel_scope.cancel()
                counters = coordinator.statistics()
                restarts = coordinator.restarts()
        except CoordinatorError as exc:
            print(f"trio-dpcoord: error: {exc}", file=sys.stderr, flush=True)
            return 1 if started else 2
        _emit(
            {
                "counters": {**dataclasses.asdict(counters), "errors": counters.errors},
                "restarts": dataclasses.asdict(restarts),
            }
        )
        logger.info("stopped cleanly (%d rejected inputs)", counters.errors)
    return 0


def _supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """``serve --supervised``: this process supervises, a worker process coordinates.

    The worker gets the same options, a wave file and ``--exit-on-stdin-eof``; default
    ``ipc://`` addresses are fixed here (a directory of this process's), so that a
    restarted worker binds the same ones, and tcp ports as the first worker resolved
    them. The worker's endpoints line is this process's first line, its counters line
    its last; the worker logs to the same stderr."""
    from ._supervisor import supervise_worker

    options = [option for option in argv if option != "--supervised"]
    with tempfile.TemporaryDirectory(prefix="trio-dpcoord-") as private:
        first = {
            "--front": args.front or f"ipc://{private}/front",
            "--back-pub": args.back_pub or f"ipc://{private}/back-publish",
            "--back-out": args.back_out or f"ipc://{private}/back-output",
        }
        base = [sys.executable, "-m", "trio_dpcoord", *options]
        wave_file = os.path.join(private, "wave")
        base += ["--wave-file", wave_file, "--exit-on-stdin-eof"]

        def command(endpoints: Mapping[str, str] | None) -> list[str]:
            addresses = dict(first)
            if endpoints is not None:
                addresses["--front"] = endpoints["front"]
                addresses["--back-pub"] = endpoints["back_pub"]
                addresses["--back-out"] = endpoints["back_out"]
                if "metrics" in endpoints:  # its port as the first worker resolved it
                    addresses["--metrics-address"] = urlsplit(endpoints["metrics"]).netloc
            return [*base, *(part for pair in addresses.items() for part in pair)]

        def relay(line: str) -> None:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

        return supervise_worker(
            command,
            lambda endpoints: [*command(endpoints), "--standby"],
            on_endpoints=lambda endpoints: _emit(dict(endpoints)),
            on_line=relay,
            heartbeat_path=wave_file,
            silence_deadline=args.watchdog_timeout or 0.0,
            stop_on_stdin_eof=args.exit_on_stdin_eof,
        )


def _wait_for_the_go() -> bool:
    """``--standby`` (a supervisor's next worker): imports done, wait for a line on stdin
    before binding anything. False at end of file or on SIGTERM: not needed after all."""
    try:
        return bool(sys.stdin.buffer.readline())
    except KeyboardInterrupt:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``trio-dpcoord`` and ``python -m trio_dpcoord``; returns the exit status."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "serve":
            try:
                args.liveness = _liveness(args)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"bad heartbeat settings: {exc}")
    except SystemExit as exc:  # --help (0) or a bad option (2), already reported
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "log_format", "plain") == "vllm":
        from .vllm import _VllmLogFormatter  # stdlib only: no vLLM is imported

        for handler in logging.getLogger().handlers:
            handler.setFormatter(_VllmLogFormatter())
    # ipc:// socket files (and anything else created) are for this user only
    os.umask(0o077)
    if args.supervised:
        return _supervise(args, sys.argv[1:] if argv is None else list(argv))
    if args.standby and not _wait_for_the_go():
        return 0
    # Until trio's signal receiver is installed, SIGTERM stops the process like SIGINT:
    # quietly, with status 0, even in the instant before the endpoints line.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return trio.run(_serve, args)
    except KeyboardInterrupt:
        logger.info("interrupted before the coordinator was running")
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
