"""What a tool parser is: the types it returns and the two ways it reads a model's output.

A parser turns the text a model wrote into tool calls and the remaining content.
`extract(text)` reads a whole output; `streamer()` gives a fresh `ToolCallStreamer` that
reads the same output in pieces as it is generated (`feed(delta)` for each piece, then
`finish()`), returning `DeltaParse`s.

The streaming contract, for an output whose calls are well formed (each call a JSON object
whose arguments are an object, or a string holding one):
- call indices start at 0 and grow by one, in the order the calls appear;
- the first delta of call i carries its `name`; later ones carry only argument fragments;
- the argument fragments of call i, joined, equal `extract(text).calls[i].arguments`;
- the content pieces, joined, equal `extract(text).content` ("" where that is None);
whatever the text's split into pieces. An output cut off inside a call, or a call whose
JSON turns out malformed after its name was streamed, cannot be taken back: the stream
then holds what was sent while `extract` reports the text as content (vLLM's parsers
behave the same way).

`ToolCall.arguments` is the JSON text of the call's arguments as the model wrote it
(leading and trailing whitespace removed), so streamed fragments join to it exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """A whole output read by a parser. `content` is the text outside the calls; None when
    there were calls and that text is only whitespace."""

    content: str | None
    calls: list[ToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call `index`: its `name` on the first piece, then argument fragments."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class DeltaParse:
    """What one piece of streamed output added: content text and call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: DeltaParse) -> DeltaParse:
        """This delta followed by `other` (content appended, call pieces merged by index
        when the last piece and `other`'s first continue the same call)."""
        self.content += other.content
        for piece in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == piece.index and piece.name is None:
                last.arguments += piece.arguments
            else:
                self.calls.append(piece)
        return self


class ToolCallStreamer(ABC):
    """Reads one output in pieces (one streamer per output sequence)."""

    @abstractmethod
    def feed(self, text: str) -> DeltaParse:
        """The content and call pieces that `text`, the output's next piece, completes.
        Text that may still turn out to belong to a call is held back."""

    @abstractmethod
    def finish(self) -> DeltaParse:
        """The output ended: everything still held back (content, or a call's last
        pieces)."""


class ToolParser(ABC):
    """A named way of reading tool calls out of model text.

    A parser class is found by its `name` through the entry-point group
    `tandem.tool_parsers` (see `tandem.server.tool_parsers.registry`), constructed once
    per server with the model's tokenizer (None for a model without one), and shared by
    every request: `extract` and `streamer` must not keep per-request state on `self`.
    """

    #: The name `tandem serve --tool-call-parser NAME` selects.
    name: ClassVar[str]

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole output and the content around them."""

    @abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """A fresh incremental reader for one output."""
