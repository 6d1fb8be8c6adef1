"""The OpenAI-compatible HTTP server: `build_app(engine, settings)` and `run_server(args)`.

Routes (vLLM's names and shapes): GET /v1/models, POST /v1/completions, POST
/v1/chat/completions, POST /tokenize, POST /detokenize, GET /health (200; 503 once the
engine died), GET /metrics (Prometheus text), GET /version.

Guards: with an API key every /v1 route needs `Authorization: Bearer <key>` (401); a body
over `max_request_body_bytes` is a 413 (by its Content-Length, or while it is read);
malformed JSON, wrong types and out-of-range values are 400s naming the field; an unknown
model name is a 404; a full queue a 429 with `Retry-After`. A client that disconnects
cancels its request's handler, which aborts the request in the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.server.budget import BudgetError, plan_budget
from tandem.server.errors import APIError, bad_request, from_exception, from_validation_error
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from tandem.server.serving_chat import OpenAIServingChat
from tandem.server.serving_common import check_model, run_cancellable
from tandem.server.serving_completions import OpenAIServingCompletion
from tandem.server.serving_tokenize import detokenize_response, tokenize_response
from tandem.server.sse import MEDIA_TYPE, framed
from tandem.server.to_sampling_params import CHAT_RENAMES
from tandem.server.tool_choice import ToolServing, tool_parser_class

DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20

logger = logging.getLogger("tandem.server")


@dataclass(slots=True)
class ServerSettings:
    """What the app needs besides the engine. `served_model_names[0]` answers requests
    that name no model; `model_root` is the model as loaded (for /v1/models)."""

    served_model_names: list[str]
    model_root: str | None = None
    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    #: Tool calling: the `--tool-call-parser` and its flags (`tandem.server.tool_choice`).
    tools: ToolServing = field(default_factory=ToolServing)


class _Guard:
    """ASGI middleware: the API key on /v1 routes, and the Content-Length limit."""

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
        if key and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
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


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past `limit` bytes, 400 when it is not JSON."""
    size, parts = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
    try:
        body = json.loads(b"".join(parts))
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def build_app(engine: Any, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine` (an `AsyncLLM`) under `settings`."""
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.settings = settings
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
        return Response(status_code=503 if engine.dead_error is not None else 200)

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
            body = await _read_json(request, settings.max_request_body_bytes)
            req = _parse(kind, body)
            name = check_model(req.model, names)
            result = await run_cancellable(request.receive, handler.create(req, name))
        except Exception as exc:  # noqa: BLE001 - every failure is an OpenAI error body
            return from_exception(exc, renames).response()
        if result is None:  # the client left; nobody reads this
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(framed(result), media_type=MEDIA_TYPE)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Any:
        return await generate(request, CompletionRequest, completions, None)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Any:
        return await generate(request, ChatCompletionRequest, chat, CHAT_RENAMES)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        req = _parse(TokenizeRequest, await _read_json(request, settings.max_request_body_bytes))
        check_model(req.model, names)
        return JSONResponse(tokenize_response(engine, req))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        body = await _read_json(request, settings.max_request_body_bytes)
        req = _parse(DetokenizeRequest, body)
        check_model(req.model, names)
        return JSONResponse(detokenize_response(engine, req))

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


def _uvicorn_server(config: Any) -> Any:
    """uvicorn's server, stopping on SIGINT/SIGTERM without re-raising the signal after
    its shutdown (uvicorn's default), so that `run_server` stops the engine and returns."""
    import uvicorn

    class Server(uvicorn.Server):
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


def run_server(args: argparse.Namespace) -> int:
    """`tandem serve`: print the budget, start the engine, serve until stopped or the
    engine dies. Returns the exit status (2 for a budget that does not fit)."""
    import uvicorn

    from tandem.cli import _overrides
    from tandem.engine import AsyncLLM

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    threads = args.worker_threads if args.worker_threads is not None else args.threads
    try:
        budget = plan_budget(args.data_parallel_size, threads)
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
    names = args.served_model_name or [args.model or "default"]
    engine = AsyncLLM(
        model=args.model,
        config=args.config,
        data_parallel_size=args.data_parallel_size,
        max_num_waiting=args.max_num_waiting,
        stream_buffer_size=args.stream_buffer_size,
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
            tools=ToolServing(
                parser=parser_class(engine.tokenizer) if parser_class is not None else None,
                enable_auto_tool_choice=args.enable_auto_tool_choice,
                exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            ),
        )
        app = build_app(engine, settings)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        status = _run_loop(config, serve_until_dead(_uvicorn_server(config), engine))
    finally:
        engine.shutdown()
    if status != 0:  # the engine died: exit now, not after the interpreter's slow teardown
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
