"""Per-request failure isolation for the `sample` hook.

When sampling a batch raises, the runner does not know which request caused it (a sampling
parameter no validation caught, a plugin bug that only one request's options trigger). It
then samples each request alone to find the ones that fail, samples the rest together once
more, and reports the failures per request: the kernel ends exactly those requests with
`finish_reason == "error"` and the others go on. The healthy path costs nothing: this runs
only after the batched call raised.

A failed request gets token 0 in its sampled slot (a valid id, so a step that is already
scheduled with it under async scheduling can still run its forward); the kernel aborts the
request before any of its tokens reach the client.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from tandem.core.model_runner_output import SamplerOutput
from tandem.core.worker.flat_batch import FlatBatch
from tandem.core.worker.sampling_metadata import SamplingMetadata

logger = logging.getLogger("tandem.worker")

SampleFn = Callable[[torch.Tensor, SamplingMetadata], SamplerOutput | None]
MetadataFn = Callable[[FlatBatch, torch.Tensor | None], SamplingMetadata]


def _rows_of(batch: FlatBatch) -> list[range]:
    """The logits rows of each sampling request (`1 + drafts` consecutive rows)."""
    rows, start = [], 0
    for k in batch.num_draft_tokens:
        rows.append(range(start, start + k + 1))
        start += k + 1
    return rows


def _subset(batch: FlatBatch, positions: list[int]) -> FlatBatch:
    """`batch` with only the sampling requests at `positions` (indices into
    `sample_req_indices`); everything the forward used is shared, not copied."""
    draft_starts = [0]
    for k in batch.num_draft_tokens:
        draft_starts.append(draft_starts[-1] + k)
    return dataclasses.replace(
        batch,
        sample_req_indices=[batch.sample_req_indices[p] for p in positions],
        num_draft_tokens=[batch.num_draft_tokens[p] for p in positions],
        draft_token_ids=[
            t
            for p in positions
            for t in batch.draft_token_ids[draft_starts[p] : draft_starts[p + 1]]
        ],
    )


def _sample_subset(
    sample: SampleFn,
    metadata_for: MetadataFn,
    batch: FlatBatch,
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    positions: list[int],
) -> tuple[SamplerOutput, list[int]]:
    """Sample the requests at `positions` together; returns the output and its logits rows."""
    all_rows = _rows_of(batch)
    rows = [row for p in positions for row in all_rows[p]]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    sub_bitmask = bitmask[index.to(bitmask.device)] if bitmask is not None else None
    result = sample(logits[index], metadata_for(_subset(batch, positions), sub_bitmask))
    if result is None:
        raise RuntimeError("no plugin answered the `sample` hook: the stack needs a sampler")
    return result, rows


def sample_isolating_failures(
    sample: SampleFn,
    metadata_for: MetadataFn,
    batch: FlatBatch,
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    error: BaseException,
) -> tuple[SamplerOutput, dict[int, str]]:
    """Sample the batch after a batched `sample` raised `error`.

    Returns a `SamplerOutput` shaped as the batched call's would be (one row per sampling
    request, logprobs rows per logits row) and the failures as {request index in
    `batch.req_ids`: message}. Raises `error` again when every request samples fine
    alone (only the combination fails: nothing can be blamed on one request).
    """
    num_sampling = len(batch.sample_req_indices)
    failures: dict[int, str] = {}
    for p in range(num_sampling):
        try:
            _sample_subset(sample, metadata_for, batch, logits, bitmask, [p])
        except Exception as exc:  # this request's own failure
            r = batch.sample_req_indices[p]
            failures[r] = f"sampling failed: {type(exc).__name__}: {exc}"
            logger.warning("request %s: %s", batch.req_ids[r], failures[r])
    if not failures:  # only the batch together fails: no request can be blamed alone
        raise error
    good = [p for p in range(num_sampling) if batch.sample_req_indices[p] not in failures]
    width = 1 + max(batch.num_draft_tokens, default=0)
    device = logits.device
    sampled = torch.full((num_sampling, width), -1, dtype=torch.int64, device=device)
    sampled[:, 0] = 0  # a valid id for the failed rows (see the module docstring)
    logprobs = None
    if good:
        result, rows = _sample_subset(sample, metadata_for, batch, logits, bitmask, good)
        good_index = torch.tensor(good, dtype=torch.int64, device=device)
        sampled[good_index, : result.sampled_token_ids.shape[1]] = result.sampled_token_ids
        sampled[good_index, result.sampled_token_ids.shape[1] :] = -1
        if result.logprobs is not None:
            row_index = torch.tensor(rows, dtype=torch.int64, device=device)
            full = []
            for part in result.logprobs:
                buffer = torch.zeros(
                    (logits.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device
                )
                buffer[row_index.to(part.device)] = part
                full.append(buffer)
            logprobs = (full[0], full[1], full[2])
    return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs), failures
