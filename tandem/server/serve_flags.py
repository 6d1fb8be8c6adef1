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
        help="require `Authorization: Bearer KEY` on /v1 routes (or env TANDEM_API_KEY)",
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
    parser.add_argument(
        "--data-parallel-size", type=int, default=1, help="engine-core processes (default 1)"
    )
    parser.add_argument(
        "--worker-threads",
        type=int,
        help="torch threads per worker (default: (cores - 1) // data-parallel-size)",
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
        "--stream-buffer-size",
        type=int,
        default=1024,
        help="outputs a stream may fall behind before its request is aborted (default 1024)",
    )
