"""Tool parsers: reading tool calls out of a model's text (see `base` for the contract,
`registry` for how a parser is found by name, `hermes` and `json_calls` for the two
bundled ones)."""

from tandem.server.tool_parsers.base import (
    DeltaParse,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamer,
    ToolParser,
)
from tandem.server.tool_parsers.registry import (
    TOOL_PARSER_GROUP,
    load_tool_parser,
    tool_parser_names,
)

__all__ = [
    "TOOL_PARSER_GROUP",
    "DeltaParse",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamer",
    "ToolParser",
    "load_tool_parser",
    "tool_parser_names",
]
