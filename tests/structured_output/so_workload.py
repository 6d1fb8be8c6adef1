"""The end-to-end workload: JSON schemas (nested objects, arrays, enums, numbers), regexes,
choices and an EBNF grammar, each with a prompt and a validator of the output text."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)
    city: str = Field(max_length=24)


class Item(BaseModel):
    sku: str = Field(max_length=12)
    quantity: int = Field(ge=1, le=99)


class Order(BaseModel):
    order_id: int
    status: Literal["pending", "shipped", "delivered"]
    items: list[Item] = Field(min_length=1, max_length=3)


class Author(BaseModel):
    name: str = Field(max_length=24)
    born: int


class Book(BaseModel):
    title: str = Field(max_length=32)
    author: Author
    tags: list[str] = Field(max_length=3)


class Reading(BaseModel):
    city: str = Field(max_length=24)
    temperature: float
    unit: Literal["C", "F"]
    rain: bool


@dataclass(frozen=True)
class Case:
    """One constrained request: its prompt, its `structured_outputs` and its validator."""

    name: str
    prompt: str
    spec: dict[str, Any]
    validate: Callable[[str], object]
    xgrammar_only: bool = False


def _model(model: type[BaseModel]) -> Callable[[str], object]:
    return model.model_validate_json


def _regex(pattern: str) -> Callable[[str], object]:
    def check(text: str) -> object:
        if re.fullmatch(pattern, text) is None:
            raise ValueError(f"{text!r} does not fully match {pattern!r}")
        return text

    return check


def _choice(choices: list[str]) -> Callable[[str], object]:
    def check(text: str) -> object:
        if text not in choices:
            raise ValueError(f"{text!r} is not one of {choices}")
        return text

    return check


def _arith(text: str) -> object:
    if re.fullmatch(r"[0-9]{1,2}( [+*-] [0-9]{1,2}){0,2}", text) is None:
        raise ValueError(f"{text!r} is not an expression of the grammar")
    return text


ARITH = (
    'root ::= num | num " " op " " num | num " " op " " num " " op " " num\n'
    'op ::= "+" | "-" | "*"\nnum ::= [0-9] | [1-9] [0-9]'
)
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
EMAIL = r"[a-z]{1,12}\.[a-z]{1,12}@[a-z]{2,10}\.(com|org|net)"
COLOR = r"#[0-9a-f]{6}"
SENTIMENT = ["positive", "negative", "neutral"]
YES_NO = ["yes", "no"]

CASES: list[Case] = [
    Case(
        "person",
        "Describe a fictional person (name, age, city) as JSON.",
        {"json": Person},
        _model(Person),
    ),
    Case(
        "order",
        "Make up a shop order with an id, a status and items as JSON.",
        {"json": Order},
        _model(Order),
    ),
    Case(
        "book",
        "Describe a famous novel, its author and some tags as JSON.",
        {"json": Book},
        _model(Book),
    ),
    Case("reading", "Report today's weather in Paris as JSON.", {"json": Reading}, _model(Reading)),
    Case(
        "date",
        "When did the last big event you know of happen? Give the date.",
        {"regex": DATE},
        _regex(DATE),
    ),
    Case("phone", "Write a US phone number.", {"regex": PHONE}, _regex(PHONE)),
    Case("email", "Invent an email address for John Smith.", {"regex": EMAIL}, _regex(EMAIL)),
    Case("color", "What is the hex code of a warm orange?", {"regex": COLOR}, _regex(COLOR)),
    Case(
        "sentiment",
        "Classify: 'I loved this film, it was wonderful!'",
        {"choice": SENTIMENT},
        _choice(SENTIMENT),
    ),
    Case("yes-no", "Is Paris the capital of France?", {"choice": YES_NO}, _choice(YES_NO)),
    Case(
        "object",
        'Answer with a tiny JSON object like {"answer": ...}: what colour is the sky?',
        {"json_object": True},
        json.loads,
    ),
    Case(
        "arith",
        "Write a short arithmetic expression.",
        {"grammar": ARITH},
        _arith,
        xgrammar_only=True,
    ),
]

TOPICS = ["a teacher", "a sailor", "a baker", "a pilot", "a doctor", "a farmer"]


def sweep_cases(n: int) -> list[Case]:
    """`n` cases cycling through `CASES` with varied prompts (the slow 50-request sweep)."""
    # json_object leaves string lengths free: with these prompts the model may write one
    # past any max_tokens (a model behaviour, not a grammar one), so the sweep leaves it out.
    bases = [c for c in CASES if c.name != "object"]
    out = []
    for i in range(n):
        base = bases[i % len(bases)]
        topic = TOPICS[(i // len(bases)) % len(TOPICS)]
        out.append(
            Case(
                f"{base.name}-{i}",
                f"{base.prompt} Think of {topic}.",
                base.spec,
                base.validate,
                base.xgrammar_only,
            )
        )
    return out


#: Engine settings of the end-to-end runs, by mode.
MODES: dict[str, dict[str, Any]] = {
    "sync": {"async_scheduling": False},
    "async": {"async_scheduling": True},
    "async-ngram": {
        "async_scheduling": True,
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
        },
    },
    # A KV pool too small for the batch: requests are preempted and resumed mid-grammar.
    "async-preempt": {
        "async_scheduling": True,
        "num_kv_blocks": 16,
        "max_model_len": 256,
        "enable_prefix_caching": False,
    },
}
#: The modes of the 50-request sweep.
SWEEP_MODES = ("sync", "async", "async-ngram")

#: Requests every run adds that must fail alone, and the words their error must contain.
BAD_REQUESTS: dict[str, tuple[dict[str, Any], str]] = {
    "bad-schema": ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
    "bad-regex": ({"regex": "(?=abc)[a-z]+"}, "unsupported regex feature"),
    "bad-backend": ({"regex": "[0-9]+", "backend": "lmfe"}, "unknown backend 'lmfe'"),
    "ebnf-on-outlines": ({"grammar": ARITH, "backend": "outlines"}, "'xgrammar'"),
}


def run_mode(
    mode: str, cases: list[Case], max_tokens: int, num_kv_blocks: int, with_bad: bool = True
) -> dict[str, Any]:
    """Generate every case with each backend (EBNF with xgrammar only), greedy, in one
    `generate` call on the embedded SmolLM2; returns {(backend, case name) or bad name:
    RequestOutput}."""
    from tandem import LLM, SamplingParams

    settings: dict[str, Any] = {
        "dtype": "float32",
        "block_size": 16,
        "num_kv_blocks": num_kv_blocks,
        "max_model_len": 1024,
        **MODES[mode],
    }
    llm = LLM(model="default", **settings)
    try:
        keys: list[Any] = []
        prompts: list[str] = []
        params: list[SamplingParams] = []

        def add(key: Any, prompt: str, spec: dict[str, Any]) -> None:
            keys.append(key)
            prompts.append(
                llm.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
            )
            params.append(
                SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
            )

        for backend in ("xgrammar", "outlines"):
            for case in cases:
                if not (case.xgrammar_only and backend == "outlines"):
                    add((backend, case.name), case.prompt, {**case.spec, "backend": backend})
        if with_bad:
            for name, (spec, _) in BAD_REQUESTS.items():
                add(name, "Say something.", spec)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result: dict[Any, Any] = dict(zip(keys, outputs, strict=True))
        grammar = llm.engine.plugin_manager.get_plugin("structured-output")
        scheduler = llm.engine.plugin_manager.plugins_with_role("scheduler")[0]
        result["_stats"] = {
            "stack": llm.engine.plugin_manager.plugin_names(),
            "deferred_steps": grammar.num_deferred_steps,
            "bitmask_steps": grammar.num_bitmask_steps,
            "draft_rows": grammar.num_draft_rows,
            "accepted_drafts": scheduler.spec_metrics.num_accepted_tokens,
            "preemptions": scheduler.num_preemptions,
        }
        return result
    finally:
        llm.shutdown()
