"""A chat request's `tools` and `tool_choice`: checked, given to the chat template, and
turned into the output constraint that enforces them.

`plan_tools(req, serving)` checks the request against the server's settings and returns
the `ToolPlan` the response is built from (`tandem.server.tool_calls`). As vLLM:
- `tool_choice` unset means `auto` when there are tools, `none` otherwise; a choice other
  than `none` needs `tools`, except `required` with an empty list, which is `none`;
- `auto` needs the server started with `--enable-auto-tool-choice` and
  `--tool-call-parser`; the parser reads the calls out of free text;
- `required` and a named function are enforced by the grammar backend:
  `tool_call_schema(req)` is the JSON schema the output must match (named: the function's
  parameters, so the whole output is the arguments; required: a non-empty array of
  `{"name": <one of the functions>, "parameters": <its parameters>}`, with every
  function's `$defs` hoisted to the root), handed to the request's structured outputs;
- `none` leaves the output alone; the tools are still rendered into the prompt unless the
  server runs with `--exclude-tools-when-tool-choice-none`;
- `parallel_tool_calls: false` allows one call: `required`'s array gets `maxItems: 1` and
  `auto` keeps the first call the parser finds.
Errors are 400s naming the field (`tool_choice`, `tools.1.function.name`, ...).

The tools reach the template as transformers' `apply_chat_template(..., tools=[...])`
does (the OpenAI shape, `{"type": "function", "function": {...}}`); a template that never
reads `tools` is logged once, since the model then does not see them. Assistant messages
carrying `tool_calls` have their JSON `arguments` strings parsed into objects for the
template, as vLLM does (templates write them with `tojson`).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from typing import Any

from tandem.server.errors import bad_request
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.tool_parsers import ToolParser, load_tool_parser, tool_parser_names

logger = logging.getLogger("tandem.server")

TOOL_CHOICES = ("none", "auto", "required")
_NAMED_SHAPE = '{"type": "function", "function": {"name": "..."}}'
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DEFS_KEYS = ("$defs", "definitions")


@dataclass(frozen=True, slots=True)
class ToolServing:
    """The server's tool-calling settings (`tandem serve` flags). `parser` is the
    `--tool-call-parser` instance, None without the flag."""

    parser: ToolParser | None = None
    enable_auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's output is read. `mode`: `none` (plain content), `auto` (the
    server's parser on free text), `required` (a constrained JSON array of calls) or
    `named` (constrained arguments of `function`). `template_tools` go to the template;
    `parallel` False allows one call."""

    mode: str = "none"
    function: str | None = None
    parser: ToolParser | None = None
    template_tools: list[dict[str, Any]] | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """Whether the grammar backend enforces the output (required, named)."""
        return self.mode in ("required", "named")


def tool_choice_of(req: ChatCompletionRequest) -> str:
    """The request's choice: `none`, `auto`, `required`, or the named function's name
    prefixed `function:`. 400 naming `tool_choice` for any other value."""
    choice = req.tool_choice
    tools = req.tools
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad_request(
                f"tool_choice: expected 'none', 'auto', 'required' or {_NAMED_SHAPE}, "
                f"got {choice!r}",
                param="tool_choice",
            )
        if choice == "required" and tools is not None and not tools:
            return "none"  # OpenAI's (and vLLM's) reading of required with no tools
    else:
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise bad_request(
                f"tool_choice: expected 'none', 'auto', 'required' or {_NAMED_SHAPE}, "
                f"got {json.dumps(choice)[:200]}",
                param="tool_choice",
            )
        choice = "function:" + name
    if choice != "none" and not tools:
        raise bad_request(
            f"tool_choice: {req.tool_choice!r} needs `tools` (a non-empty list of functions)",
            param="tool_choice",
        )
    return choice


def _functions(req: ChatCompletionRequest) -> dict[str, dict[str, Any] | None]:
    """Function name -> its parameters schema; 400 naming a repeated name."""
    functions: dict[str, dict[str, Any] | None] = {}
    for i, tool in enumerate(req.tools or []):
        name = tool.function.name
        if name in functions:
            field = f"tools.{i}.function.name"
            raise bad_request(f"{field}: function {name!r} is defined twice", param=field)
        functions[name] = tool.function.parameters
    return functions


