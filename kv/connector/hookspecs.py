"""KV-connector hooks: vLLM `KVConnectorBase_V1`'s scheduler and worker roles as pluggy specs.

A connector plugin (role `kv-connector`, at most one per stack) implements both sides; the
same class is registered in the engine process (scheduler side) and in each worker.

Scheduler side, called by the reference scheduler:

1. admission: `get_num_new_matched_tokens` (how many prompt tokens past the local
   prefix-cache hit the connector can load), then, once the blocks are allocated,
   `update_state_after_alloc` (which blocks to load into);
2. end of `schedule`: `build_connector_meta` (this step's transfer plan, carried to the
   worker in `SchedulerOutput.kv_connector_metadata`);
3. `update_from_output`: `update_connector_output` (finished transfers, failed loads);
4. a request finishing: `request_finished` (free its blocks now or after its save).

Worker side, called by the model runner around each step's forward: `start_load_kv`,
`wait_for_layer_load` and `save_kv_layer` per layer, `wait_for_save`, then
`get_finished` and `get_block_ids_with_load_errors` for the step's `KVConnectorOutput`.
The runner hands the paged pools over once with `register_kv_caches`.

Contracts the kernel relies on: a block listed in `invalid_block_ids` holds garbage until
recomputed (the scheduler rolls back every request holding it and drops it from the
prefix cache); loads into a block finish before any layer reads it (`wait_for_layer_load`
returns only then); saves read a block only between the forward that wrote it and the
`wait_for_save` of the same step, so a block freed afterwards may be reused at once unless
`request_finished` asked to keep it.
"""

from __future__ import annotations

from typing import Any

import pluggy

#: The kernel's project name (`tandem.core.hookspecs.PROJECT`): one hook namespace.
hookspec = pluggy.HookspecMarker("tandem")


class KVConnectorSchedulerSpecs:
    """Connector hooks called in the engine process, by the scheduler."""

    @hookspec(firstresult=True)
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool] | None:
        """(tokens the connector can supply past `num_computed_tokens`, whether the load is
        asynchronous) for a request being admitted; `num_computed_tokens` is its local
        prefix-cache hit (whole blocks). Side-effect free: may be called again for the same
        request (a request that did not fit is asked again next step). The count covers
        whole blocks and never the request's last known token (its logits must be
        computed). First result wins; None: no connector answers (0, False)."""

    @hookspec
    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request was admitted with `num_external_tokens` from the connector:
        `block_ids` are all its blocks in token order; the external tokens occupy the
        blocks right after its local hit. Called after every admission, with 0 when the
        connector supplies nothing (a saving connector then learns the request's blocks).
        For an asynchronous load the request is in WAITING_FOR_REMOTE_KVS, `block_ids`
        cover every known token, and the hook is called again, with 0, when the request is
        admitted after its load."""

    @hookspec(firstresult=True)
    def build_connector_meta(self, scheduler_output: Any) -> Any | None:
        """This step's transfer plan for the worker side (opaque to the kernel), built at
        the end of `schedule` from the state the admissions left; it resets that state. It
        crosses to a worker in another process as MessagePack: plain data arrives as sent,
        a dataclass as a mapping of its fields (tuples as lists)."""

    @hookspec
    def update_connector_output(self, connector_output: Any) -> None:
        """A step's `KVConnectorOutput`, before the scheduler applies its failures. The
        connector may add blocks to `invalid_block_ids` (e.g. loads planned before it
        learned that their source was computed from a failed block): they fail too."""

    @hookspec(firstresult=True)
    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None] | None:
        """A request finished (stopped or aborted) holding `block_ids`: (keep the blocks
        until the worker reports the request in `finished_sending`, params to return to
        the client as `kv_transfer_params`). None: free now."""


class KVConnectorWorkerSpecs:
    """Connector hooks called in each worker, by the model runner."""

    @hookspec
    def register_kv_caches(self, kv_caches: list[tuple[Any, Any]], block_size: int) -> None:
        """The worker's paged pools, one (key pool, value pool) per layer, indexed by block
        id on their first dimension; called once before the first step."""

    @hookspec
    def start_load_kv(self, metadata: Any) -> None:
        """Begin this step's loads (`metadata`: `build_connector_meta`'s result, or None),
        before the forward."""

    @hookspec
    def wait_for_layer_load(self, layer_index: int) -> None:
        """Return once every load into layer `layer_index` has finished."""

    @hookspec
    def save_kv_layer(self, layer_index: int, metadata: Any) -> None:
        """Layer `layer_index`'s KV of this step is written: begin saving what `metadata`
        asks."""

    @hookspec
    def wait_for_save(self) -> None:
        """Return once this step's saves no longer read the pools."""

    @hookspec(firstresult=True)
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]] | None:
        """(requests whose saves finished, requests whose asynchronous loads finished) since
        the last call; `finished_req_ids` are the requests the scheduler finished."""

    @hookspec(firstresult=True)
    def get_block_ids_with_load_errors(self) -> set[int] | None:
        """Blocks whose loads failed since the last call (their contents are garbage)."""

    @hookspec(firstresult=True)
    def get_kv_connector_stats(self) -> dict[str, float] | None:
        """Counters accumulated since the last call, reset by it: a flat mapping of
        numbers, summed by the scheduler across steps. Names are `COUNTER` or
        `COUNTER@TIER`: `loaded_tokens`, `saved_tokens`, `load_seconds`, `save_seconds`,
        `failed_loads` (per tier where a connector has tiers, e.g. `loaded_tokens@cpu`) are
        exported in `/metrics`; other names only in `engine_stats`. The worker adds its own
        wall time of each step's load and save phases to the untiered `load_seconds` and
        `save_seconds`, so a connector reports its own times per tier."""
