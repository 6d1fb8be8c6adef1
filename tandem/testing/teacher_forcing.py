"""Teacher-forced top-1 of a tandem `HFStepModel` along a given token sequence.

The prompt is prefilled as one chunk, then every continuation token is fed as a decode
(one query token, so the decode path runs: the compiled CPU kernel where the model has
one), each step's argmax recorded. The result is tandem's top-1 at each continuation
position given the reference prefix: compare it with the reference's own tokens (greedy
`generate()` output) to measure agreement without letting one early divergence change
every later position.

The model's pool is used as one request in blocks `0, 1, 2, ...` (slot = position), so it
needs `ceil(len(prompt + continuation) / block_size)` blocks.
"""

from __future__ import annotations

import torch

from tandem.core.worker.flat_batch import FlatBatch
from tandem.models.hf_model import HFStepModel


def _step(model: HFStepModel, tokens: list[int], start: int, total_blocks: int) -> torch.Tensor:
    """Logits `[vocab]` at the last of `tokens` (positions `start..`), one request."""
    n = len(tokens)
    positions = torch.arange(start, start + n, dtype=torch.int64)
    batch = FlatBatch(
        req_ids=["teacher"],
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=positions,
        slot_mapping=positions.clone(),
        query_start_loc=torch.tensor([0, n], dtype=torch.int64),
        seq_lens=torch.tensor([start + n], dtype=torch.int64),
        block_tables=torch.arange(total_blocks, dtype=torch.int64)[None],
        logits_indices=torch.tensor([n - 1], dtype=torch.int64),
        sample_req_indices=[0],
        num_draft_tokens=[0],
        draft_token_ids=[],
        block_size=model.block_size,
        num_computed_tokens=[start],
        num_scheduled_tokens=[n],
    )
    return model.forward(batch)[0]


def teacher_forced_top1(
    model: HFStepModel, prompt: list[int], continuation: list[int]
) -> list[int]:
    """`top1[i]` = tandem's argmax after `prompt + continuation[:i]`, for each `i`."""
    if not prompt or not continuation:
        raise ValueError("teacher forcing needs a prompt and a continuation")
    total = len(prompt) + len(continuation)
    blocks = -(-total // model.block_size)
    top1 = [int(_step(model, prompt, 0, blocks).argmax())]
    for i, token in enumerate(continuation[:-1]):
        top1.append(int(_step(model, [token], len(prompt) + i, blocks).argmax()))
    return top1
