"""The parsed form of a JSON schema `pattern`: its nodes and how each writes itself back.

`Unit` (one character: literal, escape, class, `.`), `Anchor`, `Repeat` and `Group` each
know their length range (`width`) and their regex text (`source`); `source(json_safe=True)`
is the outlines-core form, which never matches `"`, `\\` or a control character raw (see
`pattern.py`). `PatternError` is the one error of the pattern modules. The parser is in
`pattern_parser.py`; what is done with a parsed pattern is in `pattern.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Characters a raw JSON string cannot contain, as a class body (outlines dialect).
_JSON_UNSAFE = '"\\\\\\x00-\\x1f'
_SAFE_ANY = f"[^{_JSON_UNSAFE}]"
_CLASS_ESCAPES = set("dDwWsS")
_NEGATED_ESCAPES = set("DWS")
_CONTROL_ESCAPES = {"n": "\\\\n", "t": "\\\\t", "r": "\\\\r", "f": "\\\\f"}


class PatternError(ValueError):
    """The pattern uses a feature the backends cannot compile, or does not parse."""


@dataclass
class Unit:
    """One character: a literal, an escape, a class or `.`."""

    text: str
    kind: str  # "literal", "escape", "class", "dot"

    def width(self) -> tuple[int, int | None]:
        return 1, 1

    def source(self, json_safe: bool) -> str:
        if not json_safe:
            return self.text
        if self.kind == "dot":
            return _SAFE_ANY
        if self.kind == "class":
            negated = self.text.startswith("[^")
            body = self.text[2:-1] if negated else self.text[1:-1]
            if negated:
                return f"[^{body}{_JSON_UNSAFE}]"
            return f"[{body}--[{_JSON_UNSAFE}]]"
        if self.kind == "escape":
            letter = self.text[1]
            if letter in _NEGATED_ESCAPES or self.text.startswith("\\P"):
                return f"[{self.text}--[{_JSON_UNSAFE}]]"
            if letter == "s":
                return "[\\s--[\\x00-\\x1f]]"
            if letter in _CONTROL_ESCAPES:
                return _CONTROL_ESCAPES[letter]
            if letter in "vc0":
                raise PatternError(
                    f"{self.text!r} matches a control character, which a JSON string "
                    "cannot hold unescaped"
                )
            if letter == "\\":
                return "\\\\\\\\"
            if letter == '"':
                return '\\\\"'
            if letter in "xu":
                char = _hex_char(self.text)
                if char is not None:
                    return _json_literal(char)
            return self.text
        return _json_literal(self.text)


def _hex_char(text: str) -> str | None:
    digits = text[2:].strip("{}")
    try:
        return chr(int(digits, 16))
    except ValueError:
        return None


def _json_literal(char: str) -> str:
    """A regex (outlines dialect) of `char` as it appears inside a JSON string."""
    if char == '"':
        return '\\\\"'
    if char == "\\":
        return "\\\\\\\\"
    if ord(char) < 0x20:
        escape = {"\n": "n", "\t": "t", "\r": "r", "\f": "f", "\b": "b"}.get(char)
        if escape is None:
            raise PatternError(f"the pattern matches control character {char!r}")
        return "\\\\" + escape
    if char in "<>":  # `\<`/`\>` are word boundaries in the Rust dialect
        return char
    if not char.isalnum() and char.isascii() and char not in " _":
        return "\\" + char
    return char


@dataclass
class Anchor:
    text: str  # "^" or "$"

    def width(self) -> tuple[int, int | None]:
        return 0, 0

    def source(self, json_safe: bool) -> str:
        return self.text


@dataclass
class Repeat:
    node: Unit | Group
    lo: int
    hi: int | None

    def width(self) -> tuple[int, int | None]:
        lo, hi = self.node.width()
        return lo * self.lo, (None if hi is None or self.hi is None else hi * self.hi)

    def source(self, json_safe: bool) -> str:
        inner = self.node.source(json_safe)
        if (self.lo, self.hi) == (0, None):
            quant = "*"
        elif (self.lo, self.hi) == (1, None):
            quant = "+"
        elif (self.lo, self.hi) == (0, 1):
            quant = "?"
        elif self.lo == self.hi:
            quant = f"{{{self.lo}}}"
        else:
            quant = f"{{{self.lo},{'' if self.hi is None else self.hi}}}"
        return inner + quant


Node = Unit | Anchor | Repeat
Sequence = list["Node | Group"]


@dataclass
class Group:
    alternatives: list[Sequence] = field(default_factory=list)

    def width(self) -> tuple[int, int | None]:
        widths = [_seq_width(s) for s in self.alternatives]
        lo = min(w[0] for w in widths)
        his = [w[1] for w in widths]
        return lo, (None if any(h is None for h in his) else max(h for h in his if h is not None))

    def source(self, json_safe: bool) -> str:
        return "(?:" + "|".join(_seq_source(s, json_safe) for s in self.alternatives) + ")"


def _seq_width(seq: Sequence) -> tuple[int, int | None]:
    lo, hi = 0, 0
    for node in seq:
        a, b = node.width()
        lo += a
        hi = None if hi is None or b is None else hi + b
    return lo, hi


def _seq_source(seq: Sequence, json_safe: bool) -> str:
    return "".join(node.source(json_safe) for node in seq)
