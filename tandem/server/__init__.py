"""`tandem serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) on `AsyncLLM`.

`build_app(engine, settings)` makes the app (routes, shapes and SSE framing as vLLM's
OpenAI server); `run_server(args)` is the command: budget line, engine, uvicorn, and exit
with status 1 when the engine dies. Imported on first use (PEP 562), so the CLI's parser
stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ServerSettings", "build_app", "run_server"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'tandem.server' has no attribute {name!r}")
    value = getattr(importlib.import_module("tandem.server.api_server"), name)
    globals()[name] = value
    return value
