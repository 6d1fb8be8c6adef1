"""Server-sent events exactly as vLLM's OpenAI server frames them.

Each chunk is one event `data: <json>\n\n`; a stream that fails midway (the engine died,
the reader fell too far behind) gets one error event `data: {"error": {...}}\n\n`; every
stream that is not cancelled ends with `data: [DONE]\n\n`. A cancelled stream (the client
disconnected) ends at once, without either.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from tandem.server.errors import from_exception

logger = logging.getLogger("tandem.server")

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


def event(payload: str) -> str:
    """One SSE event carrying `payload` (a JSON text)."""
    return f"data: {payload}\n\n"


async def framed(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """`chunks` (JSON texts) as SSE events, then an error event if they fail, then DONE."""
    try:
        async for payload in chunks:
            yield event(payload)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes the client's error event
        error = from_exception(exc)
        logger.warning("stream failed: %s", error.message)
        yield event(json.dumps(error.body()))
    yield DONE
