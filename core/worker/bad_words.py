"""A request's bad words, indexed by the prefix each one needs before its last token.

vLLM's rule (and tandem's): a bad word's last token is blocked at a row when the word's
other tokens end the row's output history (the prompt does not count); a one-token word
is always blocked. Checking every word at every row costs one list comparison per word
(1,024 words allowed per request: about a millisecond per row in Python). The index groups
the words by prefix length: a row then costs one tuple lookup per distinct length.
"""

from __future__ import annotations

from collections.abc import Sequence


class BadWordIndex:
    """`blocked(history)`: the last tokens of the words whose prefix ends `history`."""

    __slots__ = ("always", "by_length", "longest_prefix")

    def __init__(self, words: Sequence[Sequence[int]]) -> None:
        self.always: list[int] = []
        self.by_length: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for word in words:
            prefix = tuple(word[:-1])
            if not prefix:
                self.always.append(word[-1])
            else:
                self.by_length.setdefault(len(prefix), {}).setdefault(prefix, []).append(word[-1])
        self.longest_prefix = max(self.by_length, default=0)

    def blocked(self, history: Sequence[int]) -> list[int]:
        """Tokens blocked after `history` (the output tokens, then any drafts before the
        row), in no particular order, possibly repeated."""
        blocked = list(self.always)
        for length, prefixes in self.by_length.items():
            if len(history) >= length:
                blocked += prefixes.get(tuple(history[len(history) - length :]), ())
        return blocked
