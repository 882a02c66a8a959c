"""An OpenAI-style HTTP front-end on trio that embeds the DP coordinator.

    pip install -e '.[http]'
    python examples/http_frontend.py --engines 4 --port 8000
    curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "Hello", "max_tokens": 16, "stream": true}'
    curl http://127.0.0.1:8000/metrics

The trio counterpart of vLLM's API server with its in-process coordinator: one trio
process runs hypercorn's trio worker (a real ASGI server), :func:`open_coordinator`, and
the simulated front-end of :mod:`trio_dpcoord.sim`, which stamps every request with the
coordinator's current wave, routes it with the shared :class:`~trio_dpcoord.EngineChooser`
and wakes paused engines; ``--engines`` simulated DP engine processes step in lock-step
and produce placeholder tokens (``" tok1 tok2 ..."``; the prompt is not read) at their
step rate.

Routes: ``POST /v1/completions`` (``prompt``, ``max_tokens``, ``stream``; a JSON
completion, or server-sent events ending with ``data: [DONE]``), ``GET /metrics`` (the
coordinator's Prometheus metrics and this front-end's own, in one registry),
``GET /v1/models`` (the one model, as OpenAI clients list it first), ``GET /health``.
Each completion also reports ``dp_wave``, the wave stamped on it.

Through the engine client (one code path for real and simulated engines):
``--engines-from vllm --handshake-address tcp://HOST:PORT`` serves ``--engines`` DP
engine cores started elsewhere with ``vllm serve MODEL --headless --data-parallel-size N
--data-parallel-address HOST --data-parallel-rpc-port PORT`` (on other hosts: bind HOST on
an address they reach, ``--allow-remote``) through :func:`trio_dpcoord.open_engine_client`,
the coordinator inside it (``--engine-client tcp://HOST:PORT`` is the same);
``--engines-from sim`` starts ``--engines`` simulated engine processes that speak vLLM's
engine-core protocol (:mod:`trio_dpcoord.sim.engine_core`) and serves them through the
same client. A prompt of token ids (``"prompt": [3, 4, 5]``) is sent as is, any other
prompt as a fixed token-id prompt (the tiny test models have no tokenizer), and the
completion's ``token_ids`` are in each choice.

Once listening, the first stdout line is one JSON object:
``{"url": "http://127.0.0.1:8000", "pid": ..., "engine_pids": [...]}``.
SIGINT/SIGTERM: new requests get 503, streams in flight may finish for
``--drain-timeout`` seconds and are then cut with a final ``error`` event, and every
engine process is stopped and reaped; exit status 0 (1 if an engine process died).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from trio_dpcoord import (
    EngineChooser,
    EngineClient,
    EngineClientError,
    SamplingParams,
    open_coordinator,
    open_engine_client,
)
from trio_dpcoord.cli import cancel_at_stdin_eof
from trio_dpcoord.metrics import CoordinatorCollector
from trio_dpcoord.sim import (
    ClusterConfig,
    EngineCoreFleet,
    SimFrontend,
    open_engine_core_fleet,
    open_engine_fleet,
    open_sim_frontend,
)
from trio_dpcoord.sim.engine_core import free_tcp_address

logger = logging.getLogger("http_frontend")

_FINISH_REASONS = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "repetition"}
_MAX_BODY = 1 << 20
_MAX_TOKENS_LIMIT = 4096
_PROMPT_TOKENS = 4  # the simulated front-end sends a fixed 4-token prompt

Send = Callable[[dict[str, Any]], Awaitable[None]]


class BadRequest(Exception):
    """A request this server refuses (400), with the message for the client."""


def token_text(token_id: int) -> str:
    """The placeholder text of one simulated token."""
    return f" tok{token_id}"


_FALLBACK_PROMPT = (3, 4, 5, 6)
"""The token ids sent to real engines for a prompt that is not a list of token ids."""


class EngineClientFrontend:
    """Real engines through the engine client, behind the simulated front-end's interface
    (``submit``/``abort``/``view``/``pending``): one task per request reads its stream."""

    def __init__(self, client: EngineClient, nursery: trio.Nursery) -> None:
        self.client = client
        self.view = client.coordinator
        self._nursery = nursery

    @property
    def pending(self) -> int:
        return len(self.client.in_flight())

    async def submit(
        self,
        max_tokens: int,
        *,
        on_output: Callable[[tuple[int, ...], int | None], None],
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        stream = self.client.generate(prompt_token_ids or list(_FALLBACK_PROMPT), params)
        await stream.__aenter__()
        self._nursery.start_soon(self._pump, stream, on_output)
        return stream.request_id

    async def _pump(
        self, stream: Any, on_output: Callable[[tuple[int, ...], int | None], None]
    ) -> None:
        reasons = {name: code for code, name in _FINISH_REASONS.items()}
        try:
            async for output in stream:
                reason = output.finish_reason
                on_output(output.new_token_ids, None if reason is None else reasons.get(reason, 3))
        except EngineClientError as exc:
            logger.warning("request %s failed: %s", stream.request_id, exc)
            on_output((), 3)
        finally:
            await stream.__aexit__(None, None, None)

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)


class CompletionsApp:
    """The ASGI application: completions routed to the simulated DP engines (or to real
    ones through :class:`EngineClientFrontend`)."""

    def __init__(
        self,
        frontend: SimFrontend | EngineClientFrontend,
        registry: CollectorRegistry,
        model: str,
    ) -> None:
        self.frontend = frontend
        self.registry = registry
        self.model = model
        self.draining = False
        self._token_ids = isinstance(frontend, EngineClientFrontend)
        self._drain_deadline = math.inf
        self._in_flight: set[trio.CancelScope] = set()
        self._requests = Counter(
            "http_frontend_completion_requests",
            "Completion requests received, by mode and outcome.",
            ["stream", "outcome"],
            registry=registry,
        )
        self._tokens = Counter(
            "http_frontend_completion_tokens",
            "Completion tokens sent to clients.",
            registry=registry,
        )

    def begin_drain(self, timeout: float) -> None:
        """Refuse new completions; cut those in flight after ``timeout`` seconds."""
        self.draining = True
        self._drain_deadline = trio.current_time() + timeout
        for scope in self._in_flight:
            scope.deadline = min(scope.deadline, self._drain_deadline)

    # --- ASGI ---------------------------------------------------------------------------

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        send_any: Send = send  # type: ignore[assignment]
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send_any({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send_any({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if path == "/v1/completions":
            if method != "POST":
                await _json(send_any, 405, _error("use POST", "invalid_request_error"))
                return
            await self._completion(receive, send_any)
        elif path == "/metrics" and method in ("GET", "HEAD"):
            body = generate_latest(self.registry)
            await _respond(send_any, 200, CONTENT_TYPE_LATEST, b"" if method == "HEAD" else body)
        elif path == "/v1/models" and method == "GET":
            # OpenAI clients list the models first; this server serves exactly one.
            model = {"id": self.model, "object": "model", "created": 0, "owned_by": "trio_dpcoord"}
            await _json(send_any, 200, {"object": "list", "data": [model]})
        elif path == "/health" and method == "GET":
            snapshot = self.frontend.view.snapshot()
            status = 503 if self.draining else 200
            await _json(
                send_any,
                status,
                {
                    "status": "draining" if self.draining else "ok",
                    "current_wave": snapshot.current_wave,
                    "engines_running": snapshot.engines_running,
                    "in_flight": self.frontend.pending,
                },
            )
        else:
            await _json(send_any, 404, _error(f"no route {method} {path}", "not_found"))

    async def _completion(self, receive: ASGIReceiveCallable, send: Send) -> None:
        try:
            request = _parse_completion(await _read_body(receive))
        except BadRequest as exc:
            self._requests.labels(stream="unknown", outcome="bad_request").inc()
            await _json(send, 400, _error(str(exc), "invalid_request_error"))
            return
        stream = request["stream"]
        mode = "true" if stream else "false"
        if self.draining:
            self._requests.labels(stream=mode, outcome="refused").inc()
            await _json(send, 503, _error("server shutting down", "server_shutdown"))
            return
        chunks_send, chunks = trio.open_memory_channel[tuple[tuple[int, ...], int | None]](math.inf)
        wave = self.frontend.view.snapshot().current_wave

        def on_output(tokens: tuple[int, ...], reason: int | None) -> None:
            chunks_send.send_nowait((tokens, reason))

        if isinstance(self.frontend, EngineClientFrontend):
            request_id = await self.frontend.submit(
                request["max_tokens"],
                on_output=on_output,
                prompt_token_ids=request.get("prompt_token_ids"),
            )
        else:
            request_id = await self.frontend.submit(
                request["max_tokens"],
                on_output=on_output,
                prompt_token_ids=request.get("prompt_token_ids"),
            )
        completion_id = f"cmpl-{request_id}"
        header = {
            "id": completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
        }
        gone = trio.Event()
        outcome = "completed"
        with trio.CancelScope(deadline=self._drain_deadline) as scope:
            self._in_flight.add(scope)
            try:
                if stream:
                    await self._stream(receive, send, chunks, header, wave, scope, gone)
                else:
                    await self._collect(send, chunks, header, wave)
            finally:
                self._in_flight.discard(scope)
        if scope.cancelled_caught:
            # Cut by the drain deadline, or the client went away: free the engine's slot.
            await self.frontend.abort(request_id)
            outcome = "disconnected" if gone.is_set() else "cut"
            if not gone.is_set():
                await _cut(send, stream, completion_id)
        self._requests.labels(stream=mode, outcome=outcome).inc()

    async def _collect(
        self,
        send: Send,
        chunks: trio.MemoryReceiveChannel[tuple[tuple[int, ...], int | None]],
        header: dict[str, Any],
        wave: int,
    ) -> None:
        tokens: list[int] = []
        async for new, reason in chunks:
            tokens += new
            if reason is not None:
                break
        else:  # pragma: no cover - the channel is never closed
            reason = 3
        self._tokens.inc(len(tokens))
        body = header | {
            "choices": [
                {
                    "index": 0,
                    "text": "".join(map(token_text, tokens)),
                    "logprobs": None,
                    "finish_reason": _FINISH_REASONS.get(reason, "error"),
                    **({"token_ids": tokens} if self._token_ids else {}),
                }
            ],
            "usage": _usage(len(tokens)),
            "dp_wave": wave,
        }
        await _json(send, 200, body)

    async def _stream(
        self,
        receive: ASGIReceiveCallable,
        send: Send,
        chunks: trio.MemoryReceiveChannel[tuple[tuple[int, ...], int | None]],
        header: dict[str, Any],
        wave: int,
        scope: trio.CancelScope,
        gone: trio.Event,
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )
        count = 0
        finished: str | None = None
        async with trio.open_nursery() as nursery:

            async def watch_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                if finished is None:
                    logger.info("client went away: aborting %s", header["id"])
                    gone.set()
                    scope.cancel()

            nursery.start_soon(watch_disconnect)
            async for new, reason in chunks:
                count += len(new)
                self._tokens.inc(len(new))
                if reason is not None:
                    finished = _FINISH_REASONS.get(reason, "error")
                event = header | {
                    "choices": [
                        {
                            "index": 0,
                            "text": "".join(map(token_text, new)),
                            "logprobs": None,
                            "finish_reason": finished,
                            **({"token_ids": list(new)} if self._token_ids else {}),
                        }
                    ],
                    "dp_wave": wave,
                }
                if finished is not None:
                    event["usage"] = _usage(count)
                await _sse(send, json.dumps(event))
                if finished is not None:
                    break
            await _sse(send, "[DONE]", more=False)
            nursery.cancel_scope.cancel()


def _usage(completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": _PROMPT_TOKENS,
        "completion_tokens": completion_tokens,
        "total_tokens": _PROMPT_TOKENS + completion_tokens,
    }


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


async def _read_body(receive: ASGIReceiveCallable) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("client disconnected")
        chunk = message.get("body", b"")
        if isinstance(chunk, bytes):
            body += chunk
        if len(body) > _MAX_BODY:
            raise BadRequest(f"request body over {_MAX_BODY} bytes")
        if not message.get("more_body", False):
            return bytes(body)


def _parse_completion(body: bytes) -> dict[str, Any]:
    try:
        request = json.loads(body)
    except ValueError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise BadRequest("body must be a JSON object")
    prompt = request.get("prompt", "")
    if not isinstance(prompt, str | list):
        raise BadRequest("prompt must be a string")
    max_tokens = request.get("max_tokens", 16)
    if type(max_tokens) is not int or not 1 <= max_tokens <= _MAX_TOKENS_LIMIT:
        raise BadRequest(f"max_tokens must be an integer from 1 to {_MAX_TOKENS_LIMIT}")
    stream = request.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false")
    parsed: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream}
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        parsed["prompt_token_ids"] = prompt
    return parsed


async def _respond(send: Send, status: int, content_type: str, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type.encode()),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    await _respond(send, status, "application/json", json.dumps(body).encode())


async def _sse(send: Send, data: str, *, more: bool = True) -> None:
    await send(
        {"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": more}
    )


async def _cut(send: Send, stream: bool, completion_id: str) -> None:
    """Tell the client its completion was cut by the shutdown."""
    message = _error(f"{completion_id}: cut short, the server is shutting down", "server_shutdown")
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            if stream:
                await _sse(send, json.dumps(message))
                await _sse(send, "[DONE]", more=False)
            else:
                await _json(send, 503, message)
        except Exception:  # the connection is already gone
            logger.info("could not tell the client that %s was cut", completion_id)


# --- the process ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="OpenAI-style HTTP front-end on trio, embedding the DP coordinator, "
        "serving simulated DP engines."
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind host (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--engines", type=int, default=4, help="DP size (default: %(default)s)")
    parser.add_argument(
        "--step-time", type=float, default=0.01, help="seconds per engine step (token rate)"
    )
    parser.add_argument("--max-running", type=int, default=8, help="requests per engine step")
    parser.add_argument("--model", default="sim-moe", help="model name in responses")
    parser.add_argument(
        "--routing",
        choices=EngineChooser.ROUTINGS,
        default="vllm",
        help="engine choice: vLLM 0.33.0's score (vllm) or prefix-cache affinity weighed "
        "against the busiest rank (prefix; token-id prompts) (default: %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="on SIGINT/SIGTERM, seconds streams in flight may take to finish before "
        "they are cut (default: %(default)s)",
    )
    parser.add_argument(
        "--exit-on-stdin-eof",
        action="store_true",
        help="shut down when standard input closes (the parent process is gone)",
    )
    parser.add_argument(
        "--engines-from",
        choices=("sim", "vllm"),
        default=None,
        help="serve through the engine client (open_engine_client): simulated engine "
        "processes speaking vLLM's engine-core protocol (sim), or real vLLM engines "
        "started with --headless that connect to --handshake-address (vllm); "
        "default: the simulation's own front-end",
    )
    parser.add_argument(
        "--handshake-address",
        metavar="tcp://HOST:PORT",
        help="the engine handshake address the client binds (the engines' "
        "--data-parallel-address/--data-parallel-rpc-port); needed with "
        "--engines-from vllm, a free loopback port by default with sim",
    )
    parser.add_argument(
        "--engine-client",
        metavar="tcp://HOST:PORT",
        help="the same as --engines-from vllm --handshake-address tcp://HOST:PORT",
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="with the engine client: bind on a host other than loopback (unauthenticated)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="with the engine client: seconds to wait for every engine (default: %(default)s)",
    )
    parser.add_argument("--log-level", default="WARNING", help="(default: %(default)s)")
    return parser


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def run_engine_client(args: argparse.Namespace) -> int:
    """Serve through the engine client, the coordinator inside it: real vLLM engines
    (``--engines-from vllm``) or simulated engine-core processes started here
    (``--engines-from sim``); everything past the engines' start is the same code."""
    shutdown = trio.Event()
    failures: list[str] = []
    app: CompletionsApp | None = None

    def stop(reason: str) -> None:
        if not shutdown.is_set():
            logger.info("stopping: %s", reason)
            if app is not None:
                app.begin_drain(args.drain_timeout)
            shutdown.set()

    with (
        trio.CancelScope() as run_scope,
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
    ):

        def engine_failed(message: str) -> None:
            failures.append(message)
            if app is None:  # still starting: the client would wait for it in vain
                run_scope.cancel()
            stop(message)

        async with AsyncExitStack() as stack:
            fleet: EngineCoreFleet | None = None
            address = args.handshake_address
            if args.engines_from == "sim":
                address = address or free_tcp_address()
                config = ClusterConfig(
                    engines=args.engines,
                    step_time=args.step_time,
                    max_running=args.max_running,
                    engine_log_level=args.log_level.upper(),
                )
                fleet = await stack.enter_async_context(
                    open_engine_core_fleet(config, address, on_failure=engine_failed)
                )
            client = await stack.enter_async_context(
                open_engine_client(
                    args.engines,
                    address,
                    allow_remote=args.allow_remote,
                    startup_timeout=args.startup_timeout,
                    routing=args.routing,
                )
            )
            helpers = await stack.enter_async_context(trio.open_nursery())

            async def on_signal() -> None:
                async for signum in signals:
                    stop(f"{signal.Signals(signum).name} received")

            helpers.start_soon(on_signal)
            if args.exit_on_stdin_eof:
                helpers.start_soon(_stop_at_stdin_eof, stop)
            registry = CollectorRegistry()
            registry.register(CoordinatorCollector(client.coordinator))
            app = CompletionsApp(EngineClientFrontend(client, helpers), registry, args.model)
            hyper = Config()
            hyper.bind = [f"{args.host}:{args.port}"]
            hyper.graceful_timeout = args.drain_timeout + 5.0
            hyper.loglevel = args.log_level.upper()
            async with trio.open_nursery() as server:
                binds = await server.start(_serve, app, hyper, shutdown)
                pids = list(fleet.pids) if fleet is not None else []
                _emit({"url": binds[0], "pid": os.getpid(), "engine_pids": pids})
            if fleet is not None:  # the engines stop first: their going is no outage
                client.expect_shutdown()
                await fleet.stop()
            helpers.cancel_scope.cancel()
    for failure in failures:
        logger.error("%s", failure)
    return 1 if failures else 0


