"""A drafter for the scripted model whose acceptance is chosen by the test.

It proposes `num_spec_tokens` drafts per request: the first `num_correct` follow the
scripted model's rule (so verification accepts them), the rest are deliberately wrong (the
scripted token plus one), so everything after them is rejected. `num_correct_by_request`
overrides the count per request id; `fail_for` names requests whose drafting raises (a
drafter bug one request's data triggers, for failure-isolation tests). Use it with `speculative: {method: scripted,
num_speculative_tokens: k}` and the scripted model:

    plugins: [{name: reference-scheduler}, {name: default-sampler},
              {name: scripted-drafter, options: {num_correct: 1}}]
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field

from tandem.core import hookimpl
from tandem.core.worker.draft_context import DraftContext
from tandem.schema.config import ConfigError, EngineConfig
from tandem.testing.scripted_model import scripted_next_token


class ScriptedDrafterOptions(BaseModel):
    num_correct: int | None = Field(None, ge=0, description="correct leading drafts; None: all")
    num_correct_by_request: dict[str, int] = Field(default_factory=dict)
    fail_for: list[str] = Field(default_factory=list, description="request ids that raise")


class ScriptedDrafter:
    role: ClassVar[str] = "drafter"
    speculative_methods: ClassVar[tuple[str, ...]] = ("scripted",)
    aligned_drafts: ClassVar[bool] = True
    Options: ClassVar[type[BaseModel]] = ScriptedDrafterOptions

    def __init__(self, config: EngineConfig, options: ScriptedDrafterOptions) -> None:
        if config.model.vocab_size is None:
            raise ConfigError("scripted-drafter needs the scripted model (model.vocab_size)")
        self.vocab_size = config.model.vocab_size
        self.options = options
        #: Every proposal, in order: (req_id, drafts). Tests read it.
        self.proposals: list[tuple[str, list[int]]] = []

    def _drafts(self, req_id: str, history: list[int], k: int) -> list[int]:
        correct = self.options.num_correct_by_request.get(req_id, self.options.num_correct)
        correct = k if correct is None else min(correct, k)
        drafts: list[int] = []
        seq = list(history)
        for i in range(k):
            token = scripted_next_token(seq, self.vocab_size)
            if i >= correct:
                token = (token + 1) % self.vocab_size
            drafts.append(token)
            seq.append(token)
        return drafts

    @hookimpl
    def propose_drafts(self, context: DraftContext) -> list[list[int]]:
        out = []
        for req_id, history, sampled in zip(
            context.req_ids, context.token_ids, context.sampled_token_ids, strict=True
        ):
            if req_id in self.options.fail_for and sampled:
                raise RuntimeError(f"scripted-drafter: injected failure for {req_id}")
            drafts = self._drafts(req_id, history, context.num_spec_tokens) if sampled else []
            self.proposals.append((req_id, drafts))
            out.append(drafts)
        return out
