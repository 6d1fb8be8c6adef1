"""`tandem serve --disaggregated`: a prefill engine and a decode engine behind one endpoint.

The parent process starts two `tandem serve` children on 127.0.0.1 with the same model and
flags: the prefill server (`kv-disagg`, `kv_role: kv_producer`, its block server on
`--kv-port`) and the decode server (`kv_role: kv_consumer`, reading that port). It then
serves `DisaggProxy` on `--host`/`--port`: each completion or chat request goes to the
prefill server with `max_tokens` 1 (no streaming, one choice), which computes the prompt
and keeps its blocks; then the request as sent goes to the decode server, which loads the
prompt's blocks over the transport and generates. The decode server's answer, streamed or
not, is the client's; an error from the prefill server is returned as it is. Other routes
go to the decode server. Authorization travels to both servers, which enforce
`--api-key` as a single server does; the children bind 127.0.0.1 only.

Each child gets half the worker threads a single server would (`--worker-threads`, unless
given). Stopping the parent (SIGINT/SIGTERM) stops both children.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

logger = logging.getLogger("tandem.disagg")

#: Flags of the parent that the children do not get (each child gets its own).
PARENT_FLAGS = {"--host": 1, "--port": 1, "--disaggregated": 0, "--kv-port": 1}
#: The request fields a prefill request overrides, and those it drops.
PREFILL_FIELDS = {"max_tokens": 1, "stream": False, "n": 1}
PREFILL_DROPPED = ("stream_options", "min_tokens", "max_completion_tokens")
#: Routes that run the model: prefill first, then decode.
GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions")
#: Longest a child may take to answer /health after it starts.
STARTUP_TIMEOUT_S = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_argv(argv: Sequence[str]) -> list[str]:
    """The serve arguments a child keeps: all but the parent's own address flags (both
    `--flag value` and `--flag=value` forms)."""
    kept: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in PARENT_FLAGS:
            skip = PARENT_FLAGS[name] if "=" not in arg else 0
            continue
        kept.append(arg)
    return kept


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: one token, one choice, no stream."""
    request = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    return {**request, **PREFILL_FIELDS}


class DisaggProxy:
    """The proxy app: `prefill_url` and `decode_url` are the children's base URLs."""

    def __init__(self, prefill_url: str, decode_url: str, max_body_bytes: int) -> None:
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self.max_body_bytes = max_body_bytes
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        self.app = FastAPI()
        for route in GENERATE_ROUTES:
            self.app.add_api_route(route, self._generate, methods=["POST"])
        self.app.add_api_route("/health", self._health, methods=["GET"])
        self.app.add_api_route("/{path:path}", self._forward, methods=["GET", "POST"])

    @staticmethod
    def _headers(request: Request) -> dict[str, str]:
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        return headers

    async def _body(self, request: Request) -> bytes | Response:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return _error(413, f"request body over {self.max_body_bytes} bytes")
        return bytes(body)

    async def _generate(self, request: Request) -> Response:
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        headers, path = self._headers(request), request.url.path
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the decode server answers with the exact error
        if isinstance(parsed, dict):
            prefill = await self.client.post(
                self.prefill_url + path, json=prefill_body(parsed), headers=headers
            )
            if prefill.status_code != 200:
                return _relay(prefill)
        return await self._send(path, body, headers, stream=bool((parsed or {}).get("stream")))

    async def _send(
        self, path: str, body: bytes, headers: dict[str, str], stream: bool
    ) -> Response:
        upstream = self.client.build_request(
            "POST", self.decode_url + path, content=body, headers=headers
        )
        response = await self.client.send(upstream, stream=True)
        if not stream or response.status_code != 200:
            await response.aread()
            await response.aclose()
            return _relay(response)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()  # a client gone closes the decode stream: aborted

        media = response.headers.get("content-type", "text/event-stream")
        return StreamingResponse(chunks(), status_code=200, media_type=media)

    async def _health(self) -> Response:
        statuses = await asyncio.gather(
            *(self.client.get(url + "/health") for url in (self.prefill_url, self.decode_url)),
            return_exceptions=True,
        )
        healthy = all(isinstance(s, httpx.Response) and s.status_code == 200 for s in statuses)
        return Response(status_code=200 if healthy else 503)

    async def _forward(self, request: Request, path: str) -> Response:
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        upstream = await self.client.request(
            request.method,
            f"{self.decode_url}/{path}",
            content=body or None,
            headers=self._headers(request),
            params=request.query_params,
        )
        return _relay(upstream)


def _relay(response: httpx.Response) -> Response:
    media = response.headers.get("content-type")
    return Response(response.content, status_code=response.status_code, media_type=media)


def _error(status: int, message: str) -> Response:
    body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
    return Response(json.dumps(body), status_code=status, media_type="application/json")


def _start_child(argv: list[str], port: int, transfer: dict[str, Any]) -> subprocess.Popen:
    command = [sys.executable, "-c", "from tandem.cli import main; raise SystemExit(main())"]
    command += ["serve", *argv, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--kv-transfer-config", json.dumps(transfer)]
    return subprocess.Popen(command, start_new_session=True, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies, however it dies (Linux `prctl`), so a
    killed proxy never leaves its servers behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_healthy(children: list[tuple[subprocess.Popen, str]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        child, url = pending[0]
        if child.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {child.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server for {url} was not healthy within {timeout_s} s")
        time.sleep(0.5)


def run_disaggregated(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start the pair, serve the proxy until stopped, stop the pair. Returns the status."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    kept = child_argv(argv)
    if args.worker_threads is None:
        kept += ["--worker-threads", str(max(1, ((os.cpu_count() or 2) - 1) // 2))]
    kv_port = args.kv_port or free_port()
    ports = free_port(), free_port()
    extra = {"port": kv_port}
    producer = {
        "kv_connector": "kv-disagg",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }
    consumer = {
        "kv_connector": "kv-disagg",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"peer": f"127.0.0.1:{kv_port}"},
    }
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    children = [_start_child(kept, ports[0], producer), _start_child(kept, ports[1], consumer)]
    try:
        _wait_healthy(list(zip(children, urls, strict=True)), STARTUP_TIMEOUT_S)
        proxy = DisaggProxy(urls[0], urls[1], args.max_request_body_bytes)
        print(f"tandem: prefill {urls[0]}, decode {urls[1]}, KV on port {kv_port}", flush=True)
        uvicorn.run(proxy.app, host=args.host, port=args.port, log_level="warning")
        return 0
    except RuntimeError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 1
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + 8  # within the 10 s a supervisor usually grants
        for child in children:
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
