"""`kvdict` through its entry point only: discovery, the KV-connector conformance check, the
LRU bound, the index mirroring the worker's dictionary, the counters and the options."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402
from tandem.plugin_discovery import discover_plugins, load_plugin_class  # noqa: E402
from tandem.testing.kv_conformance import (  # noqa: E402
    BLOCK_SIZE,
    NUM_KV_BLOCKS,
    reference_tokens,
    run_kv_connector_conformance,
    tiny_model_dir,
    workload,
)

from tandem_kvdict import KVDictConnector, block_keys, root_key  # noqa: E402

BASE = ["reference-scheduler", "default-sampler"]


def _engine(**options: Any) -> LLM:
    return LLM(
        model=str(tiny_model_dir()),
        num_kv_blocks=NUM_KV_BLOCKS,
        block_size=BLOCK_SIZE,
        max_model_len=128,
        worker_num_threads=1,
        plugins=[*BASE, {"name": "kvdict", "options": options}],
    )


def _sides(llm: LLM) -> tuple[KVDictConnector, KVDictConnector]:
    """(the engine process's instance, the worker's instance)."""
    scheduler_side = dict(llm.engine.plugin_manager.stack)["kvdict"]
    worker = llm.engine.executor.worker  # the default `inprocess` executor
    return scheduler_side, dict(worker.plugin_manager.stack)["kvdict"]


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens: list[list[int]] = []
    for prompts in workload():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    return tokens


def test_discovery_finds_the_entry_point() -> None:
    info = discover_plugins()["kvdict"]
    assert info.distribution == "tandem-kvdict"
    assert info.value == "tandem_kvdict.connector:KVDictConnector"
    assert load_plugin_class("kvdict") is KVDictConnector


def test_kvdict_passes_the_conformance_check() -> None:
    report = run_kv_connector_conformance("kvdict", {"capacity_blocks": 256})
    print(report.summary())
    report.raise_for_failures()
    assert len(report.results) == 8


@pytest.mark.parametrize("capacity", [3, 1024])
def test_the_index_mirrors_the_dictionary_within_capacity(capacity: int) -> None:
    llm = _engine(capacity_blocks=capacity)
    try:
        assert _generate(llm) == reference_tokens("sync")
        scheduler_side, worker_side = _sides(llm)
        assert set(scheduler_side.index) == set(worker_side.store)
        assert 0 < len(worker_side.store) <= capacity
        if capacity > 100:  # room for every block: every evicted prefix is found
            assert llm.engine.stats()["kv_connector_external_hit_tokens"] >= 10 * BLOCK_SIZE
    finally:
        llm.engine.shutdown()


def test_counters_reach_engine_stats() -> None:
    llm = _engine()
    try:
        _generate(llm)
        stats = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    transfers = stats["kv_connector_transfers"]
    assert transfers["loaded_tokens"] == stats["kv_connector_external_hit_tokens"] > 0
    assert transfers["saved_tokens"] > 0 and transfers.get("failed_loads", 0) == 0
    assert transfers["load_seconds@host"] > 0 and transfers["save_seconds@host"] > 0


@pytest.mark.parametrize(
    ("options", "message"),
    [({"capacity_blocks": -1}, "capacity_blocks"), ({"capacity": 4}, "capacity")],
)
def test_bad_options_name_the_field(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _engine(**options)


def test_keys_chain_over_the_prefix() -> None:
    root = root_key("model", "float32", 4)
    tokens = list(range(12))
    keys = block_keys([], root, tokens, 4, 3)
    assert block_keys(keys[:1], root, tokens, 4, 3) == keys  # extended, not recomputed
    changed = block_keys([], root, [99, *tokens[1:]], 4, 3)
    assert all(a != b for a, b in zip(keys, changed, strict=True))  # block 0 names them all
    assert block_keys([], root_key("other", "float32", 4), tokens, 4, 1)[0] != keys[0]
