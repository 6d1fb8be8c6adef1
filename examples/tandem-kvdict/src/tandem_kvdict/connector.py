"""`kvdict`: a KV connector that keeps full blocks in a host-memory dictionary.

Written only against tandem's public KV-connector hooks (`tandem.kv.connector.hookspecs`);
the same class runs on both sides of the seam:

- **Scheduler side** (engine process). It owns the *index*: the keys the worker's
  dictionary holds, in LRU order, at most `capacity_blocks`. Each step it plans, in one
  plain-data mapping (`build_connector_meta`), the blocks to load before the forward
  (`loads`: key, block id), the blocks to save after it (`saves`: every block that became
  full in the step, unless its key is stored already) and the keys to drop (`drops`: LRU
  evictions and keys it no longer trusts). The index is always what the worker will hold
  once it applied the plans so far, so an answer of `get_num_new_matched_tokens` never
  promises a block the worker lacks.
- **Worker side**. It copies blocks between the paged pools and host tensors as the plan
  says: loads in `start_load_kv`, saves then drops in `wait_for_save`.

Keys: block i of a token sequence is `sha256(key of block i-1 + the block's token ids as
little-endian int64)`, rooted in the model path, the dtype and the block size
(`root_key`), so a key names the whole prefix up to the block's end.

Failure contract: a load the worker cannot do (the key is missing, the stored block has
another shape) is reported in `get_block_ids_with_load_errors` and never leaves wrong KV
unreported. When any load fails (reported by this connector or by anyone else in the
step's `invalid_block_ids`), the scheduler side forgets the keys of every block from the
failed one on, of every request holding it: blocks computed in the same step attended to
the garbage and may have been saved already. They are saved again once recomputed.

Options: `capacity_blocks` (blocks the dictionary holds, LRU; 0 stores nothing). A block
costs `2 * layers * kv_heads * head_dim * block_size` elements of the pools' dtype. Runs
with one worker (tensor and pipeline parallel size 1).
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin
from tandem.schema.config import ConfigError, EngineConfig


def root_key(model: str, dtype: str, block_size: int) -> str:
    """The key chain's root: what must match for stored KV to be valid here."""
    described = json.dumps({"model": model, "dtype": dtype, "block_size": block_size})
    return hashlib.sha256(described.encode()).hexdigest()


def block_keys(
    keys: list[str], root: str, token_ids: Sequence[int], block_size: int, num_blocks: int
) -> list[str]:
    """`keys` (the keys of the first blocks) extended in place to `num_blocks` keys; the
    caller guarantees `num_blocks * block_size <= len(token_ids)`."""
    parent = keys[-1] if keys else root
    for i in range(len(keys), num_blocks):
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        data = struct.pack(f"<{len(chunk)}q", *chunk)
        parent = hashlib.sha256(parent.encode() + data).hexdigest()
        keys.append(parent)
    return keys


@dataclass(slots=True, eq=False)
class _Tracked:
    """A running request as the scheduler side follows it: its blocks, the keys computed
    so far and how many of its leading blocks are saved (or stored already)."""

    request: Any
    block_ids: list[int]
    keys: list[str] = field(default_factory=list)
    num_saved: int = 0


@dataclass(slots=True)
class _Plan:
    """One step's transfers, applied by the worker in this order: loads (before the
    forward), saves, drops (after it)."""

    loads: list[tuple[str, int]] = field(default_factory=list)
    saves: list[tuple[str, int]] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)

    def as_data(self) -> dict[str, list[Any]]:
        """Plain data: it crosses to a worker in another process as MessagePack."""
        return {"loads": self.loads, "saves": self.saves, "drops": self.drops}


#: One stored block: per layer a (key block, value block) host copy.
StoredBlock = list[tuple[torch.Tensor, torch.Tensor]]


