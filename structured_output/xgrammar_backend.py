"""xgrammar behind the backend contract: JSON schema, regex, EBNF, choice, JSON object.

JSON is compiled compact (`any_whitespace=False`, separators `","` and `":"`): a small model
left free to emit whitespace tends to loop on it, and outlines-core is configured the same
way so that both backends accept the same strings. The stop tokens are the model's EOS;
the matcher terminates when it accepts it. Bitmask rows of requests without drafts are
filled in one `BatchGrammarMatcher` call.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import torch

from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.structured_output.backend import check_regex, choice_regex, prepared_json_schema


class XgrammarMatcher:
    """A `xgrammar.GrammarMatcher` with the contract's names."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class XgrammarBackend:
    """Compiles with one `GrammarCompiler` (thread-safe) over the model's tokenizer."""

    name: ClassVar[str] = "xgrammar"
    label: ClassVar[str] = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        stop = [eos_token_id] if eos_token_id is not None else None
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop
        )
        # The plugin caches compiled grammars itself, by (backend, spec).
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def check(self, spec: StructuredOutputsParams) -> None:
        if spec.regex is not None:
            check_regex(spec.regex)
        if spec.json is not None:
            prepared_json_schema(self.name, spec.json)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        kind = spec.kind
        if kind == "json" or kind == "json_object":
            if kind == "json":
                schema = prepared_json_schema(self.name, spec.json).schema
            else:
                schema = {"type": "object"}
            return self.compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(",", ":")
            )
        if kind == "regex":
            return self.compiler.compile_regex(spec.regex)
        if kind == "choice":
            return self.compiler.compile_regex(choice_regex(spec.choice or []))
        if kind == "grammar":
            return self.compiler.compile_grammar(spec.grammar)
        raise ValueError(f"structured_outputs.{kind}: not supported by the xgrammar backend")

    def matcher(self, compiled: Any) -> XgrammarMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def fill_bitmasks(
        self, matchers: list[XgrammarMatcher], bitmask: torch.Tensor, rows: list[int]
    ) -> None:
        if matchers:
            self.batch.batch_fill_next_token_bitmask(
                [m.matcher for m in matchers], bitmask, indices=rows
            )
