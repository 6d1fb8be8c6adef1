"""The persistent block table: each input-batch row's KV block ids, kept across steps.

A request's blocks arrive once (`NewRequestData.block_ids`) and then grow by the step's
`CachedRequestData.new_block_ids`, appended in place; nothing is rebuilt per step. A step
gathers the rows it runs with one index (`gather`), and slots come from the gathered table
by position (`slot_mapping`).
"""

from __future__ import annotations

import torch

from tandem.core.worker.host_tensors import host_int64


class BlockTable:
    """A CPU int64 tensor `[rows, max_blocks]`, both dimensions grown by doubling.

    Invariant: `table[row, :num_blocks[row]]` are the row's block ids in order, and every
    entry after them is 0 (the padding a gathered table shows past a request's blocks).
    """

    def __init__(self, max_rows: int, max_blocks: int = 16) -> None:
        self.table = torch.zeros((max_rows, max_blocks), dtype=torch.int64)
        self.num_blocks: list[int] = [0] * max_rows

    def grow_rows(self, max_rows: int) -> None:
        old = self.table
        self.table = torch.zeros((max_rows, old.shape[1]), dtype=torch.int64)
        self.table[: old.shape[0]] = old
        self.num_blocks.extend([0] * (max_rows - old.shape[0]))

    def _fit(self, num_blocks: int) -> None:
        width = self.table.shape[1]
        if num_blocks > width:
            wider = torch.zeros(
                (self.table.shape[0], max(num_blocks, 2 * width)), dtype=torch.int64
            )
            wider[:, :width] = self.table
            self.table = wider

    def set_row(self, row: int, block_ids: list[int]) -> None:
        """Give `row` exactly `block_ids` (a request admitted or resumed)."""
        self._fit(len(block_ids))
        self.table[row].zero_()
        if block_ids:
            self.table[row, : len(block_ids)] = host_int64(block_ids)
        self.num_blocks[row] = len(block_ids)

    def append(self, row: int, block_ids: list[int]) -> None:
        """Add a running request's newly allocated blocks after its others."""
        if not block_ids:
            return
        start = self.num_blocks[row]
        self._fit(start + len(block_ids))
        self.table[row, start : start + len(block_ids)] = host_int64(block_ids)
        self.num_blocks[row] = start + len(block_ids)

    def clear_row(self, row: int) -> None:
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Move `src`'s blocks to the empty row `dst`, leaving `src` empty."""
        n = self.num_blocks[src]
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks[dst] = n
        self.clear_row(src)

    def block_ids(self, row: int) -> list[int]:
        return self.table[row, : self.num_blocks[row]].tolist()

    def gather(self, rows: torch.Tensor, row_list: list[int]) -> torch.Tensor:
        """`[len(rows), max_blocks of those rows (at least 1)]`, zero-padded."""
        width = max(max(map(self.num_blocks.__getitem__, row_list), default=0), 1)
        return self.table[rows, :width]


def slot_mapping(
    table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The paged-cache slot of each token: its request's block at `position // block_size`,
    offset `position % block_size`. `req_index[t]` is token t's row in `table`."""
    blocks = table[req_index, positions // block_size]
    return torch.add(positions % block_size, blocks, alpha=block_size)
