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

    #: Per-row parameter tensors: name -> (dtype, value of an empty row).
    COLUMNS: dict[str, tuple[torch.dtype, float]] = {
        "temperature": (torch.float32, 0.0),
        "top_k": (torch.int64, 0),
        "top_p": (torch.float32, 1.0),
        "min_p": (torch.float32, 0.0),
        "seeds": (torch.int64, -1),
        "presence": (torch.float32, 0.0),
        "frequency": (torch.float32, 0.0),
        "repetition": (torch.float32, 1.0),
    }

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor

    def __init__(self, max_num_reqs: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.req_ids: list[str | None] = []
        self.req_id_to_row: dict[str, int] = {}
        for name, (dtype, fill) in self.COLUMNS.items():
            setattr(self, name, torch.full((max_num_reqs,), fill, dtype=dtype))

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
        old = self.max_num_reqs
        self.max_num_reqs *= 2
        for name, (dtype, fill) in self.COLUMNS.items():
            bigger = torch.full((self.max_num_reqs,), fill, dtype=dtype)
            bigger[:old] = getattr(self, name)
            setattr(self, name, bigger)

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
            for name in self.COLUMNS:
                column = getattr(self, name)
                column[hole] = column[last]
            moves.append((last, hole))
            while self.req_ids and self.req_ids[-1] is None:
                self.req_ids.pop()
        return moves

    def rows_of(self, req_ids: list[str]) -> torch.Tensor:
        return torch.tensor([self.req_id_to_row[r] for r in req_ids], dtype=torch.int64)
