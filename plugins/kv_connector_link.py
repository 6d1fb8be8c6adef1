"""The reference scheduler's side of the KV-connector seam (`tandem.kv.connector`).

`KVConnectorLink` asks the stack's connector at admission and at the end of `schedule`,
folds each step's `KVConnectorOutput` in, keeps the blocks of finished requests whose save
is still running, and applies the specification's load-failure rule: every request holding
a block whose load failed rolls `num_computed_tokens` back to that block's start, the
outputs of its steps in flight are dropped (their forward read garbage), the block leaves
the prefix cache, and the worker rebuilds the request from the valid prefix
(`take_resend`). Without a connector in the stack every method is a no-op.

Asynchronous loads (vLLM's WAITING_FOR_REMOTE_KVS): a request whose connector answers
`load_async=True` gets its blocks at admission (the loaded ones as lookahead slots: not
in the prefix cache until loaded) and stays in WAITING with status
`WAITING_FOR_REMOTE_KVS`, skipped by admission (`not_ready`) while others run. Once the
worker reports it in `finished_recving` it is admitted as usual with the blocks it holds
and the tokens they cover (`admission_hit`), less any block whose load failed. A request
finished while its load runs keeps its blocks until the load is reported over.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler_output import SchedulerOutput
from tandem.kv import KVBlock, KVCacheManager
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
        #: The worker's transfer counters (`KVConnectorOutput.stats`), summed over steps.
        self.transfers: dict[str, float] = {}
        #: WAITING_FOR_REMOTE_KVS requests -> the tokens their blocks hold once loaded.
        self.receiving: dict[str, int] = {}
        #: Requests whose asynchronous load is over -> the valid tokens to admit them with.
        self.received: dict[str, int] = {}
        #: Finished requests whose blocks wait for their asynchronous load to end.
        self.kept_for_load: set[str] = set()
        self._waiting_requests: dict[str, Request] = {}  # receiving or received

    @property
    def enabled(self) -> bool:
        return self.hooks is not None

    @property
    def holds_blocks(self) -> bool:
        """Finished requests still hold blocks (a save or a load of theirs runs): the engine
        keeps stepping until the worker reports them over."""
        return bool(self.kept or self.kept_for_load)

    # Admission --------------------------------------------------------------------------
    def admission_hit(self, request: Request, kv: KVCacheManager) -> tuple[list[KVBlock], int]:
        """(blocks, tokens) a WAITING request is admitted with before the connector is asked:
        an asynchronously loaded request's valid tokens (its blocks it already holds), else
        the local prefix-cache hit (none for a request wanting prompt logprobs: every prompt
        position is computed, as in vLLM)."""
        if request.request_id in self.received:
            return [], self.received[request.request_id]
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0
        return kv.get_computed_blocks(request)

    def not_ready(self, not_ready: Collection[str]) -> Collection[str]:
        """The policy's not-ready ids plus the requests waiting for remote KV."""
        return {*not_ready, *self.receiving} if self.receiving else not_ready

    def external_tokens(
        self, request: Request, num_hit_tokens: int, block_size: int
    ) -> tuple[int, bool]:
        """(tokens the connector supplies past the local hit, whether it loads them
        asynchronously): whole blocks, never the last known token; none for a request that
        wants prompt logprobs or was loaded already. Raises a ValueError naming the hook for
        an answer outside that."""
        if (
            self.hooks is None
            or request.sampling_params.prompt_logprobs is not None
            or request.request_id in self.received
        ):
            return 0, False
        answer = self.hooks.get_num_new_matched_tokens(
            request=request, num_computed_tokens=num_hit_tokens
        )
        if answer is None:
            return 0, False
        num_external, load_async = answer
        limit = (request.num_tokens - 1) // block_size * block_size - num_hit_tokens
        if num_external < 0 or num_external % block_size or num_external > max(limit, 0):
            raise ValueError(
                f"KV connector: get_num_new_matched_tokens returned {num_external} tokens "
                f"for request {request.request_id!r}: expected whole blocks of {block_size} tokens, at most {max(limit, 0)}",
            )
        return num_external, bool(load_async and num_external)

    def start_load(
        self, request: Request, kv: KVCacheManager, hit_blocks: list[KVBlock], num_external: int
    ) -> bool:
        """Admit `request` to WAITING_FOR_REMOTE_KVS: allocate the hit and the blocks of
        every other known token, the connector's among them (lookahead slots: uncached
        until loaded), and tell the connector (`request.num_computed_tokens` counts the hit
        and the external tokens during that call only). False, changing nothing, when the
        pool cannot supply the blocks."""
        num_hit = len(hit_blocks) * kv.block_size
        # every known token's slot now: once loaded, its admission needs no block (so
        # requests holding blocks while they wait can never starve each other of KV)
        if kv.allocate_slots(request, 0, num_hit, hit_blocks, request.num_tokens - num_hit) is None:
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.receiving[request.request_id] = num_hit + num_external
        self._waiting_requests[request.request_id] = request
        request.num_computed_tokens = num_hit + num_external
        self.after_alloc(request, kv, num_external)
        request.num_computed_tokens = 0
        return True

    def after_alloc(self, request: Request, kv: KVCacheManager, num_external: int) -> None:
        """The request was admitted: tell the connector its blocks."""
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.received.pop(request.request_id, None)
            self._waiting_requests.pop(request.request_id, None)
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
        request_id = request.request_id
        self.resend.discard(request_id)
        self.received.pop(request_id, None)
        self._waiting_requests.pop(request_id, None)
        keep = False
        if self.hooks is not None:
            block_ids = kv.get_block_ids(request_id)
            answer = self.hooks.request_finished(request=request, block_ids=block_ids)
            keep = answer is not None and bool(answer[0])
        if self.receiving.pop(request_id, None) is not None:
            self.kept_for_load.add(request_id)  # its load still writes into the blocks
        elif keep:
            self.kept.add(request_id)
        else:
            kv.free(request_id)

    # Results ----------------------------------------------------------------------------
    def fold_output(self, output: KVConnectorOutput | None, scheduler: Any) -> None:
        """Apply a step's connector output to `scheduler` (its `running`, `waiting` and
        `kv_cache_manager`): free kept blocks whose save finished, roll back every request
        holding a block whose load failed, and move each request whose asynchronous load
        ended to the front of WAITING (it needs no new block to be admitted)."""
        if output is None or self.hooks is None:
            return
        running, kv = scheduler.running, scheduler.kv_cache_manager
        self.hooks.update_connector_output(connector_output=output)
        for name, value in (output.stats or {}).items():
            self.transfers[name] = self.transfers.get(name, 0) + value
        for request_id in output.finished_sending & self.kept:
            self.kept.discard(request_id)
            kv.free(request_id)
        if output.invalid_block_ids:
            self._roll_back(output.invalid_block_ids, running, kv)
        for request_id in output.finished_recving:
            if request_id in self.receiving:
                self.received[request_id] = self.receiving.pop(request_id)
                request = self._waiting_requests[request_id]
                scheduler.waiting.discard([request])
                scheduler.waiting.prepend(request)
            elif request_id in self.kept_for_load:
                self.kept_for_load.discard(request_id)
                kv.free(request_id)

    def _roll_back(self, invalid: set[int], running: Iterable[Request], kv: KVCacheManager) -> None:
        self.stats["failed_load_blocks"] += len(invalid)
        kv.invalidate_blocks(invalid)
        for loads in (self.receiving, self.received):  # not admitted yet: fewer valid tokens
            for request_id, num_valid in loads.items():
                block_ids = kv.get_block_ids(request_id)
                first_bad = next((i for i, b in enumerate(block_ids) if b in invalid), None)
                if first_bad is not None:
                    loads[request_id] = min(num_valid, first_bad * kv.block_size)
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
