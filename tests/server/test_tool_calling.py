"""Tool calling against a live `tandem serve` with the official `openai` client, on a tiny
random Llama with SmolLM2's tokenizer and a Hermes-style chat template that renders
`tools` (one server for the module, 127.0.0.1, `--enable-auto-tool-choice
--tool-call-parser hermes`).

The model is random, so it would never call a tool by itself: the grammar-enforced
choices (a named function, `required`) still give calls whose arguments validate against
the function's schema, which is what these tests check, with streaming deltas that join
into the non-streamed result (greedy, so both runs generate the same tokens). `auto` on
free text is tested at parser level (test_tool_calling_parsers.py); here it must pass
text without calls through unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from e2e_helpers import ServerProcess, post, running_server, save_tiny_chat_model

MODEL = "tiny-tools"

#: A Hermes/Qwen-style template: the tools in a system turn, calls in <tool_call> tags.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions: {{ tools | tojson }}
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>{"name": {{ call.function.name | tojson }}, \
"arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}, "24h": {"type": "boolean"}},
    "required": ["zone", "24h"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city.",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone.",
            "parameters": TIME_PARAMS,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK_WEATHER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_TOOL_PROMPT: Any = [{"role": "user", "content": "Tell me a short joke about cats."}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-tools"))
    Path(model_dir, "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    flags = ["--served-model-name", MODEL, "--max-num-seqs", "8"]
    flags += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with running_server(str(model_dir), *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120) as c:
        yield c


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", ASK_WEATHER)
    kw.setdefault("tools", TOOLS)
    return client.chat.completions.create(
        model=MODEL, temperature=0, max_completion_tokens=96, seed=7, **kw
    )


def assert_valid_call(call: Any) -> dict[str, Any]:
    """A tool call in vLLM's shape whose arguments validate against its function."""
    assert call.type == "function"
    assert call.id.startswith("chatcmpl-tool-") and len(call.id) > len("chatcmpl-tool-") + 8
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, str]], Any]:
    """A streamed chat joined back: content, [(name, arguments)] by index, finish reason.
    Checks the delta shape: the first piece of a call carries id, type and name; later
    pieces only argument fragments."""
    content, names, arguments, ids, finish = "", {}, {}, {}, None
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                if piece.index not in names:
                    assert piece.id and piece.id.startswith("chatcmpl-tool-"), piece
                    assert piece.type == "function" and piece.function.name, piece
                    names[piece.index], ids[piece.index] = piece.function.name, piece.id
                    arguments[piece.index] = ""
                else:
                    assert piece.id is None and piece.function.name is None, piece
                arguments[piece.index] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    assert sorted(names) == list(range(len(names)))
    return content, [(names[i], arguments[i]) for i in sorted(names)], finish


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_named_tool_call_arguments_validate(client: openai.OpenAI) -> None:
    out = chat(client, tool_choice=NAMED)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"  # vLLM and OpenAI: a forced function stops
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert set(assert_valid_call(call)) == {"city", "unit", "days"}


def test_required_on_a_prompt_without_a_tool_need_still_calls_a_tool(
    client: openai.OpenAI,
) -> None:
    out = chat(client, messages=NO_TOOL_PROMPT, tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.function.name in SCHEMAS
        assert_valid_call(call)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_required_without_parallel_calls_makes_exactly_one(client: openai.OpenAI) -> None:
    out = chat(client, messages=NO_TOOL_PROMPT, tool_choice="required", parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert_valid_call(choice.message.tool_calls[0])


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_streamed_deltas_join_into_the_non_streamed_calls(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    whole = chat(client, messages=NO_TOOL_PROMPT, tool_choice=tool_choice).choices[0]
    content, calls, finish = streamed(client, messages=NO_TOOL_PROMPT, tool_choice=tool_choice)
    assert calls and calls == calls_of(whole.message)
    assert content == (whole.message.content or "")
    assert finish == whole.finish_reason


def test_none_returns_no_tool_calls_but_renders_the_tools(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    out = chat(client, tool_choice="none", extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert not choice.message.tool_calls and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    prompt_ids = (out.model_extra or {})["prompt_token_ids"]
    prompt = post(server.url, "/detokenize", {"model": MODEL, "tokens": prompt_ids}).json()
    assert "get_weather" in prompt["prompt"] and "get_time" in prompt["prompt"]
    bare = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_completion_tokens=1
    )
    assert out.usage is not None and bare.usage is not None
    assert out.usage.prompt_tokens > bare.usage.prompt_tokens + 50


def test_auto_passes_text_without_calls_through_as_content(client: openai.OpenAI) -> None:
    plain = chat(client, tool_choice="none").choices[0]
    auto = chat(client).choices[0]  # tools without tool_choice: auto, as in vLLM
    assert not auto.message.tool_calls and "<tool_call>" not in (plain.message.content or "")
    assert auto.message.content == plain.message.content
    assert auto.finish_reason == plain.finish_reason


def test_a_conversation_with_earlier_calls_and_results_renders(client: openai.OpenAI) -> None:
    first = chat(client, tool_choice=NAMED).choices[0].message.tool_calls[0]
    history = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": first.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": first.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": first.id, "content": '{"temp": 21}'},
    ]
    out = chat(client, messages=history, tool_choice="required")
    assert out.choices[0].message.tool_calls
    for call in out.choices[0].message.tool_calls:
        assert_valid_call(call)


def test_unknown_function_in_tool_choice_is_a_400_naming_the_field(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, tool_choice={"type": "function", "function": {"name": "launch"}})
    error = err.value.body
    assert isinstance(error, dict) and error.get("param") == "tool_choice", error
    assert "launch" in error["message"] and "get_weather" in error["message"]


def test_tool_choice_without_tools_and_a_bad_tool_are_400s(server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": ASK_WEATHER, "tool_choice": "required"}
    resp = post(server.url, "/v1/chat/completions", body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"
    bad_tool = {**body, "tools": [{"type": "function", "function": {"description": "x"}}]}
    resp = httpx.post(f"{server.base_url}/chat/completions", json=bad_tool, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "tools.0.function.name", resp.json()


def test_a_parameters_schema_the_grammar_cannot_enforce_is_a_400_naming_tools(
    client: openai.OpenAI,
) -> None:
    params = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["tags"],
    }
    tools = [{"type": "function", "function": {"name": "tag", "parameters": params}}]
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, tools=tools, tool_choice="required")
    error = err.value.body
    assert isinstance(error, dict) and error.get("param") == "tools", error
    assert "uniqueItems" in error["message"]
