"""`tandem serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) on `AsyncLLM`.

`build_app(engine, settings)` makes the app (routes, shapes and SSE framing as vLLM's
OpenAI server); `run_server(args)` is the command: budget line, engine, uvicorn, and exit
with status 1 when the engine dies.
"""

from tandem.server.api_server import ServerSettings, build_app, run_server

__all__ = ["ServerSettings", "build_app", "run_server"]
