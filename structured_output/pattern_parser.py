"""The parser of a JSON schema `pattern` into the nodes of `pattern_ast.py`.

`_Parser` reads the text left to right once (alternatives, atoms, groups, classes,
escapes, quantifiers) and raises `PatternError` for what neither backend compiles as a
regular language: lookaround, backreferences, word boundaries, inline flags, possessive
quantifiers, nested classes. `pattern.parse_pattern` is its entry point; the underscored
name is shared with `pattern.py` and is not part of the package's API.
"""

from __future__ import annotations

import re

from tandem.structured_output.pattern_ast import (
    Anchor,
    Group,
    PatternError,
    Repeat,
    Sequence,
    Unit,
)


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