class KVDictConnector(TandemPlugin):
    """Host-memory prefix store; see the module docstring."""

    role = "kv-connector"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        capacity_blocks: int = Field(
            1024, ge=0, description="blocks the host dictionary holds (least recently used out)"
        )

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, KVDictConnector.Options)
        parallel = config.parallel
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                "plugins: kvdict runs with one worker: parallel.tensor_parallel_size and "
                "parallel.pipeline_parallel_size must be 1"
            )
        self.capacity = options.capacity_blocks
        self.block_size = config.cache.block_size
        self.root = root_key(str(config.model.model), str(config.model.dtype), self.block_size)
        # scheduler side
        self.index: OrderedDict[str, None] = OrderedDict()
        self.tracked: dict[str, _Tracked] = {}
        self.plan = _Plan()
        # worker side
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.store: dict[str, StoredBlock] = {}
        self.step_plan: dict[str, Any] | None = None
        self.failed: set[int] = set()
        self.stats: defaultdict[str, float] = defaultdict(float)

    # Scheduler side ---------------------------------------------------------------------
    def _keys(self, request: Any, num_blocks: int, keys: list[str] | None = None) -> list[str]:
        known = [] if keys is None else keys
        return block_keys(known, self.root, request.all_token_ids, self.block_size, num_blocks)

    @hookimpl
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The stored blocks right after the local hit, up to the block before the one
        holding the last known token; synchronous loads. Reads the index only."""
        bs = self.block_size
        first, limit = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        if limit <= first:
            return 0, False
        keys = self._keys(request, limit)
        found = first
        while found < limit and keys[found] in self.index:
            found += 1
        return (found - first) * bs, False

    @hookimpl
    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Follow the request; plan the loads of its external blocks (the blocks right
        before `request.num_computed_tokens`, which counts the local hit and them)."""
        tracked = _Tracked(request, list(block_ids))
        self.tracked[request.request_id] = tracked
        if not num_external_tokens:
            return
        bs = self.block_size
        end = request.num_computed_tokens // bs
        keys = self._keys(request, end, tracked.keys)
        for i in range(end - num_external_tokens // bs, end):
            if keys[i] in self.index:  # else the worker lacks it too: a failed load
                self.index.move_to_end(keys[i])
            self.plan.loads.append((keys[i], block_ids[i]))

    def _plan_save(self, key: str, block_id: int) -> None:
        if key in self.index:
            self.index.move_to_end(key)
            return
        if self.capacity == 0:
            return
        if key in self.plan.drops:  # forgotten this step: the new copy replaces the old
            self.plan.drops.remove(key)
        self.plan.saves.append((key, block_id))
        self.index[key] = None
        while len(self.index) > self.capacity:
            old, _ = self.index.popitem(last=False)
            self.plan.drops.append(old)

    def _forget(self, key: str) -> None:
        if key in self.index:
            del self.index[key]
            self.plan.drops.append(key)

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> dict[str, list[Any]] | None:
        """Plan the saves of every block that is full once this step ran; the step's plan
        (None while no step with tokens runs: the plan waits for one)."""
        for new in scheduler_output.scheduled_new_reqs:  # admitted, resumed or resent
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
            computed = min(request.num_computed_tokens + num_tokens, request.num_tokens)
            num_full = min(computed // bs, len(tracked.block_ids))
            if num_full <= tracked.num_saved:
                continue
            keys = self._keys(request, num_full, tracked.keys)
            for i in range(tracked.num_saved, num_full):
                self._plan_save(keys[i], tracked.block_ids[i])
            tracked.num_saved = num_full
        if not scheduler_output.total_num_scheduled_tokens:
            return None
        plan, self.plan = self.plan, _Plan()
        return plan.as_data()

    @hookimpl
    def update_connector_output(self, connector_output: Any) -> None:
        """Failed loads: forget every key from the failed block on, for each request
        holding one (their KV was computed from garbage; recomputed, it is saved anew)."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for tracked in self.tracked.values():
            bad = next((i for i, b in enumerate(tracked.block_ids) if b in invalid), None)
            if bad is None:
                continue
            for key in tracked.keys[bad:]:
                self._forget(key)
            tracked.num_saved = min(tracked.num_saved, bad)

    @hookimpl
    def request_finished(self, request: Any, block_ids: list[int]) -> None:
        """Saves end within their step (`wait_for_save`): the blocks may be freed now."""
        self.tracked.pop(request.request_id, None)

    # Worker side ------------------------------------------------------------------------
    @hookimpl
    def register_kv_caches(self, kv_caches: list[tuple[Any, Any]], block_size: int) -> None:
        """Keep the list itself: the worker may refill it in place (a resized pool)."""
        self.kv_caches = kv_caches

    def _fits(self, stored: StoredBlock) -> bool:
        return len(stored) == len(self.kv_caches) and all(
            sk.shape == k.shape[1:] and sv.shape == v.shape[1:] and sk.dtype == k.dtype
            for (sk, sv), (k, v) in zip(stored, self.kv_caches, strict=True)
        )

    @hookimpl
    def start_load_kv(self, metadata: Any) -> None:
        """Copy the plan's loads into the pools (before the forward); a block that cannot
        be loaded is a failed load."""
        self.step_plan = metadata
        if not metadata:
            return
        started = time.perf_counter()
        for key, block_id in metadata["loads"]:
            stored = self.store.get(key)
            if stored is None or not self._fits(stored):
                self.failed.add(block_id)
                self.stats["failed_loads"] += 1
                continue
            for (k, v), (sk, sv) in zip(self.kv_caches, stored, strict=True):
                k[block_id].copy_(sk)
                v[block_id].copy_(sv)
            self.stats["loaded_tokens"] += self.block_size
        self.stats["load_seconds@host"] += time.perf_counter() - started

    @hookimpl
    def wait_for_save(self) -> None:
        """Copy the plan's saves out of the pools (the forward wrote them), then drop."""
        plan, self.step_plan = self.step_plan, None
        if not plan:
            return
        started = time.perf_counter()
        for key, block_id in plan["saves"]:
            self.store[key] = [
                (k[block_id].to("cpu", copy=True), v[block_id].to("cpu", copy=True))
                for k, v in self.kv_caches
            ]
            self.stats["saved_tokens"] += self.block_size
        for key in plan["drops"]:
            self.store.pop(key, None)
        self.stats["save_seconds@host"] += time.perf_counter() - started

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self.failed = self.failed, set()
        return failed

    @hookimpl
    def get_kv_connector_stats(self) -> dict[str, float]:
        """`loaded_tokens`, `saved_tokens`, `failed_loads`, and the copies' own time as
        `load_seconds@host` / `save_seconds@host` (the worker adds each phase's whole wall
        time as `load_seconds` / `save_seconds`), since the last call."""
        stats, self.stats = dict(self.stats), defaultdict(float)
        return stats
