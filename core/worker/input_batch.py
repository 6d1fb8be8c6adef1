"""The persistent input batch: one row per request the worker holds, stable across steps.

A request keeps its row from admission to removal. Everything the worker knows about it
lives in that row and changes only by what the incremental `SchedulerOutput` and the
step's own results say:

- its token ids, in a CPU int64 tensor `[rows, width]` (the width doubles when a row needs
  more): the prompt, the outputs sampled so far (`-1` where an async output is still on the
  device) and, past `num_tokens`, the drafts of the step being built;
- `num_tokens` (known tokens) and `num_computed_tokens` (tokens whose KV this worker wrote
  or is writing), which the worker advances itself: by the scheduled count when it
  executes a step, minus the drafts the sampler rejected;
- its KV block ids (`BlockTable`), appended from `CachedRequestData.new_block_ids`;
- its sampling parameters as per-row tensors, written once at admission. Sparse
  per-request parameters (`logit_bias`, `allowed_token_ids`) are tensors keyed by request
  id, built once at admission.

Removing a request leaves a hole; `condense()` fills holes by moving the highest rows down,
so only as many rows move as there were holes above the new end. Steps are laid out in row
order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.core.scheduler_output import NewRequestData
from tandem.core.worker.bad_words import BadWordIndex
from tandem.core.worker.block_table import BlockTable
from tandem.core.worker.host_tensors import host_int64
from tandem.schema.sampling_params import SAMPLING_EPS, SEED_MAX, SamplingParams

#: The largest float32: a temperature above it would become inf in the tensor (and
#: -inf / inf is NaN, which would let a blocked token through).
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def seed_as_int64(seed: int) -> int:
    """A seed in [0, 2**64 - 1] as the int64 with the same 64 bits (two's complement):
    a bijection, so the sampler's wrapping 64-bit hash sees every seed's full value."""
    if not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed: expected an integer in [0, 2**64 - 1] (got {seed})")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass(slots=True, frozen=True)
class RequestState:
    """What the worker knows about a request that never changes while it holds it."""

    req_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    #: `sampling_params.bad_words_token_ids` indexed by prefix (None without bad words).
    bad_words: BadWordIndex | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        words = self.sampling_params.bad_words_token_ids
        if words:
            object.__setattr__(self, "bad_words", BadWordIndex(words))

    @property
    def has_penalties(self) -> bool:
        p = self.sampling_params
        return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0

    @property
    def may_block_tokens(self) -> bool:
        """Whether some row of this request can have blocked tokens (`min_tokens`, bad words)."""
        p = self.sampling_params
        return p.min_tokens > 0 or bool(p.bad_words_token_ids)


class InputBatch:
    """Rows `0..num_rows-1`; `req_ids[row]` is None for a hole.

    Invariants: `req_id_to_row[req_ids[r]] == r` for every occupied row; after `condense()`
    there is no hole below `num_rows`. `token_ids[r, :num_tokens[r]]` is row r's known
    history and `num_computed_tokens[r] <= num_tokens[r]`. `temperature[row] == 0` exactly
    for greedy requests (temperature below `SAMPLING_EPS`; greedy rows also get no
    top-k/top-p/min-p, as in vLLM). `seeded[row]` says whether `seeds[row]` (the seed's 64
    bits as int64) is used. `num_rejected[r]` is the number of drafts rejected in the last
    step that sampled row r.
    """

    #: Per-row tensors: name -> (dtype, value of an empty row). Moved together on condense.
    COLUMNS: dict[str, tuple[torch.dtype, float]] = {
        "temperature": (torch.float32, 0.0),
        "top_k": (torch.int64, 0),
        "top_p": (torch.float32, 1.0),
        "min_p": (torch.float32, 0.0),
        "seeds": (torch.int64, 0),
        "seeded": (torch.bool, False),
        "presence": (torch.float32, 0.0),
        "frequency": (torch.float32, 0.0),
        "repetition": (torch.float32, 1.0),
        "num_prompt_tokens": (torch.int64, 0),
        "num_tokens": (torch.int64, 0),
        "num_computed_tokens": (torch.int64, 0),
        "num_rejected": (torch.int64, 0),
    }

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    seeded: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    num_prompt_tokens: torch.Tensor
    num_tokens: torch.Tensor
    num_computed_tokens: torch.Tensor
    num_rejected: torch.Tensor

    def __init__(self, max_num_reqs: int, max_num_tokens: int = 256) -> None:
        self.max_num_reqs = max_num_reqs
        self.req_ids: list[str | None] = []
        self.req_id_to_row: dict[str, int] = {}
        for name, (dtype, fill) in self.COLUMNS.items():
            setattr(self, name, torch.full((max_num_reqs,), fill, dtype=dtype))
        self.token_ids = torch.zeros((max_num_reqs, max_num_tokens), dtype=torch.int64)
        self.block_table = BlockTable(max_num_reqs)
        self.states: dict[str, RequestState] = {}
        #: Requests with penalties (their rows need histories) and with blockable tokens.
        self.penalized: set[str] = set()
        self.blocking: set[str] = set()
        #: req id -> (token ids, biases) of its `logit_bias`.
        self.logit_bias: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        #: req id -> its `allowed_token_ids`.
        self.allowed_token_ids: dict[str, torch.Tensor] = {}

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    # Rows in and out ------------------------------------------------------------------
    def add_new(self, new: NewRequestData) -> int:
        """`add` a request as the scheduler sent it (admitted, or resumed)."""
        return self.add(
            new.req_id,
            new.sampling_params,
            token_ids=new.token_ids,
            num_prompt_tokens=new.num_prompt_tokens,
            block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens,
            eos_token_id=new.eos_token_id,
        )

    def add(
        self,
        req_id: str,
        params: SamplingParams,
        *,
        token_ids: Sequence[int] = (),
        num_prompt_tokens: int | None = None,
        block_ids: Sequence[int] = (),
        num_computed_tokens: int = 0,
        eos_token_id: int | None = None,
    ) -> int:
        """Put the request in the lowest hole, else a new row at the end; return the row."""
        try:
            row = self.req_ids.index(None)
            self.req_ids[row] = req_id
        except ValueError:
            if len(self.req_ids) >= self.max_num_reqs:
                self._grow()
            row = len(self.req_ids)
            self.req_ids.append(req_id)
        self.req_id_to_row[req_id] = row
        num_prompt = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        state = RequestState(req_id, num_prompt, params, eos_token_id)
        self.states[req_id] = state
        if state.has_penalties:
            self.penalized.add(req_id)
        if state.may_block_tokens:
            self.blocking.add(req_id)
        self.ensure_width(len(token_ids) + 1)
        if token_ids:
            self.token_ids[row, : len(token_ids)] = host_int64(token_ids)
        self.num_prompt_tokens[row] = num_prompt
        self.num_tokens[row] = len(token_ids)
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_rejected[row] = 0
        self.block_table.set_row(row, list(block_ids))
        self._write_params(row, req_id, params)
        return row

    def _write_params(self, row: int, req_id: str, params: SamplingParams) -> None:
        greedy = params.temperature < SAMPLING_EPS
        self.temperature[row] = 0.0 if greedy else min(params.temperature, _FLOAT32_MAX)
        self.top_k[row] = -1 if greedy else params.top_k
        self.top_p[row] = 1.0 if greedy else params.top_p
        self.min_p[row] = 0.0 if greedy else params.min_p
        self.seeded[row] = params.seed is not None
        self.seeds[row] = seed_as_int64(params.seed) if params.seed is not None else 0
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        if params.logit_bias:
            self.logit_bias[req_id] = (
                torch.tensor(list(params.logit_bias), dtype=torch.int64),
                torch.tensor(list(params.logit_bias.values()), dtype=torch.float32),
            )
        if params.allowed_token_ids is not None:
            self.allowed_token_ids[req_id] = torch.tensor(
                params.allowed_token_ids, dtype=torch.int64
            )

    def _grow(self) -> None:
        old = self.max_num_reqs
        self.max_num_reqs *= 2
        for name, (dtype, fill) in self.COLUMNS.items():
            bigger = torch.full((self.max_num_reqs,), fill, dtype=dtype)
            bigger[:old] = getattr(self, name)
            setattr(self, name, bigger)
        tokens = torch.zeros((self.max_num_reqs, self.token_ids.shape[1]), dtype=torch.int64)
        tokens[:old] = self.token_ids
        self.token_ids = tokens
        self.block_table.grow_rows(self.max_num_reqs)

    def ensure_width(self, num_tokens: int) -> None:
        """Make room for `num_tokens` token ids per row (doubling the width)."""
        width = self.token_ids.shape[1]
        if num_tokens > width:
            wider = torch.zeros((self.max_num_reqs, max(num_tokens, 2 * width)), dtype=torch.int64)
            wider[:, :width] = self.token_ids
            self.token_ids = wider

    def remove(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        self.states.pop(req_id, None)
        self.penalized.discard(req_id)
        self.blocking.discard(req_id)
        self.logit_bias.pop(req_id, None)
        self.allowed_token_ids.pop(req_id, None)
        if row is not None:
            self.req_ids[row] = None
            self.block_table.clear_row(row)

    def condense(self) -> list[tuple[int, int]]:
        """Fill holes with the highest occupied rows; return the (from, to) moves."""
        moves = []
        while self.req_ids and self.req_ids[-1] is None:
            self.req_ids.pop()
        hole = 0
        while True:
            try:
                hole = self.req_ids.index(None, hole)
            except ValueError:
                break
            last = len(self.req_ids) - 1
            req_id = self.req_ids.pop()
            assert req_id is not None
            self.req_ids[hole] = req_id
            self.req_id_to_row[req_id] = hole
            n = int(self.num_tokens[last])
            self.token_ids[hole, :n] = self.token_ids[last, :n]
            for name in self.COLUMNS:
                column = getattr(self, name)
                column[hole] = column[last]
            self.block_table.move_row(last, hole)
            moves.append((last, hole))
            while self.req_ids and self.req_ids[-1] is None:
                self.req_ids.pop()
        return moves

    def rows_of(self, req_ids: list[str]) -> torch.Tensor:
        row_of = self.req_id_to_row
        return host_int64([row_of[r] for r in req_ids])

    # A row's history ------------------------------------------------------------------
    def token_ids_of(self, req_id: str) -> list[int]:
        """The request's known tokens: prompt, then outputs (`-1` for one still on the device)."""
        row = self.req_id_to_row[req_id]
        return self.token_ids[row, : int(self.num_tokens[row])].tolist()

    def num_output_tokens(self, req_id: str) -> int:
        return int(self.num_tokens[self.req_id_to_row[req_id]]) - (
            self.states[req_id].num_prompt_tokens
        )

    # The step's results ---------------------------------------------------------------
    def append_sampled(
        self, rows: torch.Tensor, sampled: torch.Tensor, num_drafts: torch.Tensor
    ) -> None:
        """Append each sampling row's accepted tokens (`sampled[i]`, `-1`-padded, on the
        host) after its history, and roll `num_computed_tokens` back by the drafts it
        rejected (row i verified `num_drafts[i]` and keeps `accepted + 1` tokens)."""
        if sampled.shape[1] == 1 and bool((sampled >= 0).all()):  # no drafts: one token each
            start = self.num_tokens[rows]
            self.ensure_width(int(start.max()) + 1 if rows.numel() else 0)
            self.token_ids[rows, start] = sampled[:, 0]
            self.num_tokens[rows] = start + 1
            self.num_rejected[rows] = 0
            return
        accepted = sampled >= 0
        lengths = accepted.sum(dim=1)
        start = self.num_tokens[rows]
        cols = start[:, None] + torch.arange(sampled.shape[1], dtype=torch.int64)[None, :]
        self.ensure_width(int((start + lengths).max()) if rows.numel() else 0)
        self.token_ids[rows[:, None].expand_as(cols)[accepted], cols[accepted]] = sampled[accepted]
        self.num_tokens[rows] = start + lengths
        rejected = num_drafts - (lengths - 1)
        self.num_computed_tokens[rows] -= rejected
        self.num_rejected[rows] = rejected

    def append_placeholders(self, rows: torch.Tensor) -> torch.Tensor:
        """Append a `-1` to each row (an output still on the device); returns their columns."""
        cols = self.num_tokens[rows]
        self.ensure_width(int(cols.max()) + 1 if rows.numel() else 0)
        self.token_ids[rows, cols] = -1
        self.num_tokens[rows] = cols + 1
        self.num_rejected[rows] = 0
        return cols

    def write_drafts(self, rows: list[int], starts: list[int], drafts: list[list[int]]) -> None:
        """Write row `rows[i]`'s drafts from column `starts[i]` (its `num_tokens`), where
        the step reads its inputs, leaving room for the token sampled after them."""
        row_index: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        for row, start, tokens in zip(rows, starts, drafts, strict=True):
            row_index.extend([row] * len(tokens))
            cols.extend(range(start, start + len(tokens)))
            values.extend(tokens)
        if not values:
            return
        self.ensure_width(max(cols) + 2)
        self.token_ids[host_int64(row_index), host_int64(cols)] = host_int64(values)
