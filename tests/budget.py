"""How much randomised testing a run does.

`make test` (CI) runs every property test and fuzz family on a fixed subset: a quarter of
each test's full example count (at least 10) and the first `CI_FUZZ_WORKLOADS` fuzz seeds.
`make test-slow` sets `TANDEM_TEST_BUDGET=full` and runs the full counts.
"""

from __future__ import annotations

import os

FULL = os.environ.get("TANDEM_TEST_BUDGET", "ci") == "full"

#: Engine fuzz workloads CI runs (seeds 0 .. CI_FUZZ_WORKLOADS - 1).
CI_FUZZ_WORKLOADS = 100


def examples(full: int) -> int:
    """A property test's example count under this run's budget."""
    return full if FULL else max(10, full // 4)
