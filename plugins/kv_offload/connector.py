"""`kv-offload`: a KV connector that keeps evicted prefixes in host memory and on disk.

Every full block a request computes is saved after the step that computed it (unless a
tier already holds its key), so a prefix the paged pool evicts later is still found: a new
request whose prompt continues past its local prefix-cache hit loads the following blocks
from the store instead of recomputing them (synchronously, before the forward). Keys are
content hashes rooted in the engine's signature (`keys.py`), so a restarted engine pointed
at the same `disk_path` finds the previous one's blocks. A block that fails to load (a
corrupt or truncated file, a file from another layout) is reported; the scheduler rolls
its requests back to the block's start and they recompute it: never wrong tokens.

Options: `cpu_blocks` (host tier size, blocks), `disk_path` (a directory for the disk tier;
none: no disk tier), `disk_blocks` (disk tier size, blocks), `shared` (engines on one host,
e.g. the data-parallel engines of `tandem serve`, share `disk_path`: every block is written
there when saved and a key missing here is looked for there), `load_async` (loads run in
the step before admission: vLLM's WAITING_FOR_REMOTE_KVS path). A block is
`2 * layers * kv_heads * head_dim * block_size` elements of the pools' dtype.
Runs with one worker (tensor and pipeline parallel size 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin
from tandem.core.request import RequestStatus
from tandem.plugins.kv_offload.index import OffloadIndex, OffloadPlan
from tandem.plugins.kv_offload.keys import engine_signature, extend_keys
from tandem.plugins.kv_offload.store import OffloadStore
from tandem.schema.config import ConfigError, EngineConfig


@dataclass(slots=True, eq=False)
class _Tracked:
    """A running request as the connector follows it: its blocks and how far it saved."""

    request: Any
    block_ids: list[int]
    keys: list[str] = field(default_factory=list)
    num_saved_blocks: int = 0


class OffloadConnector(TandemPlugin):
    role = "kv-connector"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        cpu_blocks: int = Field(4096, ge=0, description="host-memory tier size, in blocks")
        disk_path: str | None = Field(None, description="directory of the disk tier")
        disk_blocks: int = Field(65536, ge=0, description="disk tier size, in blocks")
        shared: bool = Field(
            False,
            description="engines on one host share disk_path: blocks are written to it at "
            "once, and each engine finds the others' blocks there",
        )
        load_async: bool = Field(
            False,
            description="load before admission (WAITING_FOR_REMOTE_KVS), not in the admitting step",
        )

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, OffloadConnector.Options)
        parallel = config.parallel
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                "plugins: kv-offload runs with one worker: parallel.tensor_parallel_size "
                "and parallel.pipeline_parallel_size must be 1"
            )
        if options.shared and options.disk_path is None:
            raise ConfigError("plugins: kv-offload.shared: a shared store needs disk_path")
        self.block_size = config.cache.block_size
        self.signature = engine_signature(config)
        self.disk_dir: Path | None = None
        if options.disk_path is not None:
            self.disk_dir = Path(options.disk_path).expanduser() / self.signature
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self.options = options
        self._index: OffloadIndex | None = None  # scheduler side, built on first use
        self._store: OffloadStore | None = None  # worker side, built by register_kv_caches
        self._step_plan: OffloadPlan | None = None  # worker side: the step being run
        self._finished_recving: set[str] = set()  # worker side: loads run, not reported
        self.tracked: dict[str, _Tracked] = {}
        #: Block id -> key of its latest planned load (a failed block names its key).
        self.loaded_key: dict[int, str] = {}

    # Scheduler side ---------------------------------------------------------------------
    @property
    def index(self) -> OffloadIndex:
        if self._index is None:
            opts = self.options
            self._index = OffloadIndex(
                opts.cpu_blocks, opts.disk_blocks, self.disk_dir, opts.shared
            )
        return self._index

    def _keys(self, request: Any, num_blocks: int, keys: list[str] | None = None) -> list[str]:
        return extend_keys(
            [] if keys is None else keys,
            self.signature,
            request.all_token_ids,
            self.block_size,
            num_blocks,
        )

    @hookimpl
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        bs = self.block_size
        first, limit = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        if limit <= first:
            return 0, False
        keys = self._keys(request, limit)
        tier_of = self.index.tier_of
        found = first
        while found < limit and tier_of(keys[found]) is not None:
            found += 1
        return (found - first) * bs, self.options.load_async and found > first

    @hookimpl
    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        tracked = _Tracked(request, list(block_ids))
        self.tracked[request.request_id] = tracked
        if not num_external_tokens:
            return
        bs = self.block_size
        end = request.num_computed_tokens // bs  # the local hit and the external blocks
        start = end - num_external_tokens // bs
        keys = self._keys(request, end, tracked.keys)
        for i in range(start, end):
            self.index.plan_load(keys[i], block_ids[i])
            self.loaded_key[block_ids[i]] = keys[i]
        tracked.num_saved_blocks = end  # loaded blocks are in the store already
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.index.plan.recv.append(request.request_id)

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> OffloadPlan | None:
        for new in scheduler_output.scheduled_new_reqs:  # admitted or resent: all blocks
            tracked = self.tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids)
        for cached in scheduler_output.scheduled_cached_reqs:
            tracked = self.tracked.get(cached.req_id)
            if tracked is not None:
                tracked.block_ids.extend(cached.new_block_ids)
        bs = self.block_size
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            tracked = self.tracked.get(req_id)
            if tracked is None:
                continue
            request = tracked.request
            # blocks whose every token is known and whose KV exists after this step
            computed = min(request.num_computed_tokens + num_tokens, request.num_tokens)
            num_full = min(computed // bs, len(tracked.block_ids))
            if num_full <= tracked.num_saved_blocks:
                continue
            keys = self._keys(request, num_full, tracked.keys)
            for i in range(tracked.num_saved_blocks, num_full):
                self.index.plan_save(keys[i], tracked.block_ids[i])
            tracked.num_saved_blocks = num_full
        if not scheduler_output.total_num_scheduled_tokens and not self.index.plan.recv:
            return None  # no forward: the plan waits for a step that runs one
        return self.index.take_plan()

    @hookimpl
    def update_connector_output(self, connector_output: Any) -> None:
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for block_id in invalid:
            key = self.loaded_key.pop(block_id, None)
            if key is not None:
                self.index.forget(key)
        discarded: set[str] = set()
        for tracked in self.tracked.values():  # saved again once recomputed
            bad = [i for i, b in enumerate(tracked.block_ids) if b in invalid]
            if bad:
                # the blocks after a failed one were computed reading it: their saved copies
                # may be wrong too, so no tier keeps them
                discarded.update(tracked.keys[bad[0] :])
                tracked.num_saved_blocks = min(tracked.num_saved_blocks, bad[0])
        for key in discarded:
            self.index.discard(key)
        # a load planned since (async scheduling: the next step was planned before this
        # output came) may have read such a copy: its block fails too
        invalid.update(b for b, key in self.loaded_key.items() if key in discarded)

    @hookimpl
    def request_finished(self, request: Any, block_ids: list[int]) -> None:
        """Saves finish within their step: the blocks may be freed now."""
        self.tracked.pop(request.request_id, None)

    # Worker side ------------------------------------------------------------------------
    @hookimpl
    def register_kv_caches(self, kv_caches: list[tuple[Any, Any]], block_size: int) -> None:
        self._store = OffloadStore(self.disk_dir, block_size)
        self._store.kv_caches = kv_caches

    @hookimpl
    def start_load_kv(self, metadata: Any) -> None:
        self._step_plan = plan = OffloadPlan.of(metadata)
        if plan is not None and self._store is not None:
            self._store.load(plan)
            self._finished_recving.update(plan.recv)

    @hookimpl
    def wait_for_save(self) -> None:
        """The step's saves and tier moves, after the forward: one copy of every layer's
        block per saved block (no per-layer `save_kv_layer`: on a CPU nothing overlaps)."""
        plan, self._step_plan = self._step_plan, None
        if plan is not None and self._store is not None:
            self._store.save(plan)

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Saves end within their step; asynchronous loads end in the step that ran them."""
        recving, self._finished_recving = self._finished_recving, set()
        return set(), recving

    @hookimpl
    def get_kv_connector_stats(self) -> dict[str, float]:
        """Tokens loaded and saved, load and save seconds and failed loads, per tier."""
        return self._store.take_stats() if self._store is not None else {}

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._store.take_failures() if self._store is not None else set()
