"""`tandem serve`'s own flags (the engine's flags are the CLI's `_engine_flags`)."""

from __future__ import annotations

import argparse


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The model argument, the stack file, and the server's flags: address, API key, served
    names, limits, data parallelism, worker threads, tool calling, stream buffering."""
    parser.add_argument(
        "model",
        nargs="?",
        help="model: 'default', 'scripted', an HF directory, a .gguf file or a hub id",
    )
    parser.add_argument("--config", help="YAML stack file")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on every route but /health, /metrics, "
        "/version and /ping (or env TANDEM_API_KEY)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        help="the model name(s) requests use (default: the model argument as given)",
    )
    parser.add_argument(
        "--max-num-waiting",
        type=int,
        help="sequences that may wait beyond those running; more get 429 (default: no bound)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=1 << 20,
        help="larger request bodies get 413 (default 1 MiB)",
    )
    add_hardening_flags(parser)
    parser.add_argument(
        "--data-parallel-size", type=int, default=1, help="engine-core processes (default 1)"
    )
    parser.add_argument(
        "--worker-threads",
        type=int,
        help="torch threads per worker (default: every core for one engine on up to 4 "
        "cores, else (cores - 1) // data-parallel-size)",
    )
    parser.add_argument(
        "--tool-call-parser",
        help="tool parser reading calls out of the model's text for tool_choice 'auto' "
        "(bundled: hermes, json; more through the entry-point group tandem.tool_parsers)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="allow tool_choice 'auto' (the default when a request has tools); needs "
        "--tool-call-parser",
    )
    parser.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="leave the tools out of the prompt when tool_choice is 'none' (default: the "
        "template still gets them, as in vLLM)",
    )
    parser.add_argument(
        "--max-engine-restarts",
        type=int,
        default=3,
        help="restart a dead engine core up to this many times with the same configuration "
        "(requests in flight fail, later ones are served; 0: a death stops the server; "
        "default 3)",
    )
    parser.add_argument(
        "--disaggregated",
        action="store_true",
        help="prefill/decode disaggregation: a prefill server and a decode server (kv-disagg) "
        "behind one endpoint, with a proxy (docs/disaggregated-serving.md)",
    )
    parser.add_argument(
        "--kv-port",
        type=int,
        default=0,
        help="--disaggregated: the prefill server's KV block port (default: a free port)",
    )
    parser.add_argument(
        "--stream-buffer-size",
        type=int,
        default=1024,
        help="outputs a stream may fall behind before its request is aborted (default 1024)",
    )


def add_hardening_flags(parser: argparse.ArgumentParser) -> None:
    """What a client may ask of the server: request templates, connections, timeouts,
    shutdown (see docs/security.md)."""
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat template (template text, never a path) in a request's "
        "chat_template; without this flag such requests get 400 (as in vLLM)",
    )
    parser.add_argument(
        "--limit-concurrency",
        type=int,
        default=1024,
        help="open connections at most; past it the connection idle longest is closed, "
        "or, when all have a request in flight, the new one gets 503 (default 1024)",
    )
    parser.add_argument(
        "--timeout-request-header",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's headers, from when it "
        "opens or its last response ends; then it is closed (default 10)",
    )
    parser.add_argument(
        "--timeout-request-body",
        type=float,
        default=60.0,
        help="seconds a request's body may take to arrive; then 408 (default 60)",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle kept-alive connection stays open (uvicorn's, default 5)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds requests in flight may take to finish before "
        "they end with a 503 or an SSE error event (default 30)",
    )
