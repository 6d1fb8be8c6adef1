"""What the worker's KV connector reports after each step (vLLM's `KVConnectorOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KVConnectorOutput:
    """One step's transfer results, from the worker to the scheduler.

    `finished_sending`: requests whose saves completed since the last report (their blocks,
    if the scheduler kept them for the save, may now be freed). `finished_recving`:
    requests whose asynchronous loads completed. `invalid_block_ids`: pool blocks whose
    load failed this step; their contents are garbage and every request holding one rolls
    back to the block's start (the specification's load-failure rule). `stats`: the
    connector's counters for the step (`get_kv_connector_stats`) plus the worker's own
    `load_seconds` and `save_seconds` (wall time of the load and save phases). `spans`:
    (name, start, end) of the step's `kv load`, `forward` and `kv save` phases, in
    `time.perf_counter` seconds (one clock for every process of a host), for the trace.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    stats: dict[str, float] = field(default_factory=dict)
    spans: list[tuple[str, float, float]] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (
            self.finished_sending or self.finished_recving or self.invalid_block_ids or self.stats
        )
