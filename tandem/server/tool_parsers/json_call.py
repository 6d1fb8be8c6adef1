"""One JSON object read as a tool call, whole or in pieces.

`CallScanner` scans an object `{"name": ..., "arguments": {...}}` character by character
(strings and escapes, nesting of `{}`/`[]`, and the members of the outermost object): it
knows the call's `name` as soon as that string is closed and where the `arguments` (or
`parameters`) value starts and ends in the text, so the arguments can be streamed as the
model writes them. The scan is structural; `call()` checks the finished object with
`json.loads` before calling it a call.

`CallStream` turns a scanner's progress into `ToolCallDelta`s for one call index: the name
first (with whatever arguments are already known), then each new fragment of the
arguments' text. Arguments given as a JSON string (`"arguments": "{\"a\": 1}"`) are sent
decoded, in one piece, once the string is closed; a call without arguments gets `{}`.
"""

from __future__ import annotations

import json
from bisect import bisect_right

from tandem.server.tool_parsers.base import ToolCall, ToolCallDelta

#: Member names that hold a call's arguments (the first one present is used).
ARGUMENT_KEYS = ("arguments", "parameters")
JSON_WHITESPACE = " \t\r\n"


class _Pieces:
    """Text kept as the pieces it arrived in: appending costs O(1) and a slice its own
    length, so streaming a long call stays linear in its size."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.starts: list[int] = []
        self.length = 0

    def append(self, piece: str) -> None:
        if piece:
            self.starts.append(self.length)
            self.parts.append(piece)
            self.length += len(piece)

    def truncate(self, length: int) -> None:
        """Keep the first `length` characters (a cut inside the last piece)."""
        while self.parts and self.starts[-1] >= length:
            self.parts.pop()
            self.starts.pop()
        if self.parts:
            self.parts[-1] = self.parts[-1][: length - self.starts[-1]]
        self.length = min(self.length, length)

    def slice(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        i = bisect_right(self.starts, start) - 1
        out, pos = [], start
        while pos < end:
            first = self.starts[i]
            out.append(self.parts[i][pos - first : end - first])
            pos = first + len(self.parts[i])
            i += 1
        return "".join(out)

    def __str__(self) -> str:
        if len(self.parts) > 1:
            self.parts, self.starts = ["".join(self.parts)], [0]
        return self.parts[0] if self.parts else ""


class CallScanner:
    """Scans one JSON object fed in pieces. `text` is everything fed up to the object's
    closing brace (leading whitespace included); positions below index into it.

    Invariants: `done` and `failed` are never both true; once either is, `feed` consumes
    nothing more. `args_start` is the index of the first character of the arguments value
    (-1 before it is seen); `args_end` is one past its last character (-1 until it ends).
    """

    def __init__(self) -> None:
        self._text = _Pieces()
        self.done = False
        self.failed = False
        self.name: str | None = None
        self.args_key: str | None = None
        self.args_start = -1
        self.args_end = -1
        self._stack: list[str] = []
        self._in_string = False
        self._escape = False
        #: The outermost object's member state: key, colon, value, in_value, next.
        self._expect = "key"
        self._key: str | None = None
        self._key_start = -1
        self._value_start = -1

    def feed(self, chunk: str) -> int:
        """Scan `chunk`; return how many of its characters were taken (all of them, unless
        the object closed or turned out not to be one inside it)."""
        base = self._text.length
        self._text.append(chunk)
        for i, ch in enumerate(chunk):
            if self.done or self.failed:
                self._text.truncate(base + i)
                return i
            self._step(ch, base + i)
        return len(chunk)

    @property
    def text(self) -> str:
        """Everything taken so far."""
        return str(self._text)

    def slice(self, start: int, end: int) -> str:
        """`text[start:end]`, costing only its length."""
        return self._text.slice(start, end)

    def arguments_end(self) -> int:
        """One past the arguments written so far (their end once they closed)."""
        return self.args_end if self.args_end >= 0 else self._text.length

    def arguments_so_far(self) -> str:
        """The arguments value's text written so far ("" before it starts)."""
        if self.args_start < 0:
            return ""
        return self.slice(self.args_start, self.arguments_end())

    def call(self) -> ToolCall | None:
        """The finished object as a call, or None: not finished, not valid JSON, no string
        `name`, or arguments that are not an object (or a string holding one)."""
        if not self.done or self.name is None:
            return None
        try:
            obj = json.loads(self.text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") != self.name:
            return None
        if self.args_key is None:
            return ToolCall(self.name, "{}")
        value = obj[self.args_key]
        if isinstance(value, dict):
            return ToolCall(self.name, self.arguments_so_far())
        decoded = _decoded_arguments(value)
        return ToolCall(self.name, decoded) if decoded is not None else None

    # The scan ----------------------------------------------------------------------------

    def _step(self, ch: str, pos: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if len(self._stack) == 1:
                    self._string_closed(pos)
            return
        if not self._stack:
            if ch == "{":
                self._stack.append(ch)
            elif ch not in JSON_WHITESPACE:
                self.failed = True
            return
        depth = len(self._stack)
        if ch == '"':
            self._in_string = True
            if depth == 1:
                self._member_string(pos)
        elif ch in "{[":
            if depth == 1:
                if self._expect != "value":
                    self.failed = True
                    return
                self._start_value(pos)
            self._stack.append(ch)
        elif ch in "}]":
            self._close(ch, pos, depth)
        elif depth == 1:
            self._member_char(ch, pos)

    def _member_string(self, pos: int) -> None:
        if self._expect == "key":
            self._key_start = pos
        elif self._expect == "value":
            self._start_value(pos)
        else:
            self.failed = True

    def _string_closed(self, pos: int) -> None:
        if self._expect == "key":
            try:
                self._key = json.loads(self.slice(self._key_start, pos + 1))
            except ValueError:
                self.failed = True
                return
            self._expect = "colon"
        elif self._expect == "in_value":
            self._end_value(pos + 1)

    def _close(self, ch: str, pos: int, depth: int) -> None:
        if self._stack[-1] != ("{" if ch == "}" else "["):
            self.failed = True
            return
        self._stack.pop()
        if depth == 2 and self._expect == "in_value":
            self._end_value(pos + 1)
        elif depth == 1:
            if self._expect == "in_value":
                self._end_value(pos)
            self.done = True

    def _member_char(self, ch: str, pos: int) -> None:
        """A character between the outermost object's strings and containers."""
        expect = self._expect
        if ch in JSON_WHITESPACE:
            if expect == "in_value":
                self._end_value(pos)
        elif ch == ":" and expect == "colon":
            self._expect = "value"
        elif ch == ",":
            if expect == "in_value":
                self._end_value(pos)
            elif expect != "next":
                self.failed = True
                return
            self._expect = "key"
        elif expect == "value":
            self._start_value(pos)
        elif expect != "in_value":
            self.failed = True

    def _start_value(self, pos: int) -> None:
        self._value_start = pos
        self._expect = "in_value"
        if self._key in ARGUMENT_KEYS and self.args_key is None:
            self.args_key = self._key
            self.args_start = pos

    def _end_value(self, end: int) -> None:
        if (
            self._key == "name"
            and self.name is None
            and self.slice(self._value_start, self._value_start + 1) == '"'
        ):
            try:
                name = json.loads(self.slice(self._value_start, end))
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) else None
        if self._value_start == self.args_start:
            self.args_end = end
        self._expect = "next"


def _decoded_arguments(value: object) -> str | None:
    """Arguments given as a JSON string: its text when that is a JSON object, else None."""
    if not isinstance(value, str):
        return None
    try:
        inner = json.loads(value)
    except ValueError:
        return None
    return value.strip() if isinstance(inner, dict) else None


class CallStream:
    """Streams call `index` out of its `CallScanner` (see the module docstring)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.scanner = CallScanner()
        self.named = False
        self._sent = 0
        self._sent_whole = False

    def feed(self, chunk: str) -> tuple[int, list[ToolCallDelta]]:
        """Scan `chunk`: the characters taken and the pieces they complete."""
        used = self.scanner.feed(chunk)
        return used, self._pieces()

    def _pieces(self) -> list[ToolCallDelta]:
        scanner = self.scanner
        pieces: list[ToolCallDelta] = []
        if not self.named:
            if scanner.name is None:
                return pieces
            self.named = True
            pieces.append(ToolCallDelta(self.index, name=scanner.name))
        fragment = self._new_arguments()
        if fragment:
            if pieces:
                pieces[0].arguments = fragment
            else:
                pieces.append(ToolCallDelta(self.index, arguments=fragment))
        return pieces

    def _new_arguments(self) -> str:
        scanner = self.scanner
        if self._sent_whole:
            return ""
        if scanner.args_start < 0:
            if scanner.done:
                self._sent_whole = True
                return "{}"
            return ""
        start, end = scanner.args_start, scanner.arguments_end()
        if scanner.slice(start, start + 1) == "{":
            fragment = scanner.slice(start + self._sent, end)
            self._sent = end - start
            return fragment
        if scanner.args_end >= 0:
            self._sent_whole = True
            try:
                decoded = _decoded_arguments(json.loads(scanner.slice(start, end)))
            except ValueError:
                decoded = None
            return decoded or ""
        return ""
