"""The concurrent-client fuzz of `AsyncLLM` (see `client_fuzz`): adversarial request ids,
every output checked against its request's nonce, the engine idle after each workload.

CI runs `CI_WORKLOADS` workloads on two engines (sync and async scheduling, a small KV
pool so requests queue and are preempted); `make test-slow` runs
`TANDEM_CLIENT_FUZZ_WORKLOADS` (default 2,000) more from seed 100,000.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from client_fuzz import generate_client_workload, run_client_workload

from tandem.engine import AsyncLLM

CI_WORKLOADS = 40
CHUNK = 10
SLOW_WORKLOADS = int(os.environ.get("TANDEM_CLIENT_FUZZ_WORKLOADS", "2000"))
SLOW_FIRST_SEED = 100_000
SLOW_CHUNK = 100


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request: pytest.FixtureRequest) -> Iterator[AsyncLLM]:
    eng = AsyncLLM(
        model="scripted",
        worker_num_threads=1,
        async_scheduling=request.param,
        max_num_seqs=4,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=24,
        check_invariants=True,
    )
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.mark.parametrize("first", range(0, CI_WORKLOADS, CHUNK), ids=lambda s: f"seeds{s}")
def test_concurrent_clients_never_see_another_requests_tokens(engine, first: int) -> None:
    for seed in range(first, first + CHUNK):
        run_client_workload(engine, generate_client_workload(seed))
    assert engine.is_healthy()


@pytest.mark.slow
@pytest.mark.parametrize(
    "first",
    range(SLOW_FIRST_SEED, SLOW_FIRST_SEED + SLOW_WORKLOADS, SLOW_CHUNK),
    ids=lambda s: f"seeds{s}",
)
def test_concurrent_clients_long_run(engine, first: int) -> None:
    last = min(first + SLOW_CHUNK, SLOW_FIRST_SEED + SLOW_WORKLOADS)
    for seed in range(first, last):
        run_client_workload(engine, generate_client_workload(seed))
