"""The Hermes-style parser (`--tool-call-parser hermes`): calls in `<tool_call>` tags.

A call is `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` (whitespace around
the JSON allowed; the closing tag may be missing at the end of the output). Text outside
the tags is content (None when it is only whitespace and there were calls). A tag whose
body is not a call object (see `CallScanner.call`) stays in the content as written, from
the opening tag through the closing one. Used by Hermes, Qwen 2.5/3 and many fine-tunes.

Streaming (`HermesStreamer`): content is sent as it comes except a trailing piece that
may be the start of `<tool_call>` (held until it is or is not), a call's name as soon as
its string closes, and its arguments as the model writes them.
"""

from __future__ import annotations

from tandem.server.tool_parsers.base import (
    DeltaParse,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
)
from tandem.server.tool_parsers.content import ContentGate, visible_content
from tandem.server.tool_parsers.json_call import JSON_WHITESPACE, CallScanner, CallStream

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    """Calls in `<tool_call>...</tool_call>` tags; text outside them is content."""

    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(START, pos)) >= 0:
            content.append(text[pos:start])
            body = start + len(START)
            scanner = CallScanner()
            after = body + scanner.feed(text[body:])
            call = scanner.call()
            if call is None:  # not a call: the tag stays content through its closing tag
                close = text.find(END, body)
                pos = len(text) if close < 0 else close + len(END)
                content.append(text[start:pos])
                continue
            calls.append(call)
            pos = _skip_whitespace(text, after)
            if text.startswith(END, pos):
                pos += len(END)
        content.append(text[pos:])
        return ExtractedToolCalls(visible_content("".join(content), len(calls)), calls)

    def streamer(self) -> HermesStreamer:
        return HermesStreamer()


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in JSON_WHITESPACE:
        pos += 1
    return pos


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesStreamer(ToolCallStreamer):
    """`HermesToolParser` read in pieces. States: `text` (content, watching for the
    opening tag), `call` (inside a tag, scanning the call object), `after` (the object
    closed; skipping whitespace and the closing tag)."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "text"
        self._call: CallStream | None = None
        self._raw = ""
        self._num_calls = 0
        self._gate = ContentGate()

    def feed(self, text: str) -> DeltaParse:
        self._buf += text
        out = DeltaParse()
        while self._step(out):
            pass
        out.content = self._gate.let_through(out.content)
        return out

    def finish(self) -> DeltaParse:
        out = DeltaParse()
        if self._state == "text" or self._state == "after":
            out.content = self._buf
        elif self._call is not None and not self._call.named:
            out.content = START + self._raw + self._buf
        self._buf = ""
        out.content = self._gate.let_through(out.content)
        out.content += self._gate.finish(self._num_calls)
        return out

    def _step(self, out: DeltaParse) -> bool:
        """Advance one state; True when there may be more to do."""
        if self._state == "text":
            return self._text(out)
        if self._state == "call":
            return self._in_call(out)
        return self._after_call()

    def _text(self, out: DeltaParse) -> bool:
        start = self._buf.find(START)
        if start >= 0:
            out.content += self._buf[:start]
            self._buf = self._buf[start + len(START) :]
            self._state, self._call, self._raw = "call", CallStream(self._num_calls), ""
            return True
        keep = _partial_tag(self._buf, START)
        cut = len(self._buf) - keep
        out.content += self._buf[:cut]
        self._buf = self._buf[cut:]
        return False

    def _in_call(self, out: DeltaParse) -> bool:
        assert self._call is not None
        if not self._buf:
            return False
        used, pieces = self._call.feed(self._buf)
        if not self._call.named:  # kept only while the tag may still turn out not a call
            self._raw += self._buf[:used]
        self._buf = self._buf[used:]
        out.extend(DeltaParse(calls=pieces))
        scanner = self._call.scanner
        if not (scanner.done or scanner.failed):
            return False
        if self._call.named:
            self._num_calls += 1
            self._state = "after" if scanner.done else "text"
        else:  # not a call: the tag and its text are content
            out.content += START + self._raw
            self._state = "text"
        self._call = None
        return True

    def _after_call(self) -> bool:
        rest = self._buf.lstrip(JSON_WHITESPACE)
        if rest.startswith(END):
            self._buf, self._state = rest[len(END) :], "text"
            return True
        self._buf = rest
        if not rest or END.startswith(rest):
            return False
        self._state = "text"
        return True
