"""A fake OpenAI-compatible server for the `tandem bench serve` tests: canned SSE streams.

`fake_app(seen)` answers `/health`, `/v1/models` (one model, `fake-model`) and streaming
`/v1/completions`: one `data:` event per output token (text `t<i> `) a few milliseconds apart,
a usage chunk when `stream_options.include_usage` asks, then `[DONE]`; every request body is
appended to `seen`. Prompts steer it: `[500]` answers HTTP 500, `[666]` sends an error event
mid-stream, `[777]` stalls 30 s after its first token, `[888]` streams without a usage chunk,
`[999]` streams empty texts (a model without a tokenizer).
Run as a script (`python fake_openai_server.py --port N`) it serves on 127.0.0.1:N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TOKEN_DELAY_S = 0.002


def fake_app(seen: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        seen.append(body)
        prompt = body["prompt"]
        if prompt == [500]:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n = int(body["max_tokens"])

        async def events() -> Any:
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY_S)
                if prompt == [666] and i == 1:
                    yield 'data: {"error": {"message": "engine died", "code": 500}}\n\n'
                    return
                if prompt == [777] and i == 1:
                    await asyncio.sleep(30)
                text = "" if prompt == [999] else f"t{i} "
                chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = (body.get("stream_options") or {}).get("include_usage")
            if usage and prompt != [888]:
                tokens = len(prompt) if isinstance(prompt, list) else 1
                u = {"prompt_tokens": tokens, "completion_tokens": n, "total_tokens": tokens + n}
                yield f"data: {json.dumps({'choices': [], 'usage': u})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(fake_app([]), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
