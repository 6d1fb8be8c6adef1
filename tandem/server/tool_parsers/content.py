"""Content beside tool calls: the whitespace rule both parsers share.

`extract` reports the text outside the calls as content, or None when there were calls
and that text is only whitespace (the newlines a model writes between tags). A stream
cannot know ahead whether calls will come, so `ContentGate` holds leading whitespace back
until a non-whitespace character arrives (then sends it all) and, at the end, sends what
it still holds only when no call was made. Joined, the pieces it lets through equal
`visible_content(...)` of the whole text ("" for None).
"""

from __future__ import annotations


def visible_content(content: str, num_calls: int) -> str | None:
    """The content `extract` reports: None when there were calls and it is blank."""
    if num_calls and not content.strip():
        return None
    return content


class ContentGate:
    """Holds back leading whitespace of streamed content (see the module docstring)."""

    def __init__(self) -> None:
        self._opened = False
        self._held = ""

    def let_through(self, piece: str) -> str:
        """The part of `piece` (after what was held) that may be sent now."""
        if self._opened:
            return piece
        self._held += piece
        if not self._held.strip():
            return ""
        self._opened = True
        piece, self._held = self._held, ""
        return piece

    def finish(self, num_calls: int) -> str:
        """What is still held, when the output made no call ("" otherwise)."""
        held, self._held = self._held, ""
        return held if not num_calls else ""
