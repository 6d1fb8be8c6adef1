"""Third-party plugins as a user writes them before packaging: no entry point, each
declaring the name it answers. Module level, so a worker process imports them by path
(`third_party_plugins:EchoDrafter`).

- `EchoDrafter` answers `speculative.method: echo`: it proposes the scripted model's own next
  tokens (every draft is right), so outputs stay exact and every draft is accepted.
- `EvenGrammar` answers `structured_output.backend: even-only`: a constrained request
  (`structured_outputs={"custom": {}}`) may only produce even token ids.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.draft_context import DraftContext
from tandem.testing.scripted_model import scripted_next_token


class EchoDrafter(TandemPlugin):
    role: ClassVar[str] = "drafter"
    speculative_methods: ClassVar[tuple[str, ...]] = ("echo",)

    @hookimpl
    def propose_drafts(self, context: DraftContext) -> list[list[int]]:
        vocab = self.config.model.vocab_size
        assert vocab is not None
        out = []
        for history, sampled in zip(context.token_ids, context.sampled_token_ids, strict=True):
            drafts: list[int] = []
            if sampled:
                seq = list(history)
                for _ in range(context.num_spec_tokens):
                    seq.append(scripted_next_token(seq, vocab))
                drafts = seq[len(history) :]
            out.append(drafts)
        return out


class OtherEchoDrafter(EchoDrafter):
    """Declares the same method as `EchoDrafter`: installing both is a conflict."""


class EvenGrammar(TandemPlugin):
    role: ClassVar[str] = "grammar"
    grammar_backends: ClassVar[tuple[str, ...]] = ("even-only",)

    @hookimpl
    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        ids = scheduler_output.structured_output_request_ids
        if not ids:
            return None
        vocab = self.config.model.vocab_size
        assert vocab is not None
        even = torch.zeros(-(-vocab // 32) * 32, dtype=torch.int64)
        even[0:vocab:2] = 1
        packed = (even.view(-1, 32) << torch.arange(32)).sum(1)
        row = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
        rows = sum(1 + len(scheduler_output.scheduled_spec_decode_tokens.get(r, ())) for r in ids)
        return row.expand(rows, -1).clone()


class NeedsTokenizerGrammar(EvenGrammar):
    """A grammar plugin that needs the model's tokenizer (the scripted model has none)."""

    grammar_backends: ClassVar[tuple[str, ...]] = ("tokenized",)
    needs_tokenizer: ClassVar[bool] = True


def expected_even_output(prompt: list[int], max_tokens: int, vocab: int) -> list[int]:
    """Greedy tokens of the scripted model when only even ids are allowed: the scripted
    token when it is even, else the even id with the highest ripple logit (the scripted
    model's logits: a peak on its token over a deterministic ripple; ties to the smaller
    id)."""
    history, out = list(prompt), []
    for _ in range(max_tokens):
        token = scripted_next_token(history, vocab)
        if token % 2:
            ripple = {v: (token * 131 + v * 71) % 193 for v in range(0, vocab, 2)}
            token = max(ripple, key=lambda v: (ripple[v], -v))
        history.append(token)
        out.append(token)
    return out
