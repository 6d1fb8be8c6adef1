"""The reference scheduler's side of the KV-connector seam (`tandem.kv.connector`).

`KVConnectorLink` asks the stack's connector at admission and at the end of `schedule`,
folds each step's `KVConnectorOutput` in, keeps the blocks of finished requests whose save
is still running, and applies the specification's load-failure rule: every request holding
a block whose load failed rolls `num_computed_tokens` back to that block's start, the
outputs of its steps in flight are dropped (their forward read garbage), the block leaves
the prefix cache, and the worker rebuilds the request from the valid prefix
(`take_resend`). Without a connector in the stack every method is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tandem.core.request import Request
from tandem.core.scheduler_output import SchedulerOutput
from tandem.kv import KVCacheManager
from tandem.kv.connector import KVConnectorOutput


class KVConnectorLink:
    """Calls into the connector hooks of a stack; inert when no plugin implements them."""

    def __init__(self, hooks: Any = None) -> None:
        has = hooks is not None and bool(hooks.get_num_new_matched_tokens.get_hookimpls())
        self.hooks = hooks if has else None
        #: Requests whose worker state must be rebuilt from their valid prefix.
        self.resend: set[str] = set()
        #: Finished requests whose blocks wait for their save (`request_finished`).
        self.kept: set[str] = set()
        self.stats = {"external_hit_tokens": 0, "failed_load_blocks": 0, "rolled_back_requests": 0}

    @property
    def enabled(self) -> bool:
        return self.hooks is not None

    # Admission --------------------------------------------------------------------------
    def external_tokens(self, request: Request, num_hit_tokens: int, block_size: int) -> int:
        """Tokens the connector supplies past the local hit (whole blocks, never the last
        known token; none for a request that wants prompt logprobs: every prompt position
        is computed); raises a ValueError naming the hook for an answer outside that."""
        if self.hooks is None or request.sampling_params.prompt_logprobs is not None:
            return 0
        answer = self.hooks.get_num_new_matched_tokens(
            request=request, num_computed_tokens=num_hit_tokens
        )
        if answer is None:
            return 0
        num_external, load_async = answer
        limit = (request.num_tokens - 1) // block_size * block_size - num_hit_tokens
        if num_external < 0 or num_external % block_size or num_external > max(limit, 0):
            raise ValueError(
                f"KV connector: get_num_new_matched_tokens returned {num_external} tokens "
                f"for request {request.request_id!r}: expected whole blocks of {block_size} tokens, at most {max(limit, 0)}",
            )
        if load_async and num_external:
            raise ValueError(
                "KV connector: get_num_new_matched_tokens asked for an asynchronous load; "
                "asynchronous KV loads (WAITING_FOR_REMOTE_KVS) are not supported by the "
                "reference scheduler yet: answer load_async=False",
            )
        return num_external

    def after_alloc(self, request: Request, kv: KVCacheManager, num_external: int) -> None:
        """The request was admitted: tell the connector its blocks."""
        if self.hooks is not None:
            block_ids = kv.get_block_ids(request.request_id)
            self.hooks.update_state_after_alloc(
                request=request, block_ids=block_ids, num_external_tokens=num_external
            )
            self.stats["external_hit_tokens"] += num_external

    def with_metadata(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """The step's output carrying the connector's transfer plan for the worker."""
        if self.hooks is not None:
            meta = self.hooks.build_connector_meta(scheduler_output=scheduler_output)
            scheduler_output.kv_connector_metadata = meta
        return scheduler_output

    def take_resend(self, request_id: str) -> bool:
        """Whether the request must reach the worker anew this step (and forget that)."""
        if request_id in self.resend:
            self.resend.discard(request_id)
            return True
        return False

    # Finishing --------------------------------------------------------------------------
    def release(self, request: Request, kv: KVCacheManager) -> None:
        """Free a finished request's blocks, unless the connector keeps them for a save."""
        self.resend.discard(request.request_id)
        if self.hooks is not None:
            block_ids = kv.get_block_ids(request.request_id)
            answer = self.hooks.request_finished(request=request, block_ids=block_ids)
            if answer is not None and answer[0]:
                self.kept.add(request.request_id)
                return
        kv.free(request.request_id)

    # Results ----------------------------------------------------------------------------
    def fold_output(
        self, output: KVConnectorOutput | None, running: Iterable[Request], kv: KVCacheManager
    ) -> None:
        """Apply a step's connector output: free kept blocks whose save finished, then roll
        back every running request holding a block whose load failed."""
        if output is None or self.hooks is None:
            return
        self.hooks.update_connector_output(connector_output=output)
        for request_id in output.finished_sending & self.kept:
            self.kept.discard(request_id)
            kv.free(request_id)
        if output.invalid_block_ids:
            self._roll_back(output.invalid_block_ids, running, kv)

    def _roll_back(self, invalid: set[int], running: Iterable[Request], kv: KVCacheManager) -> None:
        self.stats["failed_load_blocks"] += len(invalid)
        kv.invalidate_blocks(invalid)
        for request in running:
            block_ids = kv.get_block_ids(request.request_id)
            first_bad = next((i for i, b in enumerate(block_ids) if b in invalid), None)
            if first_bad is None or first_bad * kv.block_size >= request.num_computed_tokens:
                continue
            valid = first_bad * kv.block_size
            request.num_computed_tokens = valid
            # every step in flight for it read garbage: its results are dropped
            request.num_stale_output_tokens += request.num_in_flight_tokens
            request.num_in_flight_tokens = 0
            request.num_output_placeholders = 0
            request.spec_token_ids, request.draft_token_ids = [], []
            request.next_decode_eligible_step = 0
            kv.rewind(request.request_id, valid)
            self.resend.add(request.request_id)
            self.stats["rolled_back_requests"] += 1
