"""EAGLE drafter: a one-layer draft head over the target's hidden states (EAGLE-1 style).

After each sampled step the head first catches up on the step's valid rows: at position p
it reads the target's hidden state at p and token p+1, writing its KV at p (in its own
pool, laid out like the target's: see `draft_kv`). Rows after a request's accepted prefix
(rejected drafts) are skipped, and their slots are overwritten when the target computes
those positions again. Then it drafts k tokens for every sampling request at once: the
feature at the last valid row (position N-2, N = known tokens) predicts token N through the
target's LM head; each further step feeds (feature, drafted token) at the next position.
Drafts are greedy (argmax), so the drafter is deterministic (a one-hot q for rejection
sampling). The head keeps no per-request state beyond its KV pool, which the scheduler's
block allocation already owns, so finished requests need no cleanup.

Stack: `speculative: {method: eagle, num_speculative_tokens: k, model: <head dir>}` (the
default stack adds `eagle-drafter`); build a head with `examples/train_eagle_head.py` or,
for tests, `save_random_eagle_head`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from tandem.core import hookimpl
from tandem.core.worker.draft_context import DraftContext, DraftTarget
from tandem.schema.config import ConfigError, EngineConfig
from tandem.spec_decode.draft_kv import DraftBlockTables, valid_rows
from tandem.spec_decode.eagle_head import CONFIG_FILE, EagleHead, load_eagle_head

if TYPE_CHECKING:
    from tandem.models.paged_attention import PagedAttentionMetadata

#: paged_attention reads the layer index of the KV pool from its module argument.
_HEAD_LAYER = SimpleNamespace(layer_idx=0)


class EagleDrafterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="head checkpoint dir (default: speculative.model)")


@dataclass(slots=True)
class _Serving:
    """What the drafter builds on its first call, from the target it serves."""

    head: EagleHead
    target: DraftTarget
    #: The draft vocabulary's LM-head rows (None: the target's whole LM head).
    lm_head: Any
    #: Target token id of each LM-head row the drafter scores (None: all, in order).
    draft_vocab: torch.Tensor | None
    tables: DraftBlockTables
    kv: list[tuple[torch.Tensor, torch.Tensor]]


class EagleDrafter:
    role: ClassVar[str] = "drafter"
    speculative_methods: ClassVar[tuple[str, ...]] = ("eagle",)
    Options: ClassVar[type[BaseModel]] = EagleDrafterOptions
    #: Drafts are token ids the worker knows right after sampling (async-compatible).
    aligned_drafts: ClassVar[bool] = True
    #: The runner keeps the target's last hidden states for `DraftContext.hidden_states`.
    needs_hidden_states: ClassVar[bool] = True

    def __init__(self, config: EngineConfig, options: EagleDrafterOptions) -> None:
        # paged_attention registers itself with transformers when imported: bound here, once,
        # so importing the class (`tandem plugins list`) loads no transformers and no step
        # pays an import.
        global build_metadata, paged_attention
        from tandem.models.paged_attention import build_metadata, paged_attention

        spec = config.speculative
        path = options.model or (spec.model if spec is not None else None)
        if not path:
            raise ConfigError(
                "eagle-drafter: speculative.model must name an EAGLE head checkpoint "
                "directory (see examples/train_eagle_head.py)"
            )
        self.head_dir = Path(path).expanduser()
        if not (self.head_dir / CONFIG_FILE).is_file():
            raise ConfigError(
                f"eagle-drafter: {self.head_dir} has no {CONFIG_FILE}: not an EAGLE head "
                "checkpoint (create one with examples/train_eagle_head.py)"
            )
        self.tables = DraftBlockTables.for_config(config, "eagle-drafter")
        self.block_size = self.tables.block_size
        self._serving: _Serving | None = None

    def _setup(self, target: DraftTarget | None) -> _Serving:
        if target is None:
            raise ConfigError(
                "eagle-drafter needs a target model that offers a DraftTarget (a Llama-family "
                "transformers model)"
            )
        hf_config = target.hf_config
        head = load_eagle_head(self.head_dir, device=target.device, dtype=target.dtype)
        cfg = head.config
        if (cfg.target_vocab_size, cfg.target_hidden_size) != (
            hf_config.vocab_size,
            hf_config.hidden_size,
        ):
            raise ConfigError(
                f"eagle-drafter: the head in {self.head_dir} is for a target with vocab "
                f"{cfg.target_vocab_size} and hidden size {cfg.target_hidden_size}; this "
                f"target has {hf_config.vocab_size} and {hf_config.hidden_size}"
            )
        target_head_dim = (
            getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads
        )
        if cfg.head_dim != target_head_dim:
            raise ConfigError("eagle-drafter: the head's head_dim must equal the target's")
        tables = self.tables
        shape = (tables.total_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        kv = [
            (
                torch.zeros(shape, dtype=target.dtype, device=target.device),
                torch.zeros(shape, dtype=target.dtype, device=target.device),
            )
        ]
        draft_vocab = head.draft_vocab
        lm_head = None
        if draft_vocab is not None:
            from tandem.models.packed_linear import PackedLinear

            lm_head = PackedLinear(target.lm_head_rows(draft_vocab))
        return _Serving(head, target, lm_head, draft_vocab, tables, kv)

    @staticmethod
    def _attend(
        meta: PagedAttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Paged attention for `[T, H, D]` queries/keys/values; writes K/V at the slots."""
        out, _ = paged_attention(
            _HEAD_LAYER,  # type: ignore[arg-type]
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            None,
            scaling=q.shape[-1] ** -0.5,
            paged=meta,
        )
        return out[0]

    def _run_head(
        self,
        s: _Serving,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor:
        embeds = s.target.embed(tokens).to(s.target.dtype)
        cos, sin = s.target.rotary(embeds[None], positions[None])
        return s.head(
            embeds,
            hidden,
            cos[0][:, None, :],
            sin[0][:, None, :],
            lambda q, k, v: self._attend(meta, q, k, v),
        )

    @staticmethod
    def _greedy(s: _Serving, feature: torch.Tensor) -> torch.Tensor:
        if s.lm_head is None:
            return s.target.logits(feature).argmax(-1)
        return s.draft_vocab[s.lm_head(feature).argmax(-1)]

    @hookimpl
    def propose_drafts(self, context: DraftContext) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in context.req_ids]
        batch = context.batch
        if batch is None or not context.req_ids or batch.num_tokens == 0:
            return proposals
        if context.hidden_states is None:
            raise RuntimeError("eagle-drafter: the runner passed no hidden states")
        if self._serving is None:
            self._serving = self._setup(context.target)
        s = self._serving
        k = context.num_spec_tokens
        with torch.inference_mode():
            rows = valid_rows(context)
            drafting = [
                i
                for i, sampled in enumerate(context.sampled_token_ids)
                if sampled and rows.seq_lens[i] > rows.num_computed[i]
            ]
            drafting_set = set(drafting)
            table = s.tables.table(
                context.block_ids,
                [n + (k - 1 if i in drafting_set else 0) for i, n in enumerate(rows.seq_lens)],
                batch.input_ids.device,
            )
            # Catch-up: (target hidden at p, token p+1) at every valid position p. Token p+1
            # is the next input row, except after each request's last valid row, where it
            # is the next known token (the bonus token, or the next prompt token of a chunk).
            input_ids = batch.input_ids
            next_tokens = input_ids[(rows.rows + 1).clamp(max=batch.num_tokens - 1)]
            last = [j for j in rows.last if j >= 0]
            tails = [
                context.token_ids[i][n]
                for i, n in enumerate(rows.seq_lens)
                if rows.seq_lens[i] > rows.num_computed[i]
            ]
            next_tokens[torch.tensor(last, dtype=torch.int64, device=input_ids.device)] = (
                torch.tensor(tails, dtype=input_ids.dtype).to(input_ids.device)
            )
            meta = build_metadata(
                s.kv,
                s.tables.slots(table, rows.req_index, rows.positions),
                rows.query_start_loc,
                rows.num_computed,
                rows.seq_lens,
                table,
                self.block_size,
            )
            features = self._run_head(
                s, next_tokens, context.hidden_states[rows.rows], rows.positions, meta
            )
            if not drafting or k == 0:
                return proposals
            device = input_ids.device
            index = torch.tensor(drafting, dtype=torch.int64, device=device)
            feature = features[torch.tensor([rows.last[i] for i in drafting], device=device)]
            token = self._greedy(s, feature)
            drafts = [token]
            draft_table = table[index]
            local = torch.arange(len(drafting), device=device)
            # With N known tokens (valid rows end at N-2 = seq_len - 1), the head reads draft
            # j (1-based) at position N-2+j = seq_len-1+j, and predicts token N+j.
            base = [rows.seq_lens[i] - 1 for i in drafting]
            for j in range(1, k):
                starts = [p + j for p in base]
                positions = torch.tensor(starts, dtype=torch.int64).to(device)
                meta = build_metadata(
                    s.kv,
                    s.tables.slots(draft_table, local, positions),
                    list(range(len(drafting) + 1)),
                    starts,
                    [p + 1 for p in starts],
                    draft_table,
                    self.block_size,
                )
                feature = self._run_head(s, token, feature, positions, meta)
                token = self._greedy(s, feature)
                drafts.append(token)
            for i, row in zip(drafting, torch.stack(drafts, dim=1).tolist(), strict=True):
                proposals[i] = row
        return proposals
