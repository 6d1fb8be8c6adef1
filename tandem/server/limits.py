"""Bounds on what one request may ask of the server, each refused with a 400 naming the field.

A request body is parsed by `parse_json_body`: a JSON object nested at most
`MAX_JSON_DEPTH` deep (deeper is a 400 naming the path where it went too deep, never a
`RecursionError`), whose strings are valid Unicode (a lone surrogate such as `"\\ud800"`
is a 400 naming its path: the tokenizer and the JSON encoder cannot take one).
`check_limits(req)` then bounds the lists a request carries (`LIST_LIMITS`: stop strings,
bad words, logit_bias entries, messages, tools, token-id lists, prompts) and the integers
it carries (`INT64_FIELDS` must fit a signed 64-bit integer, as the engine's messages carry
them; `n` at most `MAX_N_PER_REQUEST`).

Every bound is a module constant, so an operator who needs more can see where it lives,
and every bound is far above what an OpenAI or vLLM client sends in practice.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.server.errors import APIError, bad_request

#: The deepest JSON nesting a request body may have (objects and arrays both count).
MAX_JSON_DEPTH = 64
#: Field -> the most entries its list (or object) may hold.
LIST_LIMITS: dict[str, int] = {
    "messages": 4096,
    "tools": 512,
    "stop": 256,
    "stop_token_ids": 4096,
    "bad_words": 1024,
    "logit_bias": 4096,
    "allowed_token_ids": 1 << 18,
    "guided_choice": 4096,
    "prompt": 4096,
}
#: The longest single stop string or bad word, in characters.
MAX_WORD_CHARS = 4096
#: The most sequences one request may ask for (`n`; each is a request in the engine).
MAX_N_PER_REQUEST = 256
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
#: Integer fields that cross into the engine as 64-bit integers.
INT64_FIELDS = (
    "priority",
    "n",
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 when it is not JSON, not an object, nested deeper
    than `MAX_JSON_DEPTH`, or holds a string that is not valid Unicode."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(
            f"the request body is nested deeper than {MAX_JSON_DEPTH} levels", param=None
        ) from None
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    check_json_tree(body)
    return body


def check_json_tree(body: Any) -> None:
    """Walk the parsed body once (iteratively: no recursion to exhaust): 400 naming the
    path of the first value nested past `MAX_JSON_DEPTH` or the first string (key or value)
    with a lone surrogate."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if len(path) >= MAX_JSON_DEPTH:
            where = _path(path)
            raise bad_request(
                f"{where}: the request body is nested deeper than {MAX_JSON_DEPTH} levels",
                param=where,
            )
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, (*path, key))
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (*path, key)))
        else:
            for i, item in enumerate(value):
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (*path, i)))


def _check_text(text: str, path: tuple[Any, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _path(path) or "body"
        raise bad_request(
            f"{where}: invalid Unicode (a lone surrogate {text[exc.start]!r} at character "
            f"{exc.start}); send UTF-8 text",
            param=where,
        ) from None


def _path(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def check_limits(req: Any) -> None:
    """400 naming the field when a parsed request (any of the server's request models)
    carries a list past `LIST_LIMITS`, a stop string or bad word longer than
    `MAX_WORD_CHARS`, an integer outside 64 bits, or `n` past `MAX_N_PER_REQUEST`."""
    for name in INT64_FIELDS:
        value = getattr(req, name, None)
        if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            raise bad_request(f"{name}: expected a 64-bit signed integer, got {value}", param=name)
    n = getattr(req, "n", None)
    if isinstance(n, int) and n > MAX_N_PER_REQUEST:
        raise bad_request(f"n: at most {MAX_N_PER_REQUEST} sequences per request, got {n}", "n")
    for name, limit in LIST_LIMITS.items():
        value = getattr(req, name, None)
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise _too_many(name, len(value), limit)
    for name in ("stop", "bad_words"):
        words = getattr(req, name, None)
        if isinstance(words, str):
            words = [words]
        for i, word in enumerate(words or ()):
            if len(word) > MAX_WORD_CHARS:
                where = f"{name}.{i}"
                raise bad_request(
                    f"{where}: at most {MAX_WORD_CHARS} characters, got {len(word)}", where
                )
    prompt = getattr(req, "prompt", None)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        for i, ids in enumerate(prompt):
            if len(ids) > LIST_LIMITS["allowed_token_ids"]:
                raise _too_many(f"prompt.{i}", len(ids), LIST_LIMITS["allowed_token_ids"])


def _too_many(name: str, got: int, limit: int) -> APIError:
    return bad_request(f"{name}: at most {limit} entries, got {got}", param=name)
