"""outlines-core behind the backend contract: JSON schema, regex, choice, JSON object.

outlines-core compiles regular languages only: EBNF (`grammar`) is refused at
`add_request`, naming xgrammar. JSON schemas become a regex through
`build_regex_from_schema` with no whitespace (compact JSON, as the xgrammar backend);
`json_object` is limited to two levels of nesting (`JSON_OBJECT_SCHEMA`).

The `Vocabulary` is built from the local tokenizer, never from the hub: each token's bytes
come from the byte-level BPE alphabet (GPT-2's byte-to-unicode table); special tokens are
left out, EOS is the vocabulary's end token. A matcher is a `Guide` over a shared `Index`;
accepting EOS where the guide is in a final state terminates it (the Guide itself has no
transition on EOS).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import torch

from tandem.schema.request_checks import RequestRejectedError
from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.structured_output.backend import check_regex, choice_regex, prepared_json_schema

#: Deepest rollback a guide supports: more than any number of drafts verified in one step.
MAX_ROLLBACK = 32

_PRIMITIVES: list[dict[str, Any]] = [
    {"type": "string"},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "null"},
]
#: `json_object` on outlines-core: an object whose values are primitives, arrays of
#: primitives or objects of primitives. outlines' regex for `{"type": "object"}` (any
#: nesting) is large enough that its Index takes seconds to build; this one takes ~0.4 s.
JSON_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {
        "anyOf": [
            *_PRIMITIVES,
            {"type": "array", "items": {"anyOf": _PRIMITIVES}},
            {"type": "object", "additionalProperties": {"anyOf": _PRIMITIVES}},
        ]
    },
}


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: the printable Latin-1 bytes stand for
    themselves, every other byte b for chr(256 + its index among the others)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table: dict[str, int] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def build_vocabulary(tokenizer: Any, eos_token_id: int) -> Any:
    """An outlines-core `Vocabulary` from a byte-level BPE tokenizer, offline."""
    from outlines_core import Vocabulary

    decoder = byte_decoder()
    special = set(tokenizer.all_special_ids)
    token_bytes: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special or token_id == eos_token_id:
            continue
        try:
            raw = bytes(decoder[c] for c in token)
        except KeyError:
            raise ValueError(
                f"the outlines backend needs a byte-level BPE tokenizer; token {token!r} "
                "is not in the byte-level alphabet (use the xgrammar backend)"
            ) from None
        token_bytes.setdefault(raw, []).append(token_id)
    return Vocabulary(eos_token_id, token_bytes)


class OutlinesMatcher:
    """A `Guide` plus the termination state (accepted EOS) the guide does not keep."""

    __slots__ = ("guide", "eos_token_id", "terminated")

    def __init__(self, guide: Any, eos_token_id: int) -> None:
        self.guide = guide
        self.eos_token_id = eos_token_id
        self.terminated = False

    def accept_token(self, token_id: int) -> bool:
        if self.terminated:
            return False
        if token_id == self.eos_token_id:
            self.terminated = self.guide.is_finished()
            return self.terminated
        try:
            self.guide.advance(token_id, False)
        except ValueError:  # no transition on this token: the state is unchanged
            return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self.terminated:
            self.terminated = False
            num_tokens -= 1
        if num_tokens > 0:
            self.guide.rollback_state(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]  # a row of a contiguous CPU int32 tensor: contiguous
        self.guide.write_mask_into(target.data_ptr(), target.numel(), target.element_size())

    def is_terminated(self) -> bool:
        return self.terminated


class OutlinesBackend:
    """Compiles `Index`es over one offline `Vocabulary`."""

    name: ClassVar[str] = "outlines"
    label: ClassVar[str] = "outlines-core"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        if eos_token_id is None:
            raise ValueError("the outlines backend needs the model's EOS token id")
        self.eos_token_id = eos_token_id
        self.vocabulary = build_vocabulary(tokenizer, eos_token_id)

    def check(self, spec: StructuredOutputsParams) -> None:
        if spec.grammar is not None:
            raise RequestRejectedError(
                "structured_outputs.grammar: EBNF grammars are not supported by the outlines "
                "backend (outlines-core compiles regular languages); use backend 'xgrammar'"
            )
        if spec.regex is not None:
            check_regex(spec.regex)
        if spec.json is not None:
            prepared_json_schema(self.name, spec.json)

    def regex(self, spec: StructuredOutputsParams) -> str:
        """The regular expression the request's output must match."""
        from outlines_core.json_schema import build_regex_from_schema

        kind = spec.kind
        if kind == "json":
            prepared = prepared_json_schema(self.name, spec.json)
            regex = build_regex_from_schema(json.dumps(prepared.schema), whitespace_pattern="")
            for placeholder, inner in prepared.regexes.items():
                quoted = f'"{placeholder}"'
                if quoted not in regex:
                    raise ValueError(
                        f"outlines-core did not render the bounds placeholder {quoted}"
                    )
                regex = regex.replace(quoted, f"(?:{inner})")
            return regex
        if kind == "json_object":
            return build_regex_from_schema(json.dumps(JSON_OBJECT_SCHEMA), whitespace_pattern="")
        if kind == "regex":
            return spec.regex or ""
        if kind == "choice":
            return choice_regex(spec.choice or [])
        raise ValueError(f"structured_outputs.{kind}: not supported by the outlines backend")

    def compile(self, spec: StructuredOutputsParams) -> Any:
        from outlines_core import Index

        return Index(self.regex(spec), self.vocabulary)

    def matcher(self, compiled: Any) -> OutlinesMatcher:
        from outlines_core import Guide

        return OutlinesMatcher(Guide(compiled, max_rollback=MAX_ROLLBACK), self.eos_token_id)

    def fill_bitmasks(
        self, matchers: list[OutlinesMatcher], bitmask: torch.Tensor, rows: list[int]
    ) -> None:
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)