def plan_tools(req: ChatCompletionRequest, serving: ToolServing) -> ToolPlan:
    """How the request uses its tools (see the module docstring); 400s name the field."""
    choice = tool_choice_of(req)
    functions = _functions(req)
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools or []] or None
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        exclude = serving.exclude_tools_when_tool_choice_none
        return ToolPlan("none", template_tools=None if exclude else tools)
    if choice == "auto":
        if not serving.enable_auto_tool_choice or serving.parser is None:
            raise bad_request(
                'tool_choice: "auto" needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser (send tool_choice 'required' or a named function "
                "instead: those need no parser)",
                param="tool_choice",
            )
        return ToolPlan("auto", parser=serving.parser, template_tools=tools, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", template_tools=tools, parallel=parallel)
    name = choice.removeprefix("function:")
    if name not in functions:
        known = ", ".join(repr(n) for n in functions)
        raise bad_request(
            f"tool_choice: function {name!r} is not one of the request's tools ({known})",
            param="tool_choice",
        )
    return ToolPlan("named", function=name, template_tools=tools)


def tool_call_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema that enforces `required` or a named function, None otherwise
    (see the module docstring). 400 naming the field for a bad choice, or for two
    functions whose `$defs` give one name different schemas."""
    choice = tool_choice_of(req)
    if choice in ("none", "auto"):
        return None
    functions = _functions(req)
    if choice.startswith("function:"):
        parameters = functions.get(choice.removeprefix("function:"))
        return copy.deepcopy(parameters) if parameters else dict(_EMPTY_PARAMETERS)
    defs: dict[str, dict[str, Any]] = {}
    alternatives = []
    for i, (name, parameters) in enumerate(functions.items()):
        parameters = copy.deepcopy(parameters) if parameters else dict(_EMPTY_PARAMETERS)
        for key in _DEFS_KEYS:
            for def_name, schema in (parameters.pop(key, None) or {}).items():
                ref = f"{key}/{def_name}"
                if defs.get(ref, schema) != schema:
                    field = f"tools.{i}.function.parameters.{key}.{def_name}"
                    raise bad_request(
                        f"{field}: another function defines {def_name!r} differently; "
                        "tool_choice 'required' needs one schema per definition name",
                        param=field,
                    )
                defs[ref] = schema
        alternatives.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    for ref, def_schema in defs.items():
        key, _, def_name = ref.partition("/")
        schema.setdefault(key, {})[def_name] = def_schema
    return schema


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: an assistant message's tool calls with
    `arguments` parsed from JSON text into an object (left as they are when not JSON),
    and `content` None where such a message has none. The request is not changed."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            message = {**message, "tool_calls": [_parsed_call(call) for call in calls]}
            message.setdefault("content", None)
        out.append(message)
    return out


def _parsed_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": parsed}}


_warned_templates: set[int] = set()


def warn_if_template_ignores_tools(template: Any) -> None:
    """Log once per template when tools are given but the template never reads `tools`
    (the model will not see them; named and required choices still hold)."""
    text = str(template)
    if template is None or "tools" in text or hash(text) in _warned_templates:
        return
    _warned_templates.add(hash(text))
    logger.warning(
        "the chat template does not read `tools`: the model does not see the request's "
        "tools (serve a model whose chat template renders them)"
    )


def tool_parser_class(name: str | None, enable_auto_tool_choice: bool) -> type[ToolParser] | None:
    """The `--tool-call-parser` class (None without the flag), checked at startup:
    ValueError naming the flag for an unknown parser, or for `--enable-auto-tool-choice`
    without a parser (as vLLM)."""
    if name is None:
        if enable_auto_tool_choice:
            raise ValueError(
                "--enable-auto-tool-choice: needs --tool-call-parser NAME (installed: "
                f"{', '.join(tool_parser_names()) or 'none'})"
            )
        return None
    return load_tool_parser(name)
