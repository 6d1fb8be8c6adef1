"""Conformance check for KV connectors (`kv/connector/hookspecs.py`), third-party or bundled.

`run_kv_connector_conformance(NAME or class, options)` runs every check under sync and
async scheduling on the tiny random Llama (`tandem.testing.tiny_model`) with a 12-block pool
of 16-token blocks, stacked as `reference-scheduler`, `default-sampler` and the connector,
and returns a `KVConnectorReport` (one result per (check, mode); nothing is skipped). The
pytest plugin runs the same checks as items (`pytest_items.py`): `pytest
--tandem-kv-connector-conformance NAME [--tandem-kv-connector-options JSON]`.

The workload (`workload()`): a prompt, unrelated prompts that evict its blocks from the
pool, then prompts that continue it (one with two blocks more, which a later round, after
another eviction, continues again) and one that is exactly its 4-block prefix; greedy, 8
tokens each, one `generate` per round.

Checks:

- `answers`: every `get_num_new_matched_tokens` answer is None or `(int, bool)`, whole
  blocks, never reaches the request's last known token (at most `(num_tokens - 1) //
  block_size * block_size - num_computed_tokens`), the same when asked again at once, and
  leaves the request as it was; observed on every admission of the workload (the class
  runs as a probe subclass that asks twice) and asked directly afterwards, on the engine's
  connector instance, for every prompt of the workload with a local hit of 0 and 1 block.
- `round-trip`: the outputs equal the same workload on an engine without the connector,
  and the connector did supply tokens (`kv_connector_external_hit_tokens > 0`, more than
  its failed loads account for): a connector that never loads fails.
- `failure-contract`: in every round but the last, the probe corrupts the last block of
  every request's load and a seeded half of the others once the connector's loads end
  (the last layer's `wait_for_layer_load`; an asynchronous load when `get_finished`
  reports it received), and reports them in `get_block_ids_with_load_errors` beside the
  connector's own failures. The scheduler rolls back; the outputs must still equal the
  run without the connector and `kv_connector_failed_load_blocks > 0`. The last round
  loads cleanly what the connector holds by then, so a connector that saved blocks
  computed from a failed block (they attended to garbage) and serves them later fails.
- `no-leak`: once every request finished, every block is free except those the connector
  kept (`request_finished` answering `(True, ...)`, or a finished request whose
  asynchronous load runs); after one more request ran (its steps tell the worker which
  requests finished), the requests kept before are all released and again every block is
  free except the blocks kept for requests that finished in the last step. An engine that
  stops making progress (a pool full of kept blocks) fails after `MAX_STEPS` steps.

A run whose engine fails (a hook raised, a bad answer refused by the scheduler) fails its
check with the engine's error. The probe is a subclass of the connector class registered in
this process, so the checks use the `inprocess` executor.

Modules: `report.py` (the error, the results, the report), `runs.py` (the workload, the
engines that run it, step limits, the reference tokens), `probe.py` (the probe subclass
that observes a connector), `checks.py` (the four checks and the entry points),
`pytest_items.py` (the pytest items).
"""

from tandem.testing.kv_conformance.checks import (
    KV_CONNECTOR_CHECKS,
    check_kv_connector,
    run_kv_connector_conformance,
)
from tandem.testing.kv_conformance.report import (
    KVCheckResult,
    KVConnectorConformanceError,
    KVConnectorReport,
)
from tandem.testing.kv_conformance.runs import (
    BLOCK_SIZE,
    MODES,
    NUM_KV_BLOCKS,
    reference_tokens,
    tiny_model_dir,
    workload,
)

__all__ = [
    "BLOCK_SIZE",
    "KV_CONNECTOR_CHECKS",
    "MODES",
    "NUM_KV_BLOCKS",
    "KVCheckResult",
    "KVConnectorConformanceError",
    "KVConnectorReport",
    "check_kv_connector",
    "reference_tokens",
    "run_kv_connector_conformance",
    "tiny_model_dir",
    "workload",
]
