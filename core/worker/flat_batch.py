"""One step's inputs, flattened: every scheduled token of every request in one sequence.

Prefill chunks, decodes and draft-verifying requests go into the same forward pass. Each
request contributes `num_scheduled_tokens` consecutive tokens at positions
`[num_computed_tokens, num_computed_tokens + n)`. `slot_mapping[t]` is the paged-cache slot
token t writes; `block_tables[r]` lists request r's blocks (padded with 0). Logits are
computed only at `logits_indices`: the last `1 + num_drafts` tokens of each request that
samples this step (a prefill chunk that does not reach the end of its known tokens does not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class FlatBatch:
    req_ids: list[str]
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [R + 1] int64, cumulative scheduled tokens
    seq_lens: torch.Tensor  # [R] int64, tokens in KV after this step
    block_tables: torch.Tensor  # [R, max_blocks] int64
    logits_indices: torch.Tensor  # [S] int64, flat token index of each sampled row
    sample_req_indices: list[int]  # request index of each request that samples
    num_draft_tokens: list[int]  # drafts verified, per sampling request
    draft_token_ids: list[int]  # flattened drafts of the sampling requests
    block_size: int
    #: Host copies, per request: the position of its first scheduled token, and its count.
    num_computed_tokens: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


def build_flat_batch(
    req_ids: list[str],
    token_ids: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    drafts: list[list[int]],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
) -> FlatBatch:
    """Flatten per-request inputs. `token_ids[r]` are request r's known tokens; its input is
    `(token_ids[r] + drafts[r])[num_computed[r] : num_computed[r] + num_scheduled[r]]`."""
    flat_tokens: list[int] = []
    positions: list[torch.Tensor] = []
    logits_indices: list[int] = []
    sample_req_indices: list[int] = []
    num_draft_tokens: list[int] = []
    draft_ids: list[int] = []
    offset = 0
    seq_lens = []
    for r, (tokens, start, n, draft) in enumerate(
        zip(token_ids, num_computed, num_scheduled, drafts, strict=True)
    ):
        end = start + n
        known = len(tokens)
        if end <= known:
            flat_tokens.extend(tokens[start:end])
        else:
            flat_tokens.extend(tokens[start:])
            flat_tokens.extend(draft[: end - known])
        positions.append(torch.arange(start, end, dtype=torch.int64))
        seq_lens.append(end)
        if end >= known:  # reaches the last known token: this request samples
            k = end - known
            sample_req_indices.append(r)
            num_draft_tokens.append(k)
            draft_ids.extend(draft[:k])
            logits_indices.extend(range(offset + n - 1 - k, offset + n))
        offset += n
    pos = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
    max_blocks = max((len(b) for b in block_ids), default=0)
    table = torch.zeros((len(req_ids), max(max_blocks, 1)), dtype=torch.int64)
    for r, blocks in enumerate(block_ids):
        if blocks:
            table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    counts = torch.tensor(num_scheduled, dtype=torch.int64)
    token_req = torch.repeat_interleave(torch.arange(len(req_ids)), counts)
    block_of_token = table[token_req, pos // block_size]
    slot_mapping = block_of_token * block_size + pos % block_size
    query_start_loc = torch.zeros(len(req_ids) + 1, dtype=torch.int64)
    query_start_loc[1:] = torch.cumsum(counts, 0)
    return FlatBatch(
        req_ids=req_ids,
        input_ids=torch.tensor(flat_tokens, dtype=torch.int64, device=device),
        positions=pos.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_tables=table.to(device),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        sample_req_indices=sample_req_indices,
        num_draft_tokens=num_draft_tokens,
        draft_token_ids=draft_ids,
        block_size=block_size,
        num_computed_tokens=list(num_computed),
        num_scheduled_tokens=list(num_scheduled),
    )
