"""A deterministic fake model that still exercises the paged-KV path.

Each step it writes every input token id into a paged "KV cache" (one int64 per slot) at
its slot, then computes each sampled position's next token from the history it reads back
through the request's block table. A wrong block table, slot mapping or prefix-cache hit
therefore changes the output. The rule, for a history h_0..h_p (the tokens at positions
0..p):

    S = sum((i + 1) * h_i)            next = ((S mod P) * A + (p + 1) * B) mod P mod vocab

`scripted_next_token` is the same rule in plain Python: the reference to compare against.
Logits put 8.0 on the scripted token over a deterministic ripple in [0, 2), so greedy
decoding returns the scripted token and temperature sampling has a known distribution.
"""

from __future__ import annotations

import torch

from tandem.core.worker.flat_batch import FlatBatch

_P = 1_000_003
_A = 7919
_B = 104_729
PEAK_LOGIT = 8.0


def scripted_next_token(history: list[int], vocab_size: int) -> int:
    """The scripted model's greedy next token after `history` (prompt + outputs so far)."""
    total = sum((i + 1) * t for i, t in enumerate(history))
    return ((total % _P) * _A + len(history) * _B) % _P % vocab_size


def scripted_logits(next_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits rows with PEAK_LOGIT at each `next_tokens[i]` over a deterministic ripple."""
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=next_tokens.device)
    ripple = ((next_tokens[:, None] * 131 + vocab[None, :] * 71) % 193).to(torch.float32)
    logits = ripple * (2.0 / 193.0)
    logits.scatter_(1, next_tokens[:, None], PEAK_LOGIT)
    return logits


class ScriptedModel:
    """`StepModel` of the scripted rule over a paged int64 cache of `num_blocks * block_size`."""

    def __init__(
        self, vocab_size: int, num_blocks: int, block_size: int, device: torch.device | str = "cpu"
    ) -> None:
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_cache = torch.full(
            (num_blocks * block_size,), -1, dtype=torch.int64, device=self.device
        )

    def write_kv(self, slot_mapping: torch.Tensor, input_ids: torch.Tensor) -> None:
        self.kv_cache.index_copy_(0, slot_mapping, input_ids)

    def next_tokens(self, batch: FlatBatch) -> torch.Tensor:
        """Scripted next token at every logits position, read back through the block table."""
        rows = batch.logits_indices
        if rows.numel() == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        req_of_token = torch.repeat_interleave(
            torch.arange(batch.num_reqs, device=self.device),
            batch.query_start_loc[1:] - batch.query_start_loc[:-1],
        )
        req = req_of_token[rows]
        pos = batch.positions[rows]
        length = int(pos.max().item()) + 1
        j = torch.arange(length, dtype=torch.int64, device=self.device)
        block_col = torch.clamp(j // self.block_size, max=batch.block_tables.shape[1] - 1)
        blocks = batch.block_tables[req][:, block_col]
        slots = blocks * self.block_size + (j % self.block_size)[None, :]
        history = self.kv_cache[slots]
        valid = j[None, :] <= pos[:, None]
        total = torch.where(valid, history * (j + 1)[None, :], 0).sum(dim=1)
        return ((total % _P) * _A + (pos + 1) * _B) % _P % self.vocab_size

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        self.write_kv(batch.slot_mapping, batch.input_ids)
        return scripted_logits(self.next_tokens(batch), self.vocab_size)
