"""A drafter's own paged KV, laid out like the target's: same block ids, same slots.

A model-based drafter (EAGLE head, draft model) keeps its KV in its own pools of
`num_kv_blocks + scratch` blocks and indexes them with the *target's* block tables: block b
of the drafter's pool holds the drafter's KV for the same tokens as block b of the target's
pool. So the scheduler's allocation, preemption and prefix caching serve the drafter too: a
cached prefix block holds the drafter's KV of that prefix, because the drafter writes every
position the target computes (it mirrors each step's valid rows).

Draft positions run past a request's allocated blocks; those columns of its table point at
`scratch` blocks past `num_kv_blocks`, private to the request's index in the current call.
Writes at positions past a request's valid tokens are safe in its own blocks too: shared
(prefix-cached) blocks are full of computed tokens, never written by drafting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.worker.draft_context import DraftContext
from tandem.schema.config import ConfigError, EngineConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class DraftBlockTables:
    """Block tables over the target's block ids, padded with per-request scratch blocks.

    `max_draft_positions` bounds how far past its last valid token a request may write
    (the bonus token plus the drafts: `num_spec_tokens + 1`)."""

    def __init__(
        self, num_blocks: int, block_size: int, max_reqs: int, max_draft_positions: int
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_reqs = max_reqs
        self.scratch_per_req = cdiv(max_draft_positions, block_size) + 1
        self.total_blocks = num_blocks + max_reqs * self.scratch_per_req

    @classmethod
    def for_config(cls, config: EngineConfig, drafter: str) -> DraftBlockTables:
        """Tables for the resolved `config`: the target's pool, `max_num_seqs` requests,
        `num_spec_tokens + 1` draft positions. `drafter` names the plugin in errors."""
        num_blocks = config.cache.num_kv_blocks
        if num_blocks is None:
            raise ConfigError(f"{drafter}: cache.num_kv_blocks must be resolved")
        return cls(
            num_blocks,
            config.cache.block_size,
            config.scheduler.max_num_seqs,
            config.num_spec_tokens + 1,
        )

    def table(
        self, block_ids: list[list[int]], seq_lens: list[int], device: torch.device
    ) -> torch.Tensor:
        """`[R, nb]` block table covering positions `< seq_lens[r]` of each request r."""
        if len(block_ids) > self.max_reqs:
            raise ValueError(f"{len(block_ids)} requests, the draft pool holds {self.max_reqs}")
        width = max((cdiv(n, self.block_size) for n in seq_lens), default=1) or 1
        rows: list[list[int]] = []
        for r, (blocks, n) in enumerate(zip(block_ids, seq_lens, strict=True)):
            needed = cdiv(n, self.block_size)
            row = blocks[:needed]
            missing = needed - len(row)
            if missing > self.scratch_per_req:
                raise ValueError(
                    f"request {r}: {missing} blocks past its allocation, scratch holds "
                    f"{self.scratch_per_req}"
                )
            first = self.num_blocks + r * self.scratch_per_req
            row = row + list(range(first, first + missing))
            rows.append(row + [0] * (width - len(row)))
        return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)

    def slots(
        self, table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Pool slot of each (request row of `table`, position)."""
        bs = self.block_size
        return table[req_index, positions // bs] * bs + positions % bs


@dataclass(slots=True)
class ValidRows:
    """The rows of a step that are now history, per request of a `DraftContext`.

    `rows[j]` is a flat row of `context.batch` (and of `context.hidden_states`),
    `req_index[j]` its request (context order), `positions[j]` its position. Request i owns
    `query_start_loc[i]:query_start_loc[i + 1]` of them, positions
    `num_computed[i] .. seq_lens[i] - 1`."""

    rows: torch.Tensor
    req_index: torch.Tensor
    positions: torch.Tensor
    query_start_loc: list[int]
    num_computed: list[int]
    seq_lens: list[int]

    @property
    def last(self) -> list[int]:
        """Index (into `rows`) of each request's last valid row; -1 for none."""
        return [end - 1 if end > start else -1 for start, end in self._spans()]

    def _spans(self) -> list[tuple[int, int]]:
        q = self.query_start_loc
        return [(q[i], q[i + 1]) for i in range(len(q) - 1)]


def ragged_index(counts: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """For requests with `counts[i]` rows each, flattened in order: (cumulative starts
    `[R + 1]`, the request of each row `[N]`, each row's index within its request `[N]`)."""
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    count_t = torch.tensor(counts, dtype=torch.int64)
    req_index = torch.repeat_interleave(torch.arange(len(counts)), count_t)
    within = torch.arange(starts[-1], dtype=torch.int64) - torch.tensor(starts[:-1])[req_index]
    return starts, req_index, within


def batch_row_starts(context: DraftContext) -> list[int]:
    """The first flat row of each request of `context` in the step's batch."""
    assert context.batch is not None, "a model-based drafter needs DraftContext.batch"
    row_starts = [0]
    for n in context.batch.num_scheduled_tokens:
        row_starts.append(row_starts[-1] + n)
    return [row_starts[b] for b in context.batch_index]


def valid_rows(context: DraftContext) -> ValidRows:
    """Gather, without per-token Python, the valid rows of every request of the step."""
    batch = context.batch
    assert batch is not None, "a model-based drafter needs DraftContext.batch"
    device = batch.input_ids.device
    counts = context.num_valid_tokens
    qsl, req_index, within = ragged_index(counts)
    rows = torch.tensor(batch_row_starts(context), dtype=torch.int64)[req_index] + within
    computed = list(context.num_computed_tokens)
    positions = torch.tensor(computed, dtype=torch.int64)[req_index] + within
    return ValidRows(
        rows=rows.to(device),
        req_index=req_index.to(device),
        positions=positions.to(device),
        query_start_loc=qsl,
        num_computed=computed,
        seq_lens=[c + n for c, n in zip(computed, counts, strict=True)],
    )
