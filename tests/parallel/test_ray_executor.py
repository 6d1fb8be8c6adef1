"""The `ray` executor on a single-node Ray cluster that this module starts (4 logical CPUs;
the ranks' rendezvous on 127.0.0.1) and stops: the rank workers as Ray actors give one rank's tokens under TP=2 (sync and
async, with chunked prefill, preemption and prefix caching), PP=2 async and TP=2 seeded
sampling; a killed actor is named by rank and the engine stops; without Ray the executor
is refused naming the extra; with no cluster the executor starts and stops its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.core.executor import executor_class
from tandem.schema.config import ConfigError
from tests.parallel.tight_workload import GREEDY, TIGHT

if os.environ.get("CI"):
    import ray  # CI installs the extra: a missing Ray must fail here, not skip
else:
    ray = pytest.importorskip("ray")

SHARED = list(range(100, 124))
PROMPTS = [
    [5, 6, 7, 8, 9],
    [11, 12, 13],
    list(range(20, 61)),
    SHARED + [7, 7, 7],
    SHARED + [9, 8, 7, 6, 5],
]


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A single-node Ray cluster for this module, stopped after it."""
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=128 * 1024**2,
    )
    yield
    ray.shutdown()


@pytest.fixture
def closing(ray_cluster: None) -> Iterator[list[LLM]]:
    engines: list[LLM] = []
    yield engines
    for llm in engines:
        llm.engine.shutdown()


def _pair(model_dir: Path, closing: list[LLM], **kw: Any) -> tuple[LLM, LLM]:
    one = LLM(model=str(model_dir), worker_num_threads=1, **kw)
    two = LLM(model=str(model_dir), executor="ray", tensor_parallel_size=2, **kw)
    closing += [one, two]
    return one, two


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_two_ray_ranks_give_one_ranks_greedy_tokens(
    async_scheduling: bool, tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    one, two = _pair(tiny_dirs["llama"], closing, async_scheduling=async_scheduling, **TIGHT)
    assert two.config.parallel.executor == "ray"
    assert _tokens(two, GREEDY) == _tokens(one, GREEDY)
    scheduler = two.engine.plugin_manager.plugins_with_role("scheduler")[0]
    assert scheduler.num_preemptions > 0
    ranks = two.engine.executor.collective_rpc("describe")
    assert [r["rank"] for r in ranks] == [0, 1]
    pids = {r["pid"] for r in ranks}
    assert len(pids) == 2 and os.getpid() not in pids  # two actor processes, not this one
    assert {a.pid for a in two.engine.executor.places} == pids
    assert two.engine.executor.init_method.startswith("tcp://127.0.0.1:")


def test_two_ray_stages_under_async_scheduling(
    tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    one = LLM(model=str(tiny_dirs["qwen3"]), worker_num_threads=1, async_scheduling=True, **TIGHT)
    staged = LLM(
        model=str(tiny_dirs["qwen3"]),
        executor="ray",
        pipeline_parallel_size=2,
        worker_num_threads=1,
        async_scheduling=True,
        **TIGHT,
    )
    closing += [one, staged]
    assert staged.config.max_concurrent_batches == 3
    assert _tokens(staged, GREEDY) == _tokens(one, GREEDY)


def test_seeded_sampling_on_ray_ranks(tiny_dirs: dict[str, Path], closing: list[LLM]) -> None:
    one, two = _pair(tiny_dirs["qwen2"], closing)
    seeded = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12) for i in range(5)
    ]
    assert _tokens(two, seeded) == _tokens(one, seeded)


def test_a_killed_ray_rank_is_named_and_the_engine_stops(
    tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    llm = LLM(model=str(tiny_dirs["llama"]), executor="ray", tensor_parallel_size=2)
    closing.append(llm)
    assert _tokens(llm, GREEDY)
    rank0, rank1 = (r["pid"] for r in llm.engine.executor.collective_rpc("describe"))
    os.kill(rank1, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(Exception, match=r"rank 1 .*Ray actor died"):  # noqa: PT011
        for _ in range(3):  # the kill lands between steps: a later step must fail
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 120
    llm.engine.shutdown()
    deadline = time.monotonic() + 60  # rank 0 was blocked in a collective: it is killed
    while _alive(rank0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(rank0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_without_ray_the_executor_is_refused_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.delitem(sys.modules, "tandem.core.worker.ray_executor", raising=False)
    with pytest.raises(ConfigError, match=r"parallel\.executor.*pip install 'tandem\[ray\]'"):
        executor_class("ray")


def test_with_no_cluster_the_executor_starts_and_stops_its_own(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """In a fresh process with no Ray connection and no RAY_ADDRESS, the executor starts a
    cluster, joins its ranks on 127.0.0.1, runs, and shuts the cluster down with the
    engine."""
    script = textwrap.dedent(
        f"""
        import ray
        from tandem import LLM, SamplingParams
        llm = LLM(model={str(tiny_dirs["llama"])!r}, executor="ray", tensor_parallel_size=2)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
        print("tokens", len(out[0].outputs[0].token_ids))
        print("rendezvous", llm.engine.executor.init_method)
        llm.engine.shutdown()
        print("after", ray.is_initialized())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens 4" in done.stdout
    assert "rendezvous tcp://127.0.0.1:" in done.stdout
    assert "after False" in done.stdout
