"""The persistent input batch: one row per request the worker holds, stable across steps.

A request keeps its row from admission to removal, so per-row state (sampling parameters
as tensors, and later the device-resident sampled ids of async scheduling) is written once
and indexed every step. Sparse per-request parameters (`logit_bias`, `allowed_token_ids`)
are kept as tensors keyed by request id, built once at admission. Removing a request leaves a hole; `condense()` fills holes by
moving the highest rows down, so only as many rows move as there were holes above the new
end. Steps are laid out in row order.
"""

from __future__ import annotations

import torch

from tandem.sampling_params import SAMPLING_EPS, SEED_MAX, SamplingParams

#: The largest float32: a temperature above it would become inf in the tensor (and
#: -inf / inf is NaN, which would let a blocked token through).
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def seed_as_int64(seed: int) -> int:
    """A seed in [0, 2**64 - 1] as the int64 with the same 64 bits (two's complement):
    a bijection, so the sampler's wrapping 64-bit hash sees every seed's full value."""
    if not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed: expected an integer in [0, 2**64 - 1] (got {seed})")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class InputBatch:
    """Rows `0..num_rows-1`; `req_ids[row]` is None for a hole.

    Invariants: `req_id_to_row[req_ids[r]] == r` for every occupied row; after `condense()`
    there is no hole below `num_rows`. `temperature[row] == 0` exactly for greedy requests
    (temperature below `SAMPLING_EPS`; greedy rows also get no top-k/top-p/min-p, as in
    vLLM). `seeded[row]` says whether `seeds[row]` (the seed's 64 bits as int64) is used.
    """

    #: Per-row parameter tensors: name -> (dtype, value of an empty row).
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

    def __init__(self, max_num_reqs: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.req_ids: list[str | None] = []
        self.req_id_to_row: dict[str, int] = {}
        for name, (dtype, fill) in self.COLUMNS.items():
            setattr(self, name, torch.full((max_num_reqs,), fill, dtype=dtype))
        #: req id -> (token ids, biases) of its `logit_bias`.
        self.logit_bias: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        #: req id -> its `allowed_token_ids`.
        self.allowed_token_ids: dict[str, torch.Tensor] = {}

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    def add(self, req_id: str, params: SamplingParams) -> int:
        """Put the request in the lowest hole, else a new row at the end."""
        try:
            row = self.req_ids.index(None)
            self.req_ids[row] = req_id
        except ValueError:
            if len(self.req_ids) >= self.max_num_reqs:
                self._grow()
            row = len(self.req_ids)
            self.req_ids.append(req_id)
        self.req_id_to_row[req_id] = row
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
        return row

    def _grow(self) -> None:
        old = self.max_num_reqs
        self.max_num_reqs *= 2
        for name, (dtype, fill) in self.COLUMNS.items():
            bigger = torch.full((self.max_num_reqs,), fill, dtype=dtype)
            bigger[:old] = getattr(self, name)
            setattr(self, name, bigger)

    def remove(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        self.logit_bias.pop(req_id, None)
        self.allowed_token_ids.pop(req_id, None)
        if row is not None:
            self.req_ids[row] = None

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
            for name in self.COLUMNS:
                column = getattr(self, name)
                column[hole] = column[last]
            moves.append((last, hole))
            while self.req_ids and self.req_ids[-1] is None:
                self.req_ids.pop()
        return moves

    def rows_of(self, req_ids: list[str]) -> torch.Tensor:
        return torch.tensor([self.req_id_to_row[r] for r in req_ids], dtype=torch.int64)
