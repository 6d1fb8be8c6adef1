"""A chat choice's output as vLLM's response shape for tool calls.

Not streaming, `tool_message(plan, text, finish_reason)` gives the message's `content`,
its `tool_calls` (`{"id": "chatcmpl-tool-<hex>", "type": "function", "function": {"name",
"arguments"}}`, arguments a JSON string) and the choice's `finish_reason`. Streaming,
`ToolCallDeltas` (one per choice) turns each new piece of text into a content delta and
`delta.tool_calls` entries (`{"index", "id", "type", "function": {"name", "arguments"}}`
on a call's first piece, `{"index", "function": {"arguments"}}` after), which join into
the non-streamed message (see `tandem.server.tool_parsers.base` for when they must).

How each `ToolPlan.mode` reads the text:
- `none`: all of it is content;
- `named`: all of it is the arguments of the named function (the grammar made it a JSON
  object matching the function's parameters): one call, content None;
- `required`: a JSON array of `{"name", "parameters"}` read by the `json` parser; text that
  is not (an output cut off by `max_tokens`) stays content, with no calls;
- `auto`: the server's parser.
`finish_reason` is vLLM's: `tool_calls` when `auto` found calls, or when `required` ended
with `stop`; a named choice keeps the engine's reason (`stop`, as OpenAI answers a forced
function). With `parallel_tool_calls: false` (`ToolPlan.parallel`) only the first call is
kept (the grammar already allows only one for `required`).
"""

from __future__ import annotations

import uuid
from typing import Any

from tandem.server.tool_choice import ToolPlan
from tandem.server.tool_parsers import (
    DeltaParse,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamer,
)
from tandem.server.tool_parsers.json_calls import JsonCallsStreamer, JsonToolParser


def tool_call_id() -> str:
    """A new call id, vLLM's form: `chatcmpl-tool-<32 hex digits>`."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _extract(plan: ToolPlan, text: str) -> ExtractedToolCalls:
    if plan.mode == "named":
        assert plan.function is not None
        return ExtractedToolCalls(None, [ToolCall(plan.function, text)])
    if plan.mode == "required":
        return JsonToolParser().extract(text)
    if plan.mode == "auto":
        assert plan.parser is not None
        return plan.parser.extract(text)
    return ExtractedToolCalls(text, [])


def _finish_reason(plan: ToolPlan, called: bool, reason: str | None) -> str | None:
    if called and (plan.mode == "auto" or (plan.mode == "required" and reason == "stop")):
        return "tool_calls"
    return reason


def tool_message(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """The message's content and tool calls, and the choice's finish reason."""
    extracted = _extract(plan, text)
    kept = extracted.calls if plan.parallel else extracted.calls[:1]
    calls = [
        {
            "id": tool_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in kept
    ]
    return extracted.content, calls, _finish_reason(plan, bool(calls), finish_reason)


class _NamedStreamer(ToolCallStreamer):
    """The named choice streamed: one call whose arguments are the text as it comes."""

    def __init__(self, function: str) -> None:
        self.function = function
        self.started = False

    def feed(self, text: str) -> DeltaParse:
        if not self.started:
            self.started = True
            return DeltaParse(calls=[ToolCallDelta(0, name=self.function, arguments=text)])
        return DeltaParse(calls=[ToolCallDelta(0, arguments=text)] if text else [])

    def finish(self) -> DeltaParse:
        return DeltaParse() if self.started else self.feed("")


def _streamer(plan: ToolPlan) -> ToolCallStreamer | None:
    if plan.mode == "named":
        assert plan.function is not None
        return _NamedStreamer(plan.function)
    if plan.mode == "required":
        return JsonCallsStreamer()
    if plan.mode == "auto":
        assert plan.parser is not None
        return plan.parser.streamer()
    return None


class ToolCallDeltas:
    """One streamed choice read under a `ToolPlan`. `active` is False for mode `none`
    (the caller then sends the text as content, as without tools)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.streamer = _streamer(plan)
        self.ids: dict[int, str] = {}

    @property
    def active(self) -> bool:
        return self.streamer is not None

    def delta(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content and `tool_calls` entries for the next piece of text (`finished`:
        it is the last piece, so nothing is held back any more)."""
        assert self.streamer is not None
        parsed = self.streamer.feed(text)
        if finished:
            parsed.extend(self.streamer.finish())
        pieces = [p for p in parsed.calls if self.plan.parallel or p.index == 0]
        return parsed.content, [self._entry(piece) for piece in pieces]

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish reason once it ended with `reason`."""
        return _finish_reason(self.plan, bool(self.ids), reason)

    def _entry(self, piece: ToolCallDelta) -> dict[str, Any]:
        if piece.name is None:
            return {"index": piece.index, "function": {"arguments": piece.arguments}}
        call_id = self.ids[piece.index] = tool_call_id()
        return {
            "index": piece.index,
            "id": call_id,
            "type": "function",
            "function": {"name": piece.name, "arguments": piece.arguments},
        }
