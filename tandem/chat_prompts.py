"""`LLM.chat`'s prompts: conversations through a chat template into prompt dicts.

`chat_prompts` checks the conversations (each a non-empty list of mappings with `role` and
`content`) and the template options, applies the model's chat template (or one given as a
string, or with `allow_path` a file) to each, and returns `{"prompt", "prompt_token_ids"}`
dicts that `LLM.generate` takes. Every rendering, the model's template too, runs in
transformers' jinja2 sandbox under a work and size bound
(`tandem.server.template_guard.bounded_render`). Errors are ValueError naming the argument
(`messages[0][1]`, `chat_template`, `continue_final_message`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from tandem.server.template_guard import DEFAULT_BUDGET, TemplateBudget, bounded_render


def chat_prompts(
    tokenizer: Any,
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
    *,
    allow_path: bool = True,
    budget: TemplateBudget | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One prompt dict per conversation (`messages` is one conversation or a list of
    them); see `LLM.chat` for the arguments. `tokenizer` None (a model without one) is
    an error. `allow_path` False: `chat_template` is template text only, never a file
    name (the server's case: a client names no files). `budget` bounds each rendering
    (default `DEFAULT_BUDGET`). `tools` (OpenAI-style function tools) reach the template
    as its `tools` variable, as transformers' `apply_chat_template(tools=...)` gives them."""
    if tokenizer is None:
        raise ValueError("chat: the model has no tokenizer (the scripted model takes token ids)")
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message: True needs add_generation_prompt=False (continue the "
            "last message, or open a new assistant turn, not both)"
        )
    template = _chat_template(chat_template) if allow_path else chat_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat_template: the model's tokenizer has no chat template; pass one "
            "(chat_template='{% for m in messages %}...')"
        )
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            "messages: expected a conversation (a list of {'role', 'content'} mappings) "
            f"or a list of conversations, got {messages!r}"
        )
    conversations = [messages] if isinstance(messages[0], Mapping) else messages
    prompts: list[dict[str, Any]] = []
    for c, conversation in enumerate(conversations):  # type: ignore[arg-type]
        if not isinstance(conversation, list) or not conversation:
            raise ValueError(
                f"messages[{c}]: expected a non-empty list of messages, got {conversation!r}"
            )
        for m, message in enumerate(conversation):
            if (
                not isinstance(message, Mapping)
                or "role" not in message
                or "content" not in message
            ):
                raise ValueError(
                    f"messages[{c}][{m}]: expected a mapping with 'role' and 'content', got {message!r}"
                )
        text = bounded_render(
            partial(
                tokenizer.apply_chat_template,
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **{"tools": tools, **(chat_template_kwargs or {})},
            ),
            budget or DEFAULT_BUDGET,
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts


def _chat_template(chat_template: str | None) -> str | None:
    """A template string as given, or the contents of the file it names."""
    if chat_template is None or "{" in chat_template:
        return chat_template
    path = Path(chat_template).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(
        f"chat_template: expected a Jinja template string or an existing file, got {chat_template!r}"
    )
