"""Draft-model drafter: a smaller causal LM with the target's tokenizer proposes k tokens.

The draft model is an `HFStepModel` with its own paged KV, laid out like the target's (see
`draft_kv`): after each sampled step it runs one forward over every request's valid rows
(the tokens now in its history: prompt chunks, accepted drafts) plus, for each sampling
request, the bonus token at position N-1 (N = known tokens), whose logits give draft 1;
then k-1 single-token forwards, batched over the sampling requests, give the rest. Drafts
are greedy (argmax). Rows past a request's accepted prefix are never written: the next
step's forward rewrites their slots. With the target itself as draft model, greedy
acceptance is 100%, which makes it a plumbing test.

Stack: `speculative: {method: draft_model, num_speculative_tokens: k, model: <dir or
"default">}` (the default stack adds `draft-model-drafter`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from tandem.core import hookimpl
from tandem.core.worker.draft_context import DraftContext, DraftTarget
from tandem.core.worker.flat_batch import FlatBatch
from tandem.schema.config import ConfigError, EngineConfig
from tandem.spec_decode.draft_kv import (
    DraftBlockTables,
    batch_row_starts,
    ragged_index,
    valid_rows,
)


class DraftModelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="draft model (default: speculative.model)")


class DraftModelDrafter:
    role: ClassVar[str] = "drafter"
    speculative_methods: ClassVar[tuple[str, ...]] = ("draft_model",)
    Options: ClassVar[type[BaseModel]] = DraftModelOptions
    aligned_drafts: ClassVar[bool] = True

    def __init__(self, config: EngineConfig, options: DraftModelOptions) -> None:
        spec = config.speculative
        self.model_name = options.model or (spec.model if spec is not None else None)
        if not self.model_name:
            raise ConfigError(
                "draft-model-drafter: speculative.model must name the draft model "
                "(a directory, a GGUF file or 'default')"
            )
        self.tables = DraftBlockTables.for_config(config, "draft-model-drafter")
        self.block_size = self.tables.block_size
        self.model: Any = None

    def _setup(self, target: DraftTarget | None) -> Any:
        from tandem.models.cpu_kernels import paged_decode_kernel
        from tandem.models.hf_model import HFStepModel
        from tandem.models.model_files import resolve_model_dir

        if target is None:
            raise ConfigError(
                "draft-model-drafter needs a target model that offers a DraftTarget "
                "(its device, dtype and vocabulary)"
            )
        device, dtype = target.device, target.dtype
        use_kernel = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        model = HFStepModel(
            model_dir=resolve_model_dir(self.model_name),
            dtype=dtype,
            num_blocks=self.tables.total_blocks,
            block_size=self.block_size,
            device=device,
            decode_kernel=paged_decode_kernel() if use_kernel else None,
        )
        if model.vocab_size > target.vocab_size:
            raise ConfigError(
                f"draft-model-drafter: the draft model's vocabulary ({model.vocab_size}) is "
                f"larger than the target's ({target.vocab_size}): not the same tokenizer"
            )
        return model

    def _forward(
        self,
        table: torch.Tensor,
        req_index: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: list[int],
        seq_lens: list[int],
        logits_rows: list[int],
    ) -> torch.Tensor:
        """One draft-model forward; greedy tokens at `logits_rows`."""
        device = tokens.device
        batch = FlatBatch(
            req_ids=[],
            input_ids=tokens,
            positions=positions,
            slot_mapping=self.tables.slots(table, req_index, positions),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=table,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(device),
            sample_req_indices=[],
            num_draft_tokens=[],
            draft_token_ids=[],
            block_size=self.block_size,
        )
        return self.model.forward(batch).argmax(-1)

    @hookimpl
    def propose_drafts(self, context: DraftContext) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in context.req_ids]
        batch = context.batch
        if batch is None or not context.req_ids or batch.num_tokens == 0:
            return proposals
        if self.model is None:
            self.model = self._setup(context.target)
        k = context.num_spec_tokens
        device = batch.input_ids.device
        with torch.inference_mode():
            rows = valid_rows(context)
            counts = [b - a for a, b in zip(rows.num_computed, rows.seq_lens, strict=True)]
            drafting = [i for i, s in enumerate(context.sampled_token_ids) if s and counts[i]]
            bonus = [0] * len(counts)
            for i in drafting:
                bonus[i] = 1
                if len(context.token_ids[i]) != rows.seq_lens[i] + 1:
                    raise RuntimeError(
                        f"draft-model-drafter: {context.req_ids[i]} has "
                        f"{len(context.token_ids[i])} tokens, valid rows end at "
                        f"{rows.seq_lens[i]}"
                    )
            # Each request's valid rows, then its bonus token (the last known token).
            total = [n + b for n, b in zip(counts, bonus, strict=True)]
            qsl, req_index, within = ragged_index(total)
            first_row = torch.tensor(batch_row_starts(context), dtype=torch.int64)
            flat = (first_row[req_index] + within).clamp(max=batch.num_tokens - 1).to(device)
            is_bonus = (within == torch.tensor(counts)[req_index]).to(device)
            bonus_ids = torch.tensor(
                [context.token_ids[i][-1] if bonus[i] else 0 for i in range(len(counts))],
                dtype=torch.int64,
            ).to(device)
            positions = (torch.tensor(rows.num_computed)[req_index] + within).to(device)
            req_index = req_index.to(device)
            tokens = torch.where(is_bonus, bonus_ids[req_index], batch.input_ids[flat])
            seq_lens = [c + n for c, n in zip(rows.num_computed, total, strict=True)]
            table = self.tables.table(
                context.block_ids,
                [n + (k - 1 if bonus[i] else 0) for i, n in enumerate(seq_lens)],
                device,
            )
            token = self._forward(
                table,
                req_index,
                tokens,
                positions,
                qsl,
                seq_lens,
                [qsl[i + 1] - 1 for i in drafting],
            )
            if not drafting or k == 0:
                return proposals
            drafts = [token]
            draft_table = table[torch.tensor(drafting, device=device)]
            local = torch.arange(len(drafting), device=device)
            decode_qsl = list(range(len(drafting) + 1))
            for j in range(1, k):
                # Draft j sits at position N - 1 + j (the bonus token is at N - 1).
                lens = [seq_lens[i] + j for i in drafting]
                positions = torch.tensor([n - 1 for n in lens], dtype=torch.int64).to(device)
                token = self._forward(
                    draft_table, local, token, positions, decode_qsl, lens, decode_qsl[:-1]
                )
                drafts.append(token)
            for i, row in zip(drafting, torch.stack(drafts, dim=1).tolist(), strict=True):
                proposals[i] = row
        return proposals
