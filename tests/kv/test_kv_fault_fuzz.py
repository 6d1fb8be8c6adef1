"""Random workloads under a faulty KV store: every output equals the run without a connector.

Each workload draws requests from a few shared prefixes (so the store is hit) with random
tails and lengths, in a pool small enough to evict and preempt, and runs them through the
`FaultyOffloadConnector` (`tandem.testing.kv_faults`) failing a fraction of its loads and
losing a fraction of its saves (a lost save is a failed load later), with the invariant
checker on every step. CI runs a few workloads per scheduling mode and executor; `make
test-slow` runs many more.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.testing.kv_faults import FaultyOffloadConnector
from tandem.testing.tiny_model import save_tiny_model

BASE = ["reference-scheduler", "default-sampler"]
FAULTY = "tandem.testing.kv_faults:FaultyOffloadConnector"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("kv-fuzz") / "llama")


def _workload(seed: int) -> tuple[list[list[list[int]]], list[SamplingParams]]:
    """Rounds of prompts (each round one `generate` call) and per-request parameters."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 250) for _ in range(rng.randrange(24, 72))] for _ in range(3)]
    rounds, params = [], []
    for _ in range(rng.randrange(3, 6)):
        batch = []
        for _ in range(rng.randrange(1, 5)):
            tail = [rng.randrange(5, 250) for _ in range(rng.randrange(1, 20))]
            batch.append(rng.choice(prefixes) + tail)
            params.append(
                SamplingParams(temperature=0, max_tokens=rng.randrange(2, 12), ignore_eos=True)
            )
        rounds.append(batch)
    return rounds, params


def _run(model: Path, seed: int, plugins: list[Any], **kw: Any) -> tuple[list[list[int]], Any]:
    rounds, params = _workload(seed)
    llm = LLM(
        model=str(model),
        num_kv_blocks=14,
        block_size=8,
        max_model_len=112,
        worker_num_threads=1,
        plugins=plugins,
        check_invariants=True,
        **kw,
    )
    tokens: list[list[int]] = []
    try:
        start = 0
        for batch in rounds:
            inputs = [{"prompt_token_ids": p} for p in batch]
            outs = llm.generate(inputs, params[start : start + len(batch)], use_tqdm=False)
            tokens += [list(o.outputs[0].token_ids) for o in outs]
            start += len(batch)
        scheduler = llm.engine.plugin_manager.plugins_with_role("scheduler")[0]
        assert scheduler.kv_cache_manager.all_blocks_free(), "a block leaked"
        return tokens, dict(scheduler.kv_link.stats)
    finally:
        llm.engine.shutdown()


def _check(
    model: Path, seed: int, executor: str, async_scheduling: bool, load_async: bool | None = None
) -> dict[str, Any]:
    """`load_async` (default: odd seeds): loads before admission, WAITING_FOR_REMOTE_KVS."""
    kw = {"executor": executor, "async_scheduling": async_scheduling}
    expected, _ = _run(model, seed, BASE, **kw)
    rng = random.Random(seed)
    faults = {
        "cpu_blocks": 24,
        "fail_load_fraction": rng.uniform(0.05, 0.3),
        "lose_save_fraction": rng.uniform(0.0, 0.2),
        "seed": seed,
        "load_async": bool(seed % 2) if load_async is None else load_async,
    }
    faulty = FaultyOffloadConnector if executor in ("inprocess", "thread") else FAULTY
    tokens, stats = _run(model, seed, [*BASE, (faulty, faults)], **kw)
    assert tokens == expected, f"seed {seed}: {faults}"
    return stats


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("executor", ["thread", "mp"])
def test_faulty_store_never_changes_outputs(
    tiny: Path, executor: str, async_scheduling: bool
) -> None:
    totals = {"external_hit_tokens": 0, "failed_load_blocks": 0}
    seeds = range(3) if executor == "thread" else range(1)
    for seed in seeds:
        stats = _check(tiny, seed, executor, async_scheduling)
        for key in totals:
            totals[key] += stats[key]
    assert totals["external_hit_tokens"] > 0, "the workloads must load from the store"


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("executor", ["thread", "mp"])
def test_faulty_asynchronous_loads_never_change_outputs(
    tiny: Path, executor: str, async_scheduling: bool
) -> None:
    seeds = (4, 5, 6) if executor == "thread" else (4,)
    runs = [_check(tiny, seed, executor, async_scheduling, load_async=True) for seed in seeds]
    assert sum(stats["external_hit_tokens"] for stats in runs) > 0
    if executor == "thread":
        assert sum(stats["failed_load_blocks"] for stats in runs) > 0


def test_the_faults_do_fail_loads(tiny: Path) -> None:
    """Over a few workloads the injected faults do reach the rollback path."""
    failed = sum(_check(tiny, seed, "thread", True)["failed_load_blocks"] for seed in range(3, 7))
    assert failed > 0


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_many_faulty_workloads(tiny: Path, async_scheduling: bool) -> None:
    for seed in range(100, 160):
        _check(tiny, seed, "thread", async_scheduling)
