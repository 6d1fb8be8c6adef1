"""One step's batch as a cost model sees it (`step_cost` hook of the simulated device)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.core.worker.connector_plan import ConnectorTransfers, connector_transfers

if TYPE_CHECKING:
    from tandem.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepShape:
    """The shape of one engine step, per scheduled request in scheduling order.

    `query_lens[i]`: tokens request i computes this step (a prefill chunk, 1 for a plain
    decode, 1 + k when verifying k drafts; for block diffusion its causal tokens followed by
    its canvas). `context_lens[i]`: tokens already in its KV cache before this step (the
    attention span is `context_lens[i] + query_lens[i]`). `canvas_lens[i]`: how many of
    request i's `query_lens[i]` tokens are block-diffusion canvas positions (the last ones:
    computed by the bidirectional decoder, every position attending to the whole canvas,
    KV not written); empty when the step has no canvas (every autoregressive step).
    `num_sampled`: positions whose logits are computed (requests that sample a token; for
    diffusion every canvas position). `tensor_parallel_size`/`pipeline_parallel_size`: the
    ranks the step runs on.

    KV-connector transfers (`connector_plan`): `kv_load_blocks` blocks loaded into the pool
    from this host's store before the forward and `kv_save_blocks` saved after it (both
    within the step: the engine's worker waits for them), `kv_remote_blocks` fetched from
    another instance (disaggregated prefill: asynchronous, priced on its own shape with no
    tokens), each `kv_block_size` tokens.

    Invariants: `len(query_lens) == len(context_lens)`; `canvas_lens` empty or of the same
    length with `canvas_lens[i] <= query_lens[i]`; every count >= 0.
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_sampled: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    canvas_lens: tuple[int, ...] = ()
    kv_load_blocks: int = 0
    kv_save_blocks: int = 0
    kv_remote_blocks: int = 0
    kv_block_size: int = 16

    def __post_init__(self) -> None:
        if self.canvas_lens and len(self.canvas_lens) != len(self.query_lens):
            raise ValueError(
                f"StepShape.canvas_lens: expected {len(self.query_lens)} entries (one per "
                f"request) or none, got {len(self.canvas_lens)}"
            )
        if min(self.kv_load_blocks, self.kv_save_blocks, self.kv_remote_blocks) < 0:
            raise ValueError("StepShape: kv_*_blocks must be >= 0")

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of requests computing more than one token from an empty-ish context:
        every query longer than one token (prefill chunks, draft verification, canvases)."""
        return sum(q for q in self.query_lens if q > 1)

    @property
    def num_decode_reqs(self) -> int:
        return sum(1 for q in self.query_lens if q == 1)

    @property
    def num_canvas_tokens(self) -> int:
        return sum(self.canvas_lens)

    @property
    def has_transfers(self) -> bool:
        """Whether a connector moves blocks in this shape."""
        return bool(self.kv_load_blocks or self.kv_save_blocks or self.kv_remote_blocks)

    def canvas_len(self, i: int) -> int:
        """Canvas positions of request i (0 without canvases)."""
        return self.canvas_lens[i] if self.canvas_lens else 0

    def pass_tokens(self) -> tuple[int, ...]:
        """Tokens of each forward pass the step runs (each reads the weights once): one
        pass of every token for an autoregressive step; for block diffusion the causal
        encode of every non-canvas token (if any), then one decoder pass per distinct
        canvas length (the diffusion runner groups canvases by length)."""
        if not self.canvas_lens:
            return (self.num_tokens,) if self.num_tokens else ()
        causal = self.num_tokens - self.num_canvas_tokens
        by_length: dict[int, int] = {}
        for length in self.canvas_lens:
            if length:
                by_length[length] = by_length.get(length, 0) + length
        return ((causal,) if causal else ()) + tuple(by_length.values())


def step_shape_of(
    scheduler_output: SchedulerOutput,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    *,
    diffusion: bool = False,
    block_size: int = 16,
    transfers: ConnectorTransfers | None = None,
) -> StepShape:
    """The shape of a planned step. Context lengths are the scheduler's `num_computed_tokens`
    as sent. Autoregressive: every scheduled request counts as sampled (an upper bound: a
    prefill chunk that does not reach the prompt's end samples nothing; the LM-head term it
    overstates is small). `diffusion`: the step's `scheduled_spec_decode_tokens` are
    canvases (`canvas_lens`) and every canvas position has logits (`num_sampled`). The
    local connector transfers come from the step's `kv_connector_metadata`
    (`connector_transfers`, or `transfers` when the caller read them already); remote
    loads are left out (they do not take the step's time)."""
    computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    for cached in scheduler_output.scheduled_cached_reqs:
        computed[cached.req_id] = cached.num_computed_tokens
    scheduled = scheduler_output.num_scheduled_tokens
    canvas_lens: tuple[int, ...] = ()
    num_sampled = len(scheduled)
    if diffusion:
        canvases = scheduler_output.scheduled_spec_decode_tokens
        canvas_lens = tuple(len(canvases.get(rid, ())) for rid in scheduled)
        num_sampled = sum(canvas_lens)
    if transfers is None:
        transfers = connector_transfers(scheduler_output.kv_connector_metadata)
    return StepShape(
        query_lens=tuple(scheduled.values()),
        context_lens=tuple(computed.get(rid, 0) for rid in scheduled),
        num_sampled=num_sampled,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        canvas_lens=canvas_lens,
        kv_load_blocks=transfers.load_blocks,
        kv_save_blocks=transfers.save_blocks,
        kv_block_size=block_size,
    )
