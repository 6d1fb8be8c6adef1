"""The grammar-backend contract: compile a spec, make matchers, fill bitmask rows.

A backend turns a `StructuredOutputsParams` into a compiled grammar (off the hot path, in
the plugin's compile pool: `compile` must be thread-safe) and makes one `Matcher` per
request from it. The bitmask layout is xgrammar's: int32 `[rows, ceil(vocab / 32)]`, bit
`t % 32` of word `t // 32` set when token t is allowed.

Matcher invariants: a matcher's state is the request's confirmed output prefix (every token
it accepted). `accept_token` returns False and leaves the state unchanged for a token the
grammar forbids; `rollback(k)` undoes the last k accepted tokens (k is at most the number
of spec tokens accepted since the last confirmed token); after the stop token (EOS) is
accepted the matcher is terminated and only `rollback` may be called.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, ClassVar, Protocol

import torch

from tandem.schema.request_checks import RequestRejectedError
from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.structured_output.json_schema import (
    SUPPORT,
    PreparedSchema,
    SchemaRefused,
    prepare_schema,
)

#: Backends the bundled plugin knows, by the name a request or config uses.
BACKEND_NAMES = ("xgrammar", "outlines")
#: `auto`: the first of these that enforces the request's whole constraint.
AUTO_ORDER = ("xgrammar", "outlines")


class Matcher(Protocol):
    """Per-request grammar state (see the module docstring for the invariants)."""

    def accept_token(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def is_terminated(self) -> bool: ...


class GrammarBackend(Protocol):
    """One constrained-decoding library behind the bitmask contract."""

    name: ClassVar[str]
    #: The library's name in messages ("outlines-core").
    label: ClassVar[str]

    def check(self, spec: StructuredOutputsParams) -> None:
        """Synchronous, cheap checks; raise `RequestRejectedError` naming the field (and,
        for a JSON schema, the path of the keyword the backend cannot enforce)."""

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar (thread-safe; may be slow; raises on a bad spec)."""

    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the grammar's start state."""

    def fill_bitmasks(
        self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]
    ) -> None:
        """Fill `bitmask[rows[i]]` from `matchers[i]` (none terminated), in one batch call
        where the library has one."""


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-ones (everything allowed) int32 bitmask of `num_rows` rows."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


_REGEX_META = set("\\.^$|?*+()[]{}")


def regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it (only the metacharacters are escaped, which
    both backends' regex dialects accept)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def choice_regex(choices: list[str]) -> str:
    """The regex of `choice`: exactly one of the strings."""
    return "(" + "|".join(regex_literal(c) for c in choices) + ")"


_UNSUPPORTED_REGEX = (
    (re.compile(r"\(\?<?[=!]"), "lookaround ((?=, (?!, (?<=, (?<!)"),
    (re.compile(r"\\[1-9]|\(\?P="), "backreferences (\\1, (?P=name))"),
    (re.compile(r"\\[bB]"), "word boundaries (\\b, \\B)"),
)


def check_regex(pattern: str, field: str = "structured_outputs.regex") -> None:
    """Reject, synchronously, regex features neither backend supports and syntax errors
    Python's `re` also sees (the backends' own parsers report the rest at compile time)."""
    stripped = re.sub(r"\\\\", "", pattern)  # escaped backslashes cannot start a feature
    for finder, feature in _UNSUPPORTED_REGEX:
        if finder.search(stripped):
            raise RequestRejectedError(
                f"{field}: unsupported regex feature: {feature}; the grammar backends "
                f"(xgrammar, outlines) compile regular languages only (got {pattern!r})"
            )
    try:
        re.compile(pattern)
    except re.error as exc:
        raise RequestRejectedError(f"{field}: invalid regex {pattern!r}: {exc}") from None


#: (backend, canonical schema text) -> the prepared schema or the refusal (LRU).
_PREPARED: OrderedDict[tuple[str, str], PreparedSchema | SchemaRefused] = OrderedDict()
_PREPARED_SIZE = 256
_PREPARED_LOCK = threading.Lock()


def prepared_json_schema(backend: str, schema: Any) -> PreparedSchema:
    """The schema `backend` compiles for the request's `json` (see `json_schema`), cached
    by (backend, schema); raises `RequestRejectedError` naming the keyword's JSON path
    when the backend cannot enforce it. The result is shared: do not modify it.
    Property order is the schema's own (it is the order the model writes them in)."""
    key = (backend, json.dumps(schema))
    with _PREPARED_LOCK:
        result = _PREPARED.get(key)
        if result is not None:
            _PREPARED.move_to_end(key)
    if result is None:
        try:
            result = prepare_schema(schema, SUPPORT[backend])
        except SchemaRefused as exc:
            result = exc
        with _PREPARED_LOCK:
            _PREPARED[key] = result
            while len(_PREPARED) > _PREPARED_SIZE:
                _PREPARED.popitem(last=False)
    if isinstance(result, SchemaRefused):
        raise RequestRejectedError(f"structured_outputs.json: {result}")
    return result
