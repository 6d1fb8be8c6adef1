"""The persistent input batch: one row per request the worker holds, stable across steps.

A request keeps its row from admission to removal, so per-row state (sampling parameters
as tensors, and later the device-resident sampled ids of async scheduling) is written once
and indexed every step. Removing a request leaves a hole; `condense()` fills holes by
moving the highest rows down, so only as many rows move as there were holes above the new
end. Steps are laid out in row order.
"""

from __future__ import annotations

import torch

from tandem.core.sampling_params import SamplingParams


class InputBatch:
    """Rows `0..num_rows-1`; `req_ids[row]` is None for a hole.

    Invariants: `req_id_to_row[req_ids[r]] == r` for every occupied row; after `condense()`
    there is no hole below `num_rows`.
    """

    def __init__(self, max_num_reqs: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.req_ids: list[str | None] = []
        self.req_id_to_row: dict[str, int] = {}
        self.temperature = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.top_k = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.top_p = torch.ones(max_num_reqs, dtype=torch.float32)
        self.min_p = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.seeds = torch.full((max_num_reqs,), -1, dtype=torch.int64)
        self.presence = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.frequency = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.repetition = torch.ones(max_num_reqs, dtype=torch.float32)
        self._per_row = (
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.seeds,
            self.presence,
            self.frequency,
            self.repetition,
        )

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
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seeds[row] = params.seed if params.seed is not None else -1
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        return row

    def _grow(self) -> None:
        self.max_num_reqs *= 2
        grown = []
        for tensor in self._per_row:
            bigger = torch.empty(self.max_num_reqs, dtype=tensor.dtype)
            bigger[: tensor.shape[0]] = tensor
            grown.append(bigger)
        (
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.seeds,
            self.presence,
            self.frequency,
            self.repetition,
        ) = grown
        self._per_row = tuple(grown)

    def remove(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
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
            for tensor in self._per_row:
                tensor[hole] = tensor[last]
            moves.append((last, hole))
            while self.req_ids and self.req_ids[-1] is None:
                self.req_ids.pop()
        return moves

    def rows_of(self, req_ids: list[str]) -> torch.Tensor:
        return torch.tensor([self.req_id_to_row[r] for r in req_ids], dtype=torch.int64)
