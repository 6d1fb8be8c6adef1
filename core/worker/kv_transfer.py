"""The worker's calls into the stack's KV connector around each step's forward.

Loads: `start_load_kv`, then `wait_for_layer_load` for every layer before the forward
starts (so no layer reads a block being loaded; the loads do not overlap the forward).
Saves: `save_kv_layer` for every layer after the forward, then `wait_for_save`. Then
`get_finished`, `get_block_ids_with_load_errors` and `get_kv_connector_stats` become the
step's `KVConnectorOutput` (with the load and save phases' wall time and spans), attached
to the step's `ModelRunnerOutput` when the engine collects it (steps are collected in the
order they ran). On CUDA the saves are issued after the forward on the
same stream, so a device-to-host copy reads the written KV.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tandem.core.model_runner_output import (
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
    resolve_output,
)
from tandem.core.scheduler_output import SchedulerOutput
from tandem.kv.connector import KVConnectorOutput


class KVTransfer:
    """Runs a step's forward between the connector's loads and saves."""

    def __init__(self, hooks: Any, kv_caches: list[tuple[Any, Any]], block_size: int) -> None:
        self.hooks = hooks
        self.num_layers = len(kv_caches)
        self._outputs: deque[KVConnectorOutput] = deque()
        hooks.register_kv_caches(kv_caches=kv_caches, block_size=block_size)

    @classmethod
    def of(cls, hooks: Any, model: Any, block_size: int) -> KVTransfer | None:
        """The transfer for a stack with a worker-side connector, else None. A connector
        needs paged pools: a model without `kv_caches` cannot run one."""
        if not hooks.start_load_kv.get_hookimpls():
            return None
        pools = getattr(model, "kv_caches", None)
        if not pools:
            raise ValueError(
                f"the stack's KV connector needs paged KV pools, which "
                f"{type(model).__name__} does not have"
            )
        return cls(hooks, pools, block_size)

    def run_step(self, scheduler_output: SchedulerOutput, forward: Callable[[], None]) -> None:
        """Load, `forward()`, save; queue the step's connector output."""
        hooks, meta = self.hooks, scheduler_output.kv_connector_metadata
        t_load = time.perf_counter()
        hooks.start_load_kv(metadata=meta)
        for layer in range(self.num_layers):
            hooks.wait_for_layer_load(layer_index=layer)
        t_forward = time.perf_counter()
        forward()
        t_save = time.perf_counter()
        for layer in range(self.num_layers):
            hooks.save_kv_layer(layer_index=layer, metadata=meta)
        hooks.wait_for_save()
        t_end = time.perf_counter()
        finished = hooks.get_finished(finished_req_ids=set(scheduler_output.finished_req_ids))
        sending, recving = finished if finished is not None else (set(), set())
        invalid = hooks.get_block_ids_with_load_errors() or set()
        stats = dict(hooks.get_kv_connector_stats() or {})
        stats["load_seconds"] = stats.get("load_seconds", 0.0) + (t_forward - t_load)
        stats["save_seconds"] = stats.get("save_seconds", 0.0) + (t_end - t_save)
        spans = [("kv load", t_load, t_forward), ("forward", t_forward, t_save)]
        spans.append(("kv save", t_save, t_end))
        output = KVConnectorOutput(set(sending), set(recving), set(invalid), stats, spans)
        self._outputs.append(output)

    def attach(
        self, output: ModelRunnerOutput | AsyncModelRunnerOutput
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """The oldest queued connector output, on the step output the engine collects."""
        connector_output = self._outputs.popleft() if self._outputs else None
        if isinstance(output, ModelRunnerOutput):
            output.kv_connector_output = connector_output
            return output
        return _WithConnectorOutput(output, connector_output)


class _WithConnectorOutput:
    """An async step output that gets its connector output when resolved."""

    def __init__(self, inner: AsyncModelRunnerOutput, extra: KVConnectorOutput | None) -> None:
        self.inner, self.extra = inner, extra

    def get_output(self) -> ModelRunnerOutput:
        output = resolve_output(self.inner)
        output.kv_connector_output = self.extra
        return output
