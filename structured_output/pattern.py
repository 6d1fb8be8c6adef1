"""A JSON schema's `pattern`, parsed, so that it can be handed to a backend safely.

JSON Schema's `pattern` is unanchored (`re.search`); both backends match a string's whole
content instead (`re.fullmatch`), which accepts a subset of the strings: anchors at the
ends of the top-level alternatives can be dropped, since a full match of `a|b` also
matches `^a|b$`. What this module does with a pattern:

- `parse_pattern`: a small AST (units, groups, repeats, anchors); refuses what neither
  backend compiles as a regular language (lookaround, backreferences, word boundaries,
  inline flags, possessive quantifiers) and syntax Python's `re` rejects.
- `Pattern.strip_anchors`: the anchor-free form, wrapped in one group by `source`
  (outlines-core pastes a pattern between quotes, where a bare `a|b` would split the
  quotes between the alternatives).
- `Pattern.fold_lengths(min_length, max_length)`: `minLength`/`maxLength` folded into
  the pattern (backends ignore one beside the other): per top-level alternative, kept
  when its length range already lies inside the bounds, dropped when outside, and
  otherwise narrowed through its one variable-length repeat of a one-character unit
  (`[a-z]+` with maxLength 6 becomes `[a-z]{1,6}`). Anything else cannot be folded.
- `Pattern.source(json_safe=True)`: the form for outlines-core, which matches the pattern
  against the raw JSON text of the string: `.`, negated classes and `\\D`/`\\S`/`\\W`
  exclude `"`, `\\` and control characters (else the model may close the string early or
  write an escape that decodes to something the pattern never allowed), and a literal
  quote or backslash becomes its JSON escape.
"""

from __future__ import annotations

import re
import warnings
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


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, what: str) -> PatternError:
        return PatternError(f"{what} (at offset {self.pos})")

    def peek(self, n: int = 1) -> str:
        return self.text[self.pos : self.pos + n]

    def alternatives(self) -> list[Sequence]:
        alts: list[Sequence] = [[]]
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c == ")":
                break
            if c == "|":
                self.pos += 1
                alts.append([])
                continue
            atom = self.atom()
            if isinstance(atom, (Unit, Group)):
                atom = self.quantified(atom)
            alts[-1].append(atom)
        return alts

    def atom(self) -> Unit | Group | Anchor:
        c = self.text[self.pos]
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_class()
        if c == "\\":
            return self.escape()
        if c in "^$":
            self.pos += 1
            return Anchor(c)
        if c in "*+?":
            raise self.error(f"nothing to repeat before {c!r}")
        if c == "{" and re.match(r"\{\d+(,\d*)?\}", self.text[self.pos :]):
            raise self.error("nothing to repeat before '{'")
        self.pos += 1
        return Unit(c, "dot" if c == "." else "literal")

    def group(self) -> Group:
        rest = self.text[self.pos :]
        if rest.startswith(("(?=", "(?!", "(?<=", "(?<!")):
            raise self.error("lookaround ((?=, (?!, (?<=, (?<!) is not a regular language")
        if rest.startswith("(?P="):
            raise self.error("backreferences are not a regular language")
        match = re.match(r"\(\?(?::|P?<[A-Za-z_][A-Za-z0-9_]*>)", rest)
        if match:
            self.pos += match.end()
        elif rest.startswith("(?"):
            raise self.error("inline flags and other (? constructs are not supported")
        else:
            self.pos += 1
        alts = self.alternatives()
        if self.peek() != ")":
            raise self.error("missing ')'")
        self.pos += 1
        return Group(alts)

    def char_class(self) -> Unit:
        start = self.pos
        self.pos += 1
        if self.peek() == "^":
            self.pos += 1
        if self.peek() == "]":
            self.pos += 1
        while self.pos < len(self.text) and self.text[self.pos] != "]":
            c = self.text[self.pos]
            if c == "\\":
                self.pos += 2
            elif c == "[" or self.peek(2) in ("&&", "--", "~~"):
                raise self.error("nested classes and class set operations are not supported")
            else:
                self.pos += 1
        if self.pos >= len(self.text):
            raise self.error("missing ']'")
        self.pos += 1
        return Unit(self.text[start : self.pos], "class")

    def escape(self) -> Unit:
        start = self.pos
        if self.pos + 1 >= len(self.text):
            raise self.error("a trailing backslash")
        c = self.text[self.pos + 1]
        self.pos += 2
        if c in "bB":
            raise self.error("word boundaries (\\b, \\B) are not supported")
        if c.isdigit() and c != "0" or c == "k":
            raise self.error("backreferences are not a regular language")
        if c in "pP":
            match = re.match(r"\{[^}]*\}|[A-Za-z]", self.text[self.pos :])
            if match is None:
                raise self.error("a malformed \\p escape")
            self.pos += match.end()
        elif c == "x":
            match = re.match(r"[0-9A-Fa-f]{2}|\{[0-9A-Fa-f]+\}", self.text[self.pos :])
            if match is None:
                raise self.error("a malformed \\x escape")
            self.pos += match.end()
        elif c == "u":
            match = re.match(r"[0-9A-Fa-f]{4}|\{[0-9A-Fa-f]+\}", self.text[self.pos :])
            if match is None:
                raise self.error("a malformed \\u escape")
            self.pos += match.end()
        elif c == "c":
            self.pos += 1
        return Unit(self.text[start : self.pos], "escape")

    def quantified(self, atom: Unit | Group) -> Unit | Group | Repeat:
        node: Unit | Group | Repeat = atom
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c in "*+?":
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                self.pos += 1
            elif c == "{":
                match = re.match(r"\{(\d+)(,(\d*))?\}", self.text[self.pos :])
                if match is None:
                    return node
                lo = int(match.group(1))
                hi = (
                    lo
                    if match.group(2) is None
                    else (int(match.group(3)) if match.group(3) else None)
                )
                if hi is not None and hi < lo:
                    raise self.error(f"a repeat {match.group(0)} with max < min")
                self.pos += match.end()
            else:
                return node
            if self.peek() == "+":
                raise self.error("possessive quantifiers are not supported")
            if self.peek() == "?":
                self.pos += 1  # lazy: the language is the same
            if isinstance(node, Repeat):
                node = Group([[node]])
            node = Repeat(node, lo, hi)
        return node


