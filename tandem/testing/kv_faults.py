"""Fault-injecting KV connectors: the test doubles of the load-failure rule.

- `FailingLoadsConnector` claims one block past the local prefix-cache hit for chosen
  requests (`victims`) or a random fraction of admissions (`fraction`), writes garbage
  into it and reports its load failed: a failure with no store behind it.
- `FaultyOffloadConnector` is the real `kv-offload` store with faults: loads fail at random
  (`fail_load_fraction`: garbage written, the block reported), saves are lost at random
  (`lose_save_fraction`: the index believes the block is stored, so a later load of it
  fails), and each step's transfers are delayed (`delay_s`).

Both are seeded (`seed`), so a workload fails the same loads every run. Stack them by class
(`plugins=[..., (FaultyOffloadConnector, {"fail_load_fraction": 0.2})]`) or by path
(`tandem.testing.kv_faults:FaultyOffloadConnector`, for executors in other processes).
"""

from __future__ import annotations

import random
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin
from tandem.plugins.kv_offload.connector import OffloadConnector
from tandem.plugins.kv_offload.index import OffloadPlan
from tandem.schema.config import EngineConfig


def _garble(kv_caches: list[tuple[Any, Any]], block_id: int) -> None:
    for k, v in kv_caches:
        k[block_id].normal_(std=5.0)
        v[block_id].normal_(std=5.0)


class FailingLoadsConnector(TandemPlugin):
    """Claims one external block for chosen (or randomly drawn) requests, once per request,
    and fails its load."""

    role = "kv-connector"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        victims: list[str] = Field(default_factory=list, description="request ids to fail")
        fraction: float = Field(0.0, ge=0.0, le=1.0, description="of other admissions")
        seed: int = 0
        delay_s: float = Field(0.0, ge=0.0, description="sleep before each step's loads")

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, FailingLoadsConnector.Options)
        self.options = options
        self.block_size = config.cache.block_size
        self.rng = random.Random(options.seed)
        self.claimed: set[str] = set()
        self.planned: list[int] = []
        self.kv_caches: list[tuple[Any, Any]] = []
        self.errors: set[int] = set()

    def _chosen(self, request_id: str) -> bool:
        if request_id in self.claimed:
            return False
        if request_id in self.options.victims:
            return True
        return self.options.fraction > 0 and self.rng.random() < self.options.fraction

    @hookimpl
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        bs = self.block_size
        room = (request.num_tokens - 1) // bs * bs - num_computed_tokens
        if room < bs or not self._chosen(request.request_id):
            return 0, False
        self.claimed.add(request.request_id)  # decided once: asked again, it answers the same
        return bs, False

    @hookimpl
    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            first = (request.num_computed_tokens - num_external_tokens) // self.block_size
            self.planned += block_ids[first : first + num_external_tokens // self.block_size]
        else:
            self.claimed.discard(request.request_id)  # claimed but admitted without it

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> list[int]:
        plan, self.planned = self.planned, []
        return plan

    @hookimpl
    def register_kv_caches(self, kv_caches: list[tuple[Any, Any]], block_size: int) -> None:
        self.kv_caches = kv_caches

    @hookimpl
    def start_load_kv(self, metadata: Any) -> None:
        if self.options.delay_s:
            time.sleep(self.options.delay_s)
        for block_id in metadata or []:
            _garble(self.kv_caches, block_id)
            self.errors.add(block_id)

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors


class FaultyOffloadConnector(OffloadConnector):
    """`kv-offload` whose loads fail, saves are lost and transfers are delayed at random."""

    class Options(OffloadConnector.Options):
        fail_load_fraction: float = Field(0.0, ge=0.0, le=1.0)
        lose_save_fraction: float = Field(0.0, ge=0.0, le=1.0)
        delay_s: float = Field(0.0, ge=0.0)
        seed: int = 0

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, FaultyOffloadConnector.Options)
        self.faults = options
        self.fault_rng = random.Random(options.seed)
        self.injected = {"failed_loads": 0, "lost_saves": 0}

    @hookimpl
    def start_load_kv(self, metadata: Any) -> None:
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)
        metadata = OffloadPlan.of(metadata)
        if metadata is not None and self.faults.lose_save_fraction:
            kept = [
                s
                for s in metadata.saves
                if self.fault_rng.random() >= self.faults.lose_save_fraction
            ]
            self.injected["lost_saves"] += len(metadata.saves) - len(kept)
            metadata.saves = kept
        super().start_load_kv(metadata)  # type: ignore[misc]
        if metadata is not None and self._store is not None:
            for _, block_id, _ in metadata.loads:
                if self.fault_rng.random() < self.faults.fail_load_fraction:
                    _garble(self._store.kv_caches, block_id)
                    self._store.failed_blocks.add(block_id)
                    self.injected["failed_loads"] += 1
