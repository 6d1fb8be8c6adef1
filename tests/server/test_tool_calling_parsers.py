"""Tool parsers on hand-written model outputs, whole (`extract`) and streamed in pieces
(`streamer`), including tags and JSON split across pieces; the named-choice and
`required` readers of `tandem.server.tool_calls`; the request side's schema and checks
(`tandem.server.tool_choice`); finding parsers by name.

The streaming contract (tandem/server/tool_parsers/base.py): for well-formed calls, the
pieces join into exactly what `extract` returns, whatever the split.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.tool_calls import ToolCallDeltas, tool_message
from tandem.server.tool_choice import (
    ToolPlan,
    ToolServing,
    plan_tools,
    template_messages,
    tool_call_schema,
    warn_if_template_ignores_tools,
)
from tandem.server.tool_parsers import (
    DeltaParse,
    ToolCall,
    ToolParser,
    load_tool_parser,
    tool_parser_names,
)
from tandem.server.tool_parsers.hermes import HermesToolParser
from tandem.server.tool_parsers.json_calls import JsonToolParser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
NESTED = (
    '{"name": "search", "arguments": {"q": "a } ] \\" <tool_call> b", '
    '"filters": {"tags": ["x", {"y": null}], "n": -1.5e3, "ok": true}}}'
)

HERMES_OUTPUTS = [
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
    f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{NESTED}</tool_call>",
    f"<tool_call>{WEATHER}",  # the closing tag never came (EOS right after the call)
    '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call> done',  # name second
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments as a string
    '<tool_call>{"name": "ping"}</tool_call>',  # no arguments
    '<tool_call>{"name": "f", "parameters": {"x": [1]}}</tool_call>',
    "A plain answer, a < b and <tool but no call.",
    "Ends with a partial tag <tool_c",
    "",
    "   ",
    "<tool_call>not json</tool_call> then text",  # not a call: stays content
    '<tool_call>{"foo": 1}</tool_call>',  # an object without a name: content
]
JSON_OUTPUTS = [
    WEATHER,
    f"  [{WEATHER}, {NESTED}]\n",
    '[{"name": "a", "parameters": {}}]',
    '{"answer": 42}',  # JSON, but not a call
    "[]",
    "[1, 2]",
    "Just text.",
    "  ",
    "",
]


def chunkings(text: str, seed: int = 0) -> list[list[str]]:
    """The text whole, one character at a time, split at every single position, and a
    few random splits."""
    splits: list[list[str]] = [[text], list(text)]
    splits += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(5):
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6))) if len(text) > 1 else []
        )
        bounds = [0, *cuts, len(text)]
        splits.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return splits


def stream(parser: ToolParser, pieces: list[str]) -> tuple[list[DeltaParse], str, list[ToolCall]]:
    """Feed `pieces`, then finish: the deltas, the joined content and the joined calls.
    Checks the delta contract on the way: indices from 0 in order, the name on a call's
    first piece only."""
    streamer = parser.streamer()
    deltas = [streamer.feed(piece) for piece in pieces] + [streamer.finish()]
    content = "".join(d.content for d in deltas)
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for d in deltas:
        for piece in d.calls:
            if piece.index not in names:
                assert piece.name is not None, f"call {piece.index} began without its name"
                assert piece.index == len(names), f"call index {piece.index} out of order"
                names[piece.index] = piece.name
                arguments[piece.index] = ""
            else:
                assert piece.name is None, f"call {piece.index} sent its name twice"
            arguments[piece.index] += piece.arguments
    calls = [ToolCall(names[i], arguments[i]) for i in sorted(names)]
    return deltas, content, calls


def assert_stream_equals_extract(parser: ToolParser, text: str) -> None:
    whole = parser.extract(text)
    for pieces in chunkings(text):
        _, content, calls = stream(parser, pieces)
        assert calls == whole.calls, (pieces, calls, whole.calls)
        assert content == (whole.content or ""), (pieces, content, whole.content)


# Hermes ---------------------------------------------------------------------------------


def test_hermes_extracts_a_call_and_the_text_before_it() -> None:
    out = HermesToolParser().extract(HERMES_OUTPUTS[0])
    assert out.content == "Let me check.\n"
    assert out.calls == [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')]
    assert json.loads(out.calls[0].arguments) == {"city": "Paris", "days": [1, 2]}


def test_hermes_two_calls_with_only_newlines_around_have_no_content() -> None:
    out = HermesToolParser().extract(HERMES_OUTPUTS[1])
    assert out.content is None
    assert [c.name for c in out.calls] == ["get_weather", "search"]
    nested = json.loads(out.calls[1].arguments)
    assert nested["q"] == 'a } ] " <tool_call> b' and nested["filters"]["n"] == -1500.0


def test_hermes_reads_name_after_arguments_string_arguments_and_no_arguments() -> None:
    parser = HermesToolParser()
    assert parser.extract(HERMES_OUTPUTS[3]).calls == [ToolCall("f", '{"a": 1}')]
    assert parser.extract(HERMES_OUTPUTS[3]).content == " done"
    assert parser.extract(HERMES_OUTPUTS[4]).calls == [ToolCall("f", '{"a": 1}')]
    assert parser.extract(HERMES_OUTPUTS[5]).calls == [ToolCall("ping", "{}")]
    assert parser.extract(HERMES_OUTPUTS[6]).calls == [ToolCall("f", '{"x": [1]}')]


def test_hermes_text_without_calls_is_content_unchanged() -> None:
    parser = HermesToolParser()
    for text in ("A plain answer, a < b and <tool but no call.", "", "   "):
        out = parser.extract(text)
        assert out.calls == [] and out.content == text


def test_hermes_tag_whose_body_is_not_a_call_stays_content() -> None:
    parser = HermesToolParser()
    out = parser.extract("<tool_call>not json</tool_call> then text")
    assert out.calls == [] and out.content == "<tool_call>not json</tool_call> then text"
    assert parser.extract('<tool_call>{"foo": 1}</tool_call>').calls == []


@pytest.mark.parametrize("text", HERMES_OUTPUTS)
def test_hermes_streamed_in_any_pieces_equals_extract(text: str) -> None:
    assert_stream_equals_extract(HermesToolParser(), text)


def test_hermes_holds_a_partial_opening_tag_until_it_is_known() -> None:
    streamer = HermesToolParser().streamer()
    assert streamer.feed("Sure <tool").content == "Sure "
    second = streamer.feed('_call>{"name": "f", "arg')
    assert second.content == "" and [(c.index, c.name) for c in second.calls] == [(0, "f")]
    third = streamer.feed('uments": {"a": 1}}</tool')
    assert [(c.name, c.arguments) for c in third.calls] == [(None, '{"a": 1}')]
    last = streamer.feed("_call>")
    assert last.content == "" and last.calls == []
    assert streamer.finish().content == ""


def test_hermes_a_lone_angle_bracket_is_content_once_the_next_character_comes() -> None:
    streamer = HermesToolParser().streamer()
    assert streamer.feed("a <").content == "a "
    assert streamer.feed(" b").content == "< b"


def test_hermes_streams_the_name_before_the_arguments_end_and_arguments_in_fragments() -> None:
    text = f"<tool_call>{NESTED}</tool_call>"
    deltas, _, calls = stream(HermesToolParser(), list(text))
    pieces = [p for d in deltas for p in d.calls]
    named_at = next(i for i, d in enumerate(deltas) if d.calls and d.calls[0].name)
    last_args_at = max(i for i, d in enumerate(deltas) if any(p.arguments for p in d.calls))
    assert named_at < last_args_at  # the name went out while the arguments were written
    assert sum(1 for p in pieces if p.arguments) > 10  # fragments, not one late piece
    assert calls == HermesToolParser().extract(text).calls


def test_hermes_call_cut_off_streams_what_it_had_but_extract_reports_content() -> None:
    """The documented limit: a call cut off (max_tokens) cannot be taken back."""
    text = '<tool_call>{"name": "f", "arguments": {"a": '
    _, content, calls = stream(HermesToolParser(), [text])
    assert calls == [ToolCall("f", '{"a": ')] and content == ""
    whole = HermesToolParser().extract(text)
    assert whole.calls == [] and whole.content == text


# JSON -----------------------------------------------------------------------------------


def test_json_parser_reads_an_object_or_an_array_of_calls() -> None:
    parser = JsonToolParser()
    one = parser.extract(WEATHER)
    assert one.content is None and one.calls == [
        ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')
    ]
    many = parser.extract(f"  [{WEATHER}, {NESTED}]\n")
    assert [c.name for c in many.calls] == ["get_weather", "search"]
    assert parser.extract('[{"name": "a", "parameters": {}}]').calls == [ToolCall("a", "{}")]


@pytest.mark.parametrize("text", ['{"answer": 42}', "[]", "[1, 2]", "Just text.", "  ", ""])
def test_json_parser_leaves_anything_else_as_content(text: str) -> None:
    out = JsonToolParser().extract(text)
    assert out.calls == [] and out.content == text


@pytest.mark.parametrize("text", JSON_OUTPUTS)
def test_json_parser_streamed_in_any_pieces_equals_extract(text: str) -> None:
    assert_stream_equals_extract(JsonToolParser(), text)


def test_json_parser_holds_text_until_the_first_name_then_streams() -> None:
    streamer = JsonToolParser().streamer()
    assert streamer.feed('[{"na') == DeltaParse()
    named = streamer.feed('me": "a", "parameters": {"x"')
    assert [(c.index, c.name, c.arguments) for c in named.calls] == [(0, "a", '{"x"')]
    rest = streamer.feed(': 1}}, {"name": "b", "parameters": {}}]')
    assert [(c.index, c.name, c.arguments) for c in rest.calls] == [
        (0, None, ": 1}"),
        (1, "b", "{}"),
    ]
    assert streamer.finish() == DeltaParse()


# The server's readers: named, required, auto, none ---------------------------------------


def test_named_choice_is_one_call_whose_arguments_are_the_whole_output() -> None:
    plan = ToolPlan("named", function="get_weather")
    content, calls, reason = tool_message(plan, '{"city":"Paris"}', "stop")
    assert content is None and reason == "stop"
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    deltas = ToolCallDeltas(plan)
    first = deltas.delta('{"city"', False)[1]
    assert first[0]["id"].startswith("chatcmpl-tool-") and first[0]["type"] == "function"
    assert first[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert deltas.delta(':"Paris"}', True)[1] == [
        {"index": 0, "function": {"arguments": ':"Paris"}'}}
    ]
    assert deltas.finish_reason("stop") == "stop"


def test_required_reads_the_array_and_finishes_with_tool_calls() -> None:
    plan = ToolPlan("required")
    text = '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{}}]'
    content, calls, reason = tool_message(plan, text, "stop")
    assert content is None and reason == "tool_calls"
    assert [c["function"] for c in calls] == [
        {"name": "a", "arguments": '{"x":1}'},
        {"name": "b", "arguments": "{}"},
    ]
    assert len({c["id"] for c in calls}) == 2
    cut = '[{"name":"a","parameters":{"x"'
    assert tool_message(plan, cut, "length") == (cut, [], "length")


def test_auto_finishes_with_tool_calls_only_when_a_call_was_made() -> None:
    plan = ToolPlan("auto", parser=HermesToolParser())
    _, calls, reason = tool_message(plan, f"<tool_call>{WEATHER}</tool_call>", "stop")
    assert len(calls) == 1 and reason == "tool_calls"
    assert tool_message(plan, "No call.", "stop") == ("No call.", [], "stop")
    none = ToolPlan("none")
    assert tool_message(none, f"<tool_call>{WEATHER}</tool_call>", "stop")[1] == []
    assert not ToolCallDeltas(none).active


# The request side -----------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"$ref": "#/$defs/City"}},
                "required": ["city"],
                "$defs": {"City": {"type": "string", "enum": ["Paris", "Oslo"]}},
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]


def chat_request(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields}
    return ChatCompletionRequest.model_validate(body)


def test_named_schema_is_the_function_parameters() -> None:
    req = chat_request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert tool_call_schema(req) == TOOLS[0]["function"]["parameters"]
    ping = chat_request(tool_choice={"type": "function", "function": {"name": "ping"}})
    assert tool_call_schema(ping) == {"type": "object", "properties": {}}


def test_required_schema_accepts_exactly_arrays_of_valid_calls() -> None:
    import jsonschema  # a test dependency (requirements/dev.txt): never skipped

    schema = tool_call_schema(chat_request(tool_choice="required"))
    assert schema is not None and "$defs" in schema  # hoisted so the $ref resolves
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "get_weather", "parameters": {"city": "Oslo"}}])
    assert validator.is_valid([{"name": "ping", "parameters": {}}])
    assert not validator.is_valid([])
    assert not validator.is_valid([{"name": "get_weather", "parameters": {"city": "Rome"}}])
    assert not validator.is_valid([{"name": "nope", "parameters": {}}])
    assert TOOLS[0]["function"]["parameters"].get("$defs")  # the request was not changed


def test_parallel_tool_calls_false_allows_one_call() -> None:
    schema = tool_call_schema(chat_request(tool_choice="required", parallel_tool_calls=False))
    assert schema is not None and schema["maxItems"] == 1
    assert "maxItems" not in (tool_call_schema(chat_request(tool_choice="required")) or {})
    serving = ToolServing(parser=HermesToolParser(), enable_auto_tool_choice=True)
    plan = plan_tools(chat_request(parallel_tool_calls=False), serving)
    two = f"<tool_call>{WEATHER}</tool_call><tool_call>{NESTED}</tool_call>"
    content, calls, reason = tool_message(plan, two, "stop")
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and reason == "tool_calls"
    deltas = ToolCallDeltas(plan)
    pieces = deltas.delta(two[:40], False)[1] + deltas.delta(two[40:], True)[1]
    assert {p["index"] for p in pieces} == {0}
    assert "".join(p["function"]["arguments"] for p in pieces) == calls[0]["function"]["arguments"]


def test_required_with_conflicting_defs_is_a_400_naming_the_definition() -> None:
    clash = json.loads(json.dumps(TOOLS))
    clash[1]["function"]["parameters"] = {"$defs": {"City": {"type": "integer"}}}
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": clash, "tool_choice": "required"}
    )
    with pytest.raises(APIError) as err:
        tool_call_schema(req)
    assert err.value.param == "tools.1.function.parameters.$defs.City"


@pytest.mark.parametrize(
    ("choice", "param", "words"),
    [
        (
            {"type": "function", "function": {"name": "nope"}},
            "tool_choice",
            ["nope", "get_weather"],
        ),
        ("sometimes", "tool_choice", ["sometimes", "required"]),
        ({"type": "function"}, "tool_choice", ["function"]),
        ("auto", "tool_choice", ["--enable-auto-tool-choice"]),
    ],
)
def test_bad_tool_choice_is_a_400_naming_the_field(
    choice: Any, param: str, words: list[str]
) -> None:
    with pytest.raises(APIError) as err:
        plan_tools(chat_request(tool_choice=choice), ToolServing())
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith("tool_choice:")
    for word in words:
        assert word in err.value.message


def test_tool_choice_defaults_follow_vllm() -> None:
    serving = ToolServing(parser=HermesToolParser(), enable_auto_tool_choice=True)
    assert plan_tools(chat_request(), serving).mode == "auto"  # tools and no choice
    bare = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert plan_tools(bare, ToolServing()).mode == "none"
    empty = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "required"}
    )
    assert plan_tools(empty, ToolServing()).mode == "none"
    with pytest.raises(APIError, match="needs `tools`"):
        plan_tools(bare.model_copy(update={"tool_choice": "required"}), ToolServing())
    none = plan_tools(chat_request(tool_choice="none"), ToolServing())
    assert none.mode == "none" and none.template_tools is not None  # still in the prompt
    excluded = ToolServing(exclude_tools_when_tool_choice_none=True)
    assert plan_tools(chat_request(tool_choice="none"), excluded).template_tools is None


def test_duplicate_function_names_are_a_400() -> None:
    twice = [TOOLS[1], TOOLS[1]]
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": twice, "tool_choice": "required"}
    )
    with pytest.raises(APIError) as err:
        plan_tools(req, ToolServing())
    assert err.value.param == "tools.1.function.name"


def test_a_template_that_ignores_tools_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %} (#once)"
    with caplog.at_level("WARNING", logger="tandem.server"):
        warn_if_template_ignores_tools(template)
        warn_if_template_ignores_tools(template)
        warn_if_template_ignores_tools("{{ tools | tojson }}")
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert len(caplog.records) == 1 and "does not read `tools`" in caplog.records[0].getMessage()


def test_template_messages_parse_assistant_call_arguments() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "2"}]
    out = template_messages(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[0]["content"] is None and out[1] == messages[1]
    assert call["function"]["arguments"] == '{"a": 1}'  # the request is not changed


# Finding parsers ------------------------------------------------------------------------


def test_bundled_parsers_are_found_through_the_entry_point_group() -> None:
    assert {"hermes", "json"} <= set(tool_parser_names())
    assert load_tool_parser("hermes") is HermesToolParser
    assert load_tool_parser("json") is JsonToolParser


def test_a_parser_named_by_import_path_loads() -> None:
    cls = load_tool_parser("tandem.server.tool_parsers.hermes:HermesToolParser")
    assert cls is HermesToolParser


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("nope", ["--tool-call-parser", "'nope'", "hermes", "json", "tandem.tool_parsers"]),
        ("tandem.server.tool_parsers.base:ToolCall", ["--tool-call-parser", "ToolParser"]),
        ("no_such_module:Parser", ["--tool-call-parser", "failed to import"]),
    ],
)
def test_unknown_or_wrong_parser_names_the_flag(name: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        load_tool_parser(name)
    for word in words:
        assert word in str(err.value)
