"""The default thread budget of `tandem serve` (tandem/server/budget.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.server.budget import BudgetError, plan_budget, yield_to_load


@pytest.mark.parametrize("cores", [1, 2, 3, 4])
def test_one_engine_on_a_small_machine_computes_on_every_core(cores: int) -> None:
    budget = plan_budget(1, None, cores=cores)
    assert budget.worker_threads == cores


def test_one_engine_on_a_large_machine_leaves_a_core_to_the_api_server() -> None:
    assert plan_budget(1, None, cores=16).worker_threads == 15
    assert not plan_budget(1, None, cores=16).api_server_shares_cores


def test_the_budget_line_says_when_the_api_server_shares_the_worker_cores() -> None:
    line = plan_budget(1, None, cores=2).line()
    assert "worker 2 torch threads" in line
    assert "1 + 1*2 = 3 on 2 cores this process may use: the API server shares" in line
    assert "the worker gives threads back while other processes keep them busy" in line
    assert "1 + 1*1 = 2 <= 2 cores" in plan_budget(1, 1, cores=2).line()


def test_an_explicit_worker_thread_count_may_use_every_core_of_one_engine() -> None:
    assert plan_budget(1, 2, cores=2).worker_threads == 2
    with pytest.raises(BudgetError, match=r"--worker-threads 3: .* use --worker-threads <= 2"):
        plan_budget(1, 3, cores=2)


def test_several_engines_still_leave_a_core_to_the_api_server() -> None:
    assert plan_budget(2, None, cores=4).worker_threads == 1
    with pytest.raises(BudgetError, match=r"--worker-threads 2 with --data-parallel-size 2"):
        plan_budget(2, 2, cores=4)


def test_shared_cores_make_the_worker_yield_to_load() -> None:
    shared, own = plan_budget(1, None, cores=2), plan_budget(1, None, cores=16)
    assert yield_to_load(shared) is True
    assert yield_to_load(own) is False


def test_every_rank_s_threads_count() -> None:
    """Tensor/pipeline-parallel ranks are worker processes: R ranks of k threads each."""
    two = plan_budget(1, None, cores=2, ranks=2)
    assert two.worker_threads == 1 and two.compute_threads == 3
    assert "2 rank workers per engine" in two.line() and "1 + 1*2*1 = 3" in two.line()
    assert plan_budget(1, None, cores=16, ranks=2).worker_threads == 7
    assert plan_budget(2, None, cores=16, ranks=2).worker_threads == 3
    with pytest.raises(BudgetError, match=r"--tensor-parallel-size x --pipeline-parallel-size"):
        plan_budget(1, None, cores=2, ranks=3)
    with pytest.raises(BudgetError, match=r"--worker-threads 2 x 2 ranks: .* <= 1"):
        plan_budget(1, 2, cores=2, ranks=2)


def test_serve_schedules_synchronously_unless_asked(tmp_path: Path) -> None:
    """`tandem serve` defaults to sync scheduling (as vllm serve); the flag or a stack file
    that sets async_scheduling wins."""
    from argparse import Namespace

    from tandem.server.api_server import _serves_sync_by_default
    from tandem.stack_file import load_config

    unset, on, off = (Namespace(async_scheduling=v) for v in (None, True, False))
    assert _serves_sync_by_default(unset, None)
    assert not _serves_sync_by_default(on, None)
    assert not _serves_sync_by_default(off, None)
    stack = tmp_path / "stack.yaml"
    stack.write_text("scheduler:\n  async_scheduling: true\n")
    assert not _serves_sync_by_default(unset, load_config(stack))
    stack.write_text("scheduler:\n  max_num_seqs: 8\n")
    assert _serves_sync_by_default(unset, load_config(stack))
