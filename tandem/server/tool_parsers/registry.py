"""Finding a tool parser by name: the entry-point group `tandem.tool_parsers`.

A parser is a `ToolParser` subclass declared as an entry point of that group; the entry
point's name is the name `tandem serve --tool-call-parser NAME` takes. tandem's own
parsers (`hermes`, `json`) are declared in its `pyproject.toml` exactly as a third-party
package declares its own:

    [project.entry-points."tandem.tool_parsers"]
    my-format = "my_package.parser:MyToolParser"

`pip install` the package and the name is available. A class can also be named by its
import path, `module:Class`, without packaging it. Parsers are not engine plugins: they
run in the API server on the text the engine returns, so they do not go in a stack.
"""

from __future__ import annotations

from tandem.core.entry_points import plugin_entry_points
from tandem.server.tool_parsers.base import ToolParser

TOOL_PARSER_GROUP = "tandem.tool_parsers"


def tool_parser_names() -> list[str]:
    """The names of the installed parsers, sorted."""
    return sorted({ep.name for ep in plugin_entry_points(TOOL_PARSER_GROUP)})


def load_tool_parser(name: str) -> type[ToolParser]:
    """The parser class named `name` (an entry point of `tandem.tool_parsers`, or
    `module:Class`). ValueError naming `--tool-call-parser`, the name and the installed
    parsers when it is unknown, fails to import, or is not a `ToolParser`."""
    found = [ep for ep in plugin_entry_points(TOOL_PARSER_GROUP) if ep.name == name]
    where = f"--tool-call-parser: {name!r}"
    if not found and ":" not in name:
        installed = ", ".join(tool_parser_names()) or "none"
        raise ValueError(
            f"{where} is not an installed tool parser; installed: {installed} (entry-point "
            f"group {TOOL_PARSER_GROUP!r}; or name a class as module:Class)"
        )
    try:
        if found:
            cls = found[0].load()
        else:
            from tandem.core.plugin_manager import import_class

            cls = import_class(name)
    except Exception as exc:  # noqa: BLE001 - a broken parser package is reported, not fatal
        raise ValueError(f"{where} failed to import: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise ValueError(
            f"{where} is {cls!r}, expected a subclass of tandem.server.tool_parsers.ToolParser"
        )
    return cls