@dataclass
class Pattern:
    """A parsed pattern: its top-level alternatives."""

    alternatives: list[Sequence]

    def strip_anchors(self) -> Pattern:
        """The anchor-free pattern (a full match of it is a search match of the original).

        Raises PatternError for anchors anywhere but the ends of top-level alternatives."""
        stripped = []
        for seq in self.alternatives:
            seq = list(seq)
            while seq and isinstance(seq[0], Anchor) and seq[0].text == "^":
                seq.pop(0)
            while seq and isinstance(seq[-1], Anchor) and seq[-1].text == "$":
                seq.pop()
            if _has_anchor(seq):
                raise PatternError(
                    "anchors (^, $) are supported only at the start and end of the pattern"
                )
            stripped.append(seq)
        return Pattern(stripped)

    def width(self) -> tuple[int, int | None]:
        return Group(self.alternatives).width()

    def fold_lengths(self, min_length: int, max_length: int | None) -> Pattern | None:
        """The pattern restricted to lengths in [min_length, max_length] (anchor-free), or
        None when some alternative cannot be restricted. Raises PatternError when no
        string of the pattern has such a length."""
        kept: list[Sequence] = []
        for seq in self.alternatives:
            for alt in _flatten(seq):
                lo, hi = _seq_width(alt)
                if lo >= min_length and (
                    max_length is None or (hi is not None and hi <= max_length)
                ):
                    kept.append(alt)
                    continue
                if (max_length is not None and lo > max_length) or (
                    hi is not None and hi < min_length
                ):
                    continue
                folded = _fold(alt, min_length, max_length)
                if folded is None:
                    return None
                kept.append(folded)
        if not kept:
            raise PatternError(
                f"no string of the pattern has a length in [{min_length}, "
                f"{'inf' if max_length is None else max_length}]"
            )
        return Pattern(kept)

    def source(self, json_safe: bool = False) -> str:
        """The pattern as one group (`(?:a|b)`); `json_safe`: the outlines-core form."""
        return Group(self.alternatives).source(json_safe)


def _has_anchor(seq: Sequence) -> bool:
    for node in seq:
        if isinstance(node, Anchor):
            return True
        inner = node.node if isinstance(node, Repeat) else node
        if isinstance(inner, Group) and any(_has_anchor(s) for s in inner.alternatives):
            return True
    return False


def _flatten(seq: Sequence) -> list[Sequence]:
    """A sequence that is one group, as that group's alternatives (recursively)."""
    if len(seq) == 1 and isinstance(seq[0], Group):
        return [alt for s in seq[0].alternatives for alt in _flatten(s)]
    return [seq]


def _fold(seq: Sequence, min_length: int, max_length: int | None) -> Sequence | None:
    """`seq` with its single variable-length repeat of a one-character unit narrowed so
    that the total length lies in the bounds; None when `seq` has another shape."""
    variable = [i for i, node in enumerate(seq) if node.width()[0] != node.width()[1]]
    if len(variable) != 1:
        return None
    i = variable[0]
    node = seq[i]
    if not isinstance(node, Repeat) or node.node.width() != (1, 1):
        return None
    fixed = sum(n.width()[0] for j, n in enumerate(seq) if j != i)
    lo = max(node.lo, min_length - fixed)
    hi = (
        node.hi
        if max_length is None
        else (max_length - fixed if node.hi is None else min(node.hi, max_length - fixed))
    )
    if hi is not None and hi < lo:
        return None
    return [*seq[:i], Repeat(node.node, lo, hi), *seq[i + 1 :]]


def parse_pattern(text: str) -> Pattern:
    """Parse a JSON-schema `pattern`; raises PatternError naming the unsupported feature."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # nested sets: refused below
            re.compile(text)
    except re.error as exc:
        raise PatternError(f"invalid regex: {exc}") from None
    parser = _Parser(text)
    alts = parser.alternatives()
    if parser.pos != len(text):
        raise parser.error("unbalanced ')'")
    return Pattern(alts)
