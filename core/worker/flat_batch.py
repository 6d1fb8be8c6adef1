"""One step's inputs, flattened: every scheduled token of every request in one sequence.

Prefill chunks, decodes and draft-verifying requests go into the same forward pass. Each
request contributes `num_scheduled_tokens` consecutive tokens at positions
`[num_computed_tokens, num_computed_tokens + n)`. `slot_mapping[t]` is the paged-cache slot
token t writes; `block_tables[r]` lists request r's blocks (padded with 0). Logits are
computed only at `logits_indices`: the last `1 + num_drafts` tokens of each request that
samples this step (a prefill chunk that does not reach the end of its known tokens does not).

`prepare_flat_batch` builds it from the persistent `InputBatch` with a fixed number of
tensor operations (gathers over index tensors); Python touches only per-request scalars.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.core.worker.block_table import slot_mapping
from tandem.core.worker.host_tensors import host_int64
from tandem.core.worker.input_batch import InputBatch


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
    #: Host: flat indices whose input id is an async placeholder (`-1`, a sampled id still
    #: on the device); the runner fills them on the device before the forward.
    placeholder_positions: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


def prepare_flat_batch(
    input_batch: InputBatch,
    req_ids: list[str],
    rows: list[int],
    num_scheduled: list[int],
    drafts: dict[str, list[int]],
    block_size: int,
    device: torch.device,
    find_placeholders: bool = False,
) -> FlatBatch:
    """The step's inputs for `req_ids` (at `rows` of `input_batch`, in row order), each
    running `num_scheduled[i]` tokens from its row's `num_computed_tokens`; `drafts[req]`
    are the drafts a request verifies (exactly the tokens scheduled past its known ones).
    `find_placeholders` lists the `-1` inputs in `placeholder_positions`.

    Effects on `input_batch`: the drafts are written after each row's known tokens (the
    step reads its inputs there), and each row's `num_computed_tokens` advances by its
    scheduled count (`InputBatch.append_sampled` rolls rejected drafts back).
    """
    row_index = host_int64(rows)
    start = input_batch.num_computed_tokens[row_index]
    known = input_batch.num_tokens[row_index]
    if drafts:
        _write_drafts(input_batch, req_ids, rows, known, drafts)
    if max(num_scheduled, default=1) == 1:  # one token each (decodes): token t is request t
        req_index = torch.arange(len(rows), dtype=torch.int64)
        positions, token_rows, end = start, row_index, start + 1
        query_start_loc = torch.arange(len(rows) + 1, dtype=torch.int64)
    else:
        counts = host_int64(num_scheduled)
        total = sum(num_scheduled)
        query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=query_start_loc[1:])
        req_index = torch.repeat_interleave(torch.arange(len(rows)), counts, output_size=total)
        first_position = start - query_start_loc[:-1]
        positions = torch.arange(total, dtype=torch.int64) + first_position[req_index]
        token_rows, end = row_index[req_index], start + counts
    input_ids = input_batch.token_ids[token_rows, positions]
    table = input_batch.block_table.gather(row_index, rows)
    slots = slot_mapping(table, req_index, positions, block_size)
    input_batch.num_computed_tokens[row_index] = end
    sample_req_indices, logits_indices, num_draft_tokens = _sampling_rows(
        query_start_loc[1:], end - known, sum(len(d) for d in drafts.values())
    )
    return FlatBatch(
        req_ids=req_ids,
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=end.to(device),
        block_tables=table.to(device),
        logits_indices=logits_indices.to(device),
        sample_req_indices=sample_req_indices,
        num_draft_tokens=num_draft_tokens,
        draft_token_ids=[t for r in sample_req_indices for t in drafts.get(req_ids[r], ())],
        block_size=block_size,
        num_computed_tokens=start.tolist(),
        num_scheduled_tokens=list(num_scheduled),
        placeholder_positions=torch.nonzero(input_ids < 0).flatten().tolist()
        if find_placeholders
        else [],
    )


def _sampling_rows(
    cu: torch.Tensor, past_known: torch.Tensor, num_drafts: int
) -> tuple[list[int], torch.Tensor, list[int]]:
    """The requests that sample (their scheduled tokens reach their last known token:
    `past_known >= 0`, the tokens past it being drafts), the logits rows (each sampling
    request's last `1 + drafts` tokens; `cu[i]` ends request i's tokens) and the drafts
    each verifies, which must add up to the `num_drafts` given."""
    if num_drafts == 0 and not bool(past_known.any()):  # no drafts, no chunk mid-prompt
        return list(range(len(cu))), cu - 1, [0] * len(cu)
    sampling = torch.nonzero(past_known >= 0).flatten()
    k = past_known[sampling]
    if int(k.sum()) != num_drafts:
        raise ValueError(
            f"{num_drafts} drafts given, but {int(k.sum())} tokens are scheduled past the "
            "known ones"
        )
    if num_drafts == 0:
        return sampling.tolist(), (cu - 1)[sampling], [0] * len(sampling)
    num_rows = k + 1
    total = len(sampling) + num_drafts
    offsets = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(
        torch.cumsum(num_rows, 0) - num_rows, num_rows, output_size=total
    )
    firsts = (cu - 1)[sampling] - k
    logits_indices = torch.repeat_interleave(firsts, num_rows, output_size=total) + offsets
    return sampling.tolist(), logits_indices, k.tolist()


def _write_drafts(
    input_batch: InputBatch,
    req_ids: list[str],
    rows: list[int],
    known: torch.Tensor,
    drafts: dict[str, list[int]],
) -> None:
    index = {req_id: i for i, req_id in enumerate(req_ids)}
    known_list = known.tolist()
    with_drafts = [(index[r], d) for r, d in drafts.items() if d]
    input_batch.write_drafts(
        [rows[i] for i, _ in with_drafts],
        [known_list[i] for i, _ in with_drafts],
        [d for _, d in with_drafts],
    )
