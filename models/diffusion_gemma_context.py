"""The decoder's cached-context K/V, gathered once per canvas instead of once per step.

While a canvas denoises, its request's cached context does not change (the decoder writes
nothing; the encoder writes only after a commit, at positions past the context). So the
decoder keeps, per (sliding window, canvas length), one `ContextGroup`: for the last
denoise batch (its request ids in row order) and every decoder layer of that window kind,
K and V buffers `[R, Hkv, C + L, D]` whose first C slots hold each row's gathered window
(zero outside it: pools are `torch.empty`, and NaN garbage must not reach the softmax) and
whose last L slots receive the step's canvas keys
(`diffusion_gemma_attention.grouped_decoder_attention`), plus the visibility
mask `[R, C + L]`. A step then copies only the canvas K/V; a row whose window or blocks
changed (a commit, a preemption's recompute) is regathered alone; a different request
list, canvas length, or a window wider than C rebuilds the group (C = the widest window
rounded up to `GROWTH` tokens, so a growing context rebuilds once per `GROWTH` tokens).

Memory: R x (C + L) x sum over the window kind's layers of (Hkv x D) x 2 (K, V) x dtype
bytes per group: on the benchmark model (R 16, C <= 192, 4 layers of 2 x 64, float32)
under 13 MiB. A group over `budget_bytes` is not built: `prepare` returns None and the
caller gathers per step (`diffusion_gemma_attention.decoder_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Context slots are allocated in multiples of this many tokens.
GROWTH = 64
#: Default ceiling on one group's buffers, in bytes.
DEFAULT_BUDGET = 256 << 20


@dataclass(slots=True)
class RowWindow:
    """Row r's visible cached positions `[lo, hi)` and the pool blocks covering them
    (`first` is the table index of `blocks[0]`)."""

    lo: int
    hi: int
    first: int
    blocks: list[int]


@dataclass(slots=True)
class ContextGroup:
    """Gathered context K/V of one request list (module docstring). `capacity` = C."""

    req_ids: tuple[str, ...]
    canvas_length: int
    capacity: int
    rows: list[RowWindow]
    valid: torch.Tensor
    keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def row_windows(
    block_tables: torch.Tensor, context_lens: list[int], window: int | None, block_size: int
) -> list[RowWindow]:
    """What each canvas sees: `[0, c)`, or on a sliding layer `[max(0, c - W + 1), c)`."""
    table = block_tables.tolist()
    rows = []
    for r, c in enumerate(context_lens):
        lo = 0 if window is None else max(0, c - window + 1)
        first, last = lo // block_size, -(-c // block_size)
        rows.append(RowWindow(lo, c, first, table[r][first:last]))
    return rows


class ContextCache:
    """The decoder's `ContextGroup`s by (window, canvas length) (module docstring)."""

    def __init__(self, block_size: int, budget_bytes: int = DEFAULT_BUDGET) -> None:
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.groups: dict[tuple[int | None, int], ContextGroup] = {}

    def release(self, req_id: str) -> None:
        """Drop every group holding `req_id` (it finished or was preempted)."""
        self.groups = {k: g for k, g in self.groups.items() if req_id not in g.req_ids}

    def prepare(
        self,
        req_ids: list[str],
        rows: list[RowWindow],
        canvas_length: int,
        window: int | None,
        pools: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> ContextGroup | None:
        """The group for this step's rows, gathered where stale; None when over budget.
        `pools`: layer -> (K pool, V pool), the layers of this window kind."""
        key = (window, canvas_length)
        group = self.groups.get(key)
        width = max((len(r.blocks) * self.block_size for r in rows), default=0)
        if group is None or group.req_ids != tuple(req_ids) or width > group.capacity:
            self.groups.pop(key, None)
            capacity = -(-width // GROWTH) * GROWTH
            if self._nbytes(len(rows), capacity + canvas_length, pools) > self.budget_bytes:
                return None
            group = self._allocate(tuple(req_ids), rows, capacity, canvas_length, pools)
            self.groups[key] = group
            stale = range(len(rows))
        else:
            stale = [r for r, row in enumerate(rows) if row != group.rows[r]]
        for r in stale:
            self._fill_row(group, r, rows[r], pools)
        return group

    @staticmethod
    def _nbytes(
        num_rows: int, slots: int, pools: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> int:
        per_slot = sum(2 * k.shape[2] * k.shape[3] * k.element_size() for k, _ in pools.values())
        return num_rows * slots * per_slot

    @staticmethod
    def _allocate(
        req_ids: tuple[str, ...],
        rows: list[RowWindow],
        capacity: int,
        canvas_length: int,
        pools: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> ContextGroup:
        num_rows, slots = len(rows), capacity + canvas_length
        some_pool = next(iter(pools.values()))[0]
        valid = torch.zeros(num_rows, slots, dtype=torch.bool, device=some_pool.device)
        valid[:, capacity:] = True
        group = ContextGroup(req_ids, canvas_length, capacity, list(rows), valid)
        for layer, (k_pool, v_pool) in pools.items():
            group.keys[layer] = tuple(
                torch.zeros(num_rows, p.shape[2], slots, p.shape[3], dtype=p.dtype, device=p.device)
                for p in (k_pool, v_pool)
            )
        return group

    def _fill_row(
        self,
        group: ContextGroup,
        r: int,
        row: RowWindow,
        pools: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Gather row r's window into every layer's buffers, zero elsewhere in its context."""
        group.rows[r] = row
        device = group.valid.device
        n, start = len(row.blocks) * self.block_size, row.first * self.block_size
        positions = start + torch.arange(n, device=device)
        inside = (positions >= row.lo) & (positions < row.hi)
        group.valid[r, :n] = inside
        group.valid[r, n : group.capacity] = False
        ids = torch.tensor(row.blocks, dtype=torch.int64, device=device)
        outside = None if (row.lo, row.hi) == (start, start + n) else ~inside[:, None, None]
        for layer, pair in pools.items():
            for pool, buf in zip(pair, group.keys[layer], strict=True):
                gathered = pool.index_select(0, ids).view(n, *pool.shape[2:])
                if outside is not None:  # block-aligned windows have nothing to zero
                    gathered = gathered.masked_fill(outside, 0)
                buf[r, :, :n].copy_(gathered.transpose(0, 1))
                buf[r, :, n : group.capacity].zero_()
