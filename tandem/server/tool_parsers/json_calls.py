"""The JSON-only parser (`--tool-call-parser json`): the whole output is the call(s).

The output, whitespace aside, is one call object `{"name": "f", "arguments": {...}}` or
an array of them (`parameters` is accepted for `arguments`, as Llama 3's JSON format and
vLLM's `required` schema write it). Anything else (text, other JSON, a malformed call) is
content, unchanged. The grammar-enforced `tool_choice: "required"` output is read with
this parser whatever `--tool-call-parser` names.

Streaming (`JsonCallsStreamer`): text is held until the first call's name is known (or
the text is known not to be calls, then it is sent as content); from then on each call's
name and argument fragments are sent as they are written.
"""

from __future__ import annotations

import json

from tandem.server.tool_parsers.base import (
    DeltaParse,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
)
from tandem.server.tool_parsers.json_call import JSON_WHITESPACE, CallScanner, CallStream


class JsonToolParser(ToolParser):
    """The output is a call object or an array of call objects."""

    name = "json"

    def extract(self, text: str) -> ExtractedToolCalls:
        calls = json_calls(text)
        if calls is None:
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, calls)

    def streamer(self) -> JsonCallsStreamer:
        return JsonCallsStreamer()


def json_calls(text: str) -> list[ToolCall] | None:
    """The calls of an output that is a call object or a non-empty array of them; None
    for any other text."""
    stripped = text.strip(JSON_WHITESPACE)
    if not stripped or stripped[0] not in "{[":
        return None
    try:
        value = json.loads(stripped)
    except ValueError:
        return None
    if isinstance(value, dict):
        scanner = CallScanner()
        scanner.feed(stripped)
        call = scanner.call()
        return [call] if call is not None else None
    if not isinstance(value, list) or not value:
        return None
    calls, pos = [], 1
    for _ in value:  # the array parsed: elements are separated by "," and whitespace
        scanner = CallScanner()
        pos += scanner.feed(stripped[pos:])
        call = scanner.call()
        if call is None:
            return None
        calls.append(call)
        while stripped[pos] in JSON_WHITESPACE:
            pos += 1
        pos += 1  # the "," or "]" after the element
    return calls


class JsonCallsStreamer(ToolCallStreamer):
    """`JsonToolParser` read in pieces. States: `start` (before the first non-whitespace
    character), `object`/`item` (scanning a call), `next` (after `[` or `,`: a call or
    `]`), `after_item` (`,` or `]`), `text` (not calls: everything is content), `done`
    (after the calls: the rest is ignored)."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"
        self._held = ""
        self._committed = False
        self._call: CallStream | None = None
        self._num_calls = 0

    def feed(self, text: str) -> DeltaParse:
        self._buf += text
        out = DeltaParse()
        while self._step(out):
            pass
        return out

    def finish(self) -> DeltaParse:
        out = DeltaParse()
        if not self._committed:
            out.content = self._held + self._buf
        self._held = self._buf = ""
        return out

    def _step(self, out: DeltaParse) -> bool:
        state = self._state
        if state == "text":
            out.content += self._buf
            self._buf = ""
            return False
        if state == "done":
            self._buf = ""
            return False
        if state in ("object", "item"):
            return self._in_call(out)
        rest = self._buf.lstrip(JSON_WHITESPACE)
        self._hold(self._buf[: len(self._buf) - len(rest)])
        self._buf = rest
        if not rest:
            return False
        ch = rest[0]
        if ch == "{" and state in ("start", "next"):
            self._state = "object" if state == "start" else "item"
            self._call = CallStream(self._num_calls)
            return True
        if (ch == "[" and state == "start") or (ch == "," and state == "after_item"):
            self._take(1)
            self._state = "next"
            return True
        if ch == "]" and state in ("next", "after_item"):
            self._take(1)
            return self._end(out)
        return self._give_up(out)

    def _in_call(self, out: DeltaParse) -> bool:
        assert self._call is not None
        if not self._buf:
            return False
        used, pieces = self._call.feed(self._buf)
        self._take(used)
        if pieces:
            self._committed, self._held = True, ""
            out.extend(DeltaParse(calls=pieces))
        scanner = self._call.scanner
        if scanner.failed or (scanner.done and not self._call.named):
            return self._give_up(out)
        if not scanner.done:
            return False
        self._num_calls += 1
        self._state = "done" if self._state == "object" else "after_item"
        return True

    def _take(self, n: int) -> None:
        self._hold(self._buf[:n])
        self._buf = self._buf[n:]

    def _hold(self, text: str) -> None:
        if not self._committed:
            self._held += text

    def _end(self, out: DeltaParse) -> bool:
        if not self._committed:
            return self._give_up(out)
        self._state = "done"
        return True

    def _give_up(self, out: DeltaParse) -> bool:
        """Not calls after all: what was held and what follows is content (once a call
        was sent, the rest is ignored instead)."""
        if self._committed:
            self._state, self._buf = "done", ""
            return False
        out.content += self._held + self._buf
        self._held, self._buf, self._state = "", "", "text"
        return False
