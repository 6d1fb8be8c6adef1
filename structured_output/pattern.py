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

The nodes are in `pattern_ast.py`, the parser in `pattern_parser.py`.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from tandem.structured_output.pattern_ast import (
    Anchor,
    Group,
    Node,
    PatternError,
    Repeat,
    Sequence,
    Unit,
    _seq_width,
)
from tandem.structured_output.pattern_parser import _Parser

__all__ = [
    "Anchor",
    "Group",
    "Node",
    "Pattern",
    "PatternError",
    "Repeat",
    "Sequence",
    "Unit",
    "parse_pattern",
]


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
