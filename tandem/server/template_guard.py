"""Chat templates under a work and size bound, and which template a request may bring.

Templates are rendered by the tokenizer's `apply_chat_template` (transformers compiles them
in jinja2's `ImmutableSandboxedEnvironment`: no attribute escapes, no mutation of the
caller's data, no file access: the environment has no loader, so `{% include %}` fails).
The sandbox bounds what a template may *reach*, not how long it runs: nested loops over
`range(100000)` run for hours. `bounded_render(fn, budget)` runs `fn` with a trace function
that counts the lines jinja's compiled template code executes (frames whose file is
`<template>`), the characters it yields, and the wall time, and raises
`TemplateBudgetError` (a ValueError naming `chat_template`) past any of the three. The
tracer only touches template frames, so rendering an ordinary template costs little more;
the thread's previous trace function (a coverage tool's) is restored afterwards.

What it does not bound: one C-level operation inside a template (`'x' * 10**10`) runs to
completion; only an operator's template or one the operator trusts
(`--trust-request-chat-template`) can contain it.

`request_template(...)` decides whether a request's `chat_template` (and a `chat_template`
inside `chat_template_kwargs`) is allowed: never a path, only text, and only with the
operator's opt-in. `check_template_kwargs` keeps `chat_template_kwargs` to template
variables: the keys `apply_chat_template` itself interprets are refused.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from tandem.server.errors import APIError

T = TypeVar("T")

#: The file name jinja2 gives code compiled from a template string.
TEMPLATE_FILENAME = "<template>"

#: `apply_chat_template` keywords a client must not set through `chat_template_kwargs`
#: (they change what the call does, not what the template sees).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "tokenizer_kwargs",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
    }
)


class TemplateBudgetError(ValueError):
    """A template rendering went past its `TemplateBudget`."""


@dataclass(frozen=True, slots=True)
class TemplateBudget:
    """How much one rendering may do: `max_steps` template lines executed, `max_chars`
    characters of output, `max_seconds` of wall time. Measured on SmolLM2's template: 5
    steps per message (4096 messages, the most a request may send: ~20k steps), ~0.35 us
    per step traced; 200k steps stop a runaway template within ~0.1 s of CPU."""

    max_steps: int = 200_000
    max_chars: int = 8 << 20
    max_seconds: float = 5.0


DEFAULT_BUDGET = TemplateBudget()


class _Tracer:
    """The trace function of one bounded rendering (one thread)."""

    def __init__(self, budget: TemplateBudget) -> None:
        self.budget = budget
        self.steps = 0
        self.chars = 0
        self.deadline = time.monotonic() + budget.max_seconds

    def on_call(self, frame: FrameType, event: str, arg: Any) -> Any:
        """Global trace function: trace template frames; check the clock on other calls
        (filters and tests the template calls run Python code too)."""
        if frame.f_code.co_filename == TEMPLATE_FILENAME:
            return self.on_line
        if time.monotonic() > self.deadline:
            self._fail(f"took longer than {self.budget.max_seconds} s")
        return None

    def on_line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.steps += 1
            if self.steps > self.budget.max_steps:
                self._fail(f"executed more than {self.budget.max_steps} template steps")
            if not self.steps & 0xFF and time.monotonic() > self.deadline:
                self._fail(f"took longer than {self.budget.max_seconds} s")
        elif event == "return" and isinstance(arg, str):  # a generator yields output
            self.chars += len(arg)
            if self.chars > self.budget.max_chars:
                self._fail(f"rendered more than {self.budget.max_chars} characters")
        return self.on_line

    @staticmethod
    def _fail(what: str) -> None:
        raise TemplateBudgetError(f"chat_template: rendering {what}; the template was stopped")


def bounded_render(render: Callable[[], T], budget: TemplateBudget = DEFAULT_BUDGET) -> T:
    """`render()` in this thread under `budget`; raises `TemplateBudgetError` past it.
    A string result longer than `budget.max_chars` is refused too."""
    tracer = _Tracer(budget)
    previous = sys.gettrace()
    sys.settrace(tracer.on_call)
    try:
        result = render()
    finally:
        sys.settrace(previous)
    if isinstance(result, str) and len(result) > budget.max_chars:
        tracer._fail(f"rendered more than {budget.max_chars} characters")
    return result


def request_template(
    chat_template: str | None, kwargs: dict[str, Any] | None, trusted: bool
) -> str | None:
    """The template text a request brings (its `chat_template`, or `chat_template` in
    `chat_template_kwargs`), or None; 400 naming the field when it brings one and the
    operator did not pass `--trust-request-chat-template`, or gives two."""
    bad_request = _bad_request()
    from_kwargs = (kwargs or {}).get("chat_template")
    given = [
        (name, value)
        for name, value in (
            ("chat_template", chat_template),
            ("chat_template_kwargs.chat_template", from_kwargs),
        )
        if value is not None
    ]
    if not given:
        return None
    name, text = given[0]
    if not trusted:
        raise bad_request(
            f"{name}: a chat template was passed with the request, but the server was not "
            "started with --trust-request-chat-template; refused (the server uses its own "
            "template)",
            param=name,
        )
    if len(given) > 1:
        raise bad_request(
            "chat_template: give the template once (chat_template or "
            "chat_template_kwargs.chat_template, not both)",
            param="chat_template",
        )
    if not isinstance(text, str) or not text.strip():
        raise bad_request(f"{name}: expected the template text (a string)", param=name)
    return text


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` without `chat_template` (taken by `request_template`); 400
    naming the key for the other keywords `apply_chat_template` interprets itself."""
    bad_request = _bad_request()
    kwargs = dict(kwargs or {})
    kwargs.pop("chat_template", None)
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS or not isinstance(key, str) or key.startswith("_"):
            where = f"chat_template_kwargs.{key}"
            raise bad_request(
                f"{where}: not a template variable a request may set (reserved)", param=where
            )
    return kwargs


def _bad_request() -> Callable[..., APIError]:
    """`errors.bad_request`, imported on use: `LLM.chat` renders through this module and
    must not import the HTTP stack."""
    from tandem.server.errors import bad_request

    return bad_request