async def run(args: argparse.Namespace) -> int:
    if args.engine_client:
        args.engines_from, args.handshake_address = "vllm", args.engine_client
    if args.engines_from is not None:
        return await run_engine_client(args)
    config = ClusterConfig(
        engines=args.engines,
        step_time=args.step_time,
        max_running=args.max_running,
        engine_log_level=args.log_level.upper(),
    )
    shutdown = trio.Event()
    failures: list[str] = []
    app: CompletionsApp | None = None

    def stop(reason: str, *, expected: bool = False) -> None:
        if not shutdown.is_set():
            logger.log(logging.INFO if expected else logging.WARNING, "stopping: %s", reason)
            if app is not None:
                app.begin_drain(args.drain_timeout)
            shutdown.set()

    def engine_failed(message: str) -> None:
        failures.append(message)
        stop(message)

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with AsyncExitStack() as stack:
            coordinator = await stack.enter_async_context(open_coordinator(args.engines))
            frontend = await stack.enter_async_context(
                open_sim_frontend(coordinator, args.engines, routing=args.routing)
            )
            pids = await stack.enter_async_context(
                open_engine_fleet(
                    config,
                    frontend,
                    back_publish_address=coordinator.back_publish_address,
                    back_output_address=coordinator.back_output_address,
                    on_failure=engine_failed,
                )
            )
            # Leaving the block stops the engines (this callback first): their going is
            # then a normal shutdown, logged at INFO by the coordinator.
            stack.callback(coordinator.expect_shutdown)
            async with trio.open_nursery() as helpers:

                async def on_signal() -> None:
                    async for signum in signals:
                        stop(f"{signal.Signals(signum).name} received", expected=True)

                helpers.start_soon(on_signal)
                if args.exit_on_stdin_eof:
                    helpers.start_soon(_stop_at_stdin_eof, stop)
                with trio.move_on_after(60) as ready_scope:
                    await coordinator.wait_ready()
                    await frontend.wait_for(lambda f: all(f.engine_ready))
                if ready_scope.cancelled_caught:
                    failures.append("engines not ready after 60 s")
                else:
                    registry = CollectorRegistry()
                    registry.register(CoordinatorCollector(coordinator))
                    app = CompletionsApp(frontend, registry, args.model)
                    hyper = Config()
                    hyper.bind = [f"{args.host}:{args.port}"]
                    hyper.graceful_timeout = args.drain_timeout + 5.0
                    hyper.loglevel = args.log_level.upper()
                    # hypercorn returns once the shutdown was triggered and the connections
                    # drained (graceful_timeout); then the engines stop.
                    async with trio.open_nursery() as server:
                        binds = await server.start(_serve, app, hyper, shutdown)
                        _emit({"url": binds[0], "pid": os.getpid(), "engine_pids": list(pids)})
                helpers.cancel_scope.cancel()
    for failure in failures:
        logger.error("%s", failure)
    return 1 if failures else 0


async def _serve(
    app: CompletionsApp,
    config: Config,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    await serve(app, config, shutdown_trigger=shutdown.wait, task_status=task_status)


async def _stop_at_stdin_eof(stop: Callable[[str], None]) -> None:
    """Stop gracefully when stdin closes: the parent holding its other end is gone."""
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_at_stdin_eof, scope, logger)
            await trio.sleep_forever()
    if scope.cancelled_caught:
        stop("standard input closed")


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if args.engines_from == "vllm" and not (args.handshake_address or args.engine_client):
        parser.error("--engines-from vllm needs --handshake-address tcp://HOST:PORT")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
