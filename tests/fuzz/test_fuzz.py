"""The seeded engine fuzz (see `fuzz_harness`): random workloads on the scripted model, each
run under sync (the reference), async, a worker-thread executor and, for a few, the
worker-process executor; compared token for token, invariants checked after every step,
no leaked blocks or requests at the end.

CI runs a fixed budget of `CI_WORKLOADS` workloads (seeds 0..99; all 300 of the former
budget with `TANDEM_TEST_BUDGET=full`) in chunks, so pytest
reports progress. `make test-slow` runs `TANDEM_FUZZ_WORKLOADS` (default 5,000) more, from
seed `TANDEM_FUZZ_FIRST_SEED` (default 100,000). A failure prints the seed and the smallest
failing workload found, as a dict to paste into `test_fuzz_regressions.py`. The run's totals
(workloads, runs, steps, preemptions) are printed in the terminal summary.
"""

from __future__ import annotations

import os

import pytest
from budget import CI_FUZZ_WORKLOADS, FULL
from fuzz_harness import STATS, check_workload, generate_workload, modes_for

CI_WORKLOADS = 300 if FULL else CI_FUZZ_WORKLOADS
CHUNK = 10
SLOW_WORKLOADS = int(os.environ.get("TANDEM_FUZZ_WORKLOADS", "5000"))
SLOW_FIRST_SEED = int(os.environ.get("TANDEM_FUZZ_FIRST_SEED", "100000"))
SLOW_CHUNK = 50


def run_seeds(seeds: range) -> None:
    for seed in seeds:
        check_workload(generate_workload(seed), modes_for(seed), STATS)


@pytest.mark.parametrize("first", range(0, CI_WORKLOADS, CHUNK), ids=lambda s: f"seeds{s}")
def test_fuzz_matches_sync_with_invariants(first: int) -> None:
    run_seeds(range(first, first + CHUNK))


@pytest.mark.slow
@pytest.mark.parametrize(
    "first",
    range(SLOW_FIRST_SEED, SLOW_FIRST_SEED + SLOW_WORKLOADS, SLOW_CHUNK),
    ids=lambda s: f"seeds{s}",
)
def test_fuzz_long_run(first: int) -> None:
    run_seeds(range(first, min(first + SLOW_CHUNK, SLOW_FIRST_SEED + SLOW_WORKLOADS)))
