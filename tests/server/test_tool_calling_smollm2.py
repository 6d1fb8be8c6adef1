"""The slow suite's tool calling on the embedded SmolLM2 (`make test-slow`): the converted
model served with a Hermes-style chat template that renders `tools` (SmolLM2's own
template ignores them), `--enable-auto-tool-choice --tool-call-parser hermes`, through
the official `openai` client: a named call and `required` whose arguments validate,
streamed deltas that join into the non-streamed calls, `none` without calls, and `auto`
streamed equal to not streamed whatever the model wrote.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from e2e_helpers import ServerProcess, running_server
from test_tool_calling import (
    ASK_WEATHER,
    NAMED,
    NO_TOOL_PROMPT,
    SCHEMAS,
    TOOLS,
    TOOLS_TEMPLATE,
    assert_valid_call,
    calls_of,
)

pytestmark = pytest.mark.slow

MODEL = "smollm2-tools"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from tandem.models.model_files import resolve_model_dir

    source = resolve_model_dir("default")
    model_dir = tmp_path_factory.mktemp("smollm2-tools")
    for path in source.iterdir():
        if path.name != "chat_template.jinja":
            (model_dir / path.name).symlink_to(path)
    Path(model_dir, "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    flags = ["--served-model-name", MODEL, "--max-model-len", "2048", "--max-num-seqs", "8"]
    flags += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with running_server(str(model_dir), *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300) as c:
        yield c


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", ASK_WEATHER)
    kw.setdefault("tools", TOOLS)
    return client.chat.completions.create(
        model=MODEL, temperature=0, max_completion_tokens=128, **kw
    )


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, str]], Any]:
    content, names, arguments, finish = "", {}, {}, None
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                if piece.index not in names:
                    assert piece.id and piece.function.name, piece
                    names[piece.index], arguments[piece.index] = piece.function.name, ""
                arguments[piece.index] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(names[i], arguments[i]) for i in sorted(names)], finish


def test_named_call_on_smollm2_validates(client: openai.OpenAI) -> None:
    choice = chat(client, tool_choice=NAMED).choices[0]
    assert choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_required_on_smollm2_calls_a_tool_for_a_joke(client: openai.OpenAI) -> None:
    """One call (`parallel_tool_calls: false`): left free, greedy SmolLM2 repeats calls
    until `max_tokens` cuts the array off (then it is content, finish_reason length)."""
    choice = chat(
        client, messages=NO_TOOL_PROMPT, tool_choice="required", parallel_tool_calls=False
    ).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert_valid_call(choice.message.tool_calls[0])


@pytest.mark.parametrize("tool_choice", [NAMED, "required", "auto"])
def test_smollm2_streamed_equals_not_streamed(client: openai.OpenAI, tool_choice: Any) -> None:
    one = {"parallel_tool_calls": False}  # see the test above
    whole = chat(client, tool_choice=tool_choice, **one).choices[0]
    content, calls, finish = streamed(client, tool_choice=tool_choice, **one)
    assert calls == calls_of(whole.message)
    assert content == (whole.message.content or "")
    assert finish == whole.finish_reason


def test_none_on_smollm2_has_no_tool_calls(client: openai.OpenAI) -> None:
    choice = chat(client, tool_choice="none").choices[0]
    assert not choice.message.tool_calls and choice.message.content
