"""LRW changes which request is preempted, never the tokens: victims differ from the
reference scheduler's FCFS choice (the most recently admitted) while every output equals
the scripted model's reference, under sync and async scheduling."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import pytest
from tandem.core import hookimpl
from tandem.core.request import Request
from tandem.testing import make_request, scripted_config

from _helpers import lrw_stack, req, run_exact, victim_plugin
from tandem_lrw import LRWVictim, remaining_work

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@MODES
@pytest.mark.parametrize("stack", ["lrw", "reference"])
def test_the_longest_remaining_work_is_preempted_not_the_newest(
    scripted_engine_factory: Callable[..., Any], async_scheduling: bool, stack: str
) -> None:
    """A (40 tokens to write) and B (30) run side by side until the pool is full (24 tokens
    each): FCFS preempts B, the most recently admitted; LRW preempts A, which has the most
    work left (20 tokens to B's 10)."""
    engine = scripted_engine_factory(
        plugins=lrw_stack() if stack == "lrw" else None,  # None: reference-scheduler alone
        async_scheduling=async_scheduling,
        max_num_seqs=2,
        max_model_len=48,
        num_kv_blocks=12,
        enable_prefix_caching=False,
    )
    preemptions = run_exact(engine, [req("A", 4, 40), req("B", 4, 30)])
    if stack == "lrw":
        assert preemptions == {"A": 1, "B": 0}
        assert victim_plugin(engine).victims == ["A"]
    else:
        assert preemptions == {"A": 0, "B": 1}


def pressure_workload() -> list[Request]:
    sizes = [(12, 30), (3, 6), (20, 12), (5, 25), (9, 3), (16, 18), (2, 40), (7, 8)]
    return [req(f"r{i}", *sizes[i % len(sizes)]) for i in range(12)]


@MODES
@pytest.mark.parametrize("executor", ["inprocess", "thread"])
def test_outputs_equal_the_reference_under_kv_pressure(
    scripted_engine_factory: Callable[..., Any], async_scheduling: bool, executor: str
) -> None:
    limits = {
        "async_scheduling": async_scheduling,
        "parallel": {"executor": executor},
        "max_model_len": 64,
        "max_num_batched_tokens": 24,
        "max_num_seqs": 6,
        "num_kv_blocks": 20,
    }
    lrw = run_exact(scripted_engine_factory(plugins=lrw_stack(), **limits), pressure_workload())
    fcfs = run_exact(scripted_engine_factory(**limits), pressure_workload())
    assert sum(fcfs.values()) > 0 and sum(lrw.values()) > 0, "the workload should preempt"
    assert lrw != fcfs, "LRW should choose other victims than FCFS"


class BoundChecker:
    """Wraps `select_preemption_victim`: a victim already preempted `bound` times is only
    ever chosen when every running request has been preempted that often."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.choices = 0

    @hookimpl(wrapper=True)
    def select_preemption_victim(
        self, running: Sequence[Request], needed_by: Request
    ) -> Generator[None, Request, Request]:
        victim = yield
        self.choices += 1
        if victim.num_preemptions >= self.bound:
            assert all(r.num_preemptions >= self.bound for r in running), (
                victim.request_id,
                {r.request_id: r.num_preemptions for r in running},
            )
        return victim


@MODES
@pytest.mark.parametrize("bound", [1, 2])
def test_the_starvation_bound_holds_in_a_run(
    scripted_engine_factory: Callable[..., Any], async_scheduling: bool, bound: int
) -> None:
    engine = scripted_engine_factory(
        plugins=lrw_stack(bound),
        async_scheduling=async_scheduling,
        max_model_len=64,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        num_kv_blocks=16,
    )
    checker = BoundChecker(bound)
    engine.plugin_manager.register(checker)
    run_exact(engine, pressure_workload())
    assert checker.choices > 0


def test_choice_rules_on_a_running_list() -> None:
    """Longest remaining work first; ties to the most recently admitted; the preemption
    bound removes a candidate while a fresher one exists; priority classes first."""
    config = scripted_config(max_model_len=64)
    plugin = LRWVictim(config, LRWVictim.Options(max_preemptions=1))

    def running(*specs: tuple[str, int, int, int]) -> list[Request]:
        out = []
        for rid, prompt_len, max_tokens, preempted in specs:
            request = make_request(rid, list(range(2, 2 + prompt_len)), max_tokens=max_tokens)
            request.num_preemptions = preempted
            out.append(request)
        return out

    a, b, c = running(("a", 4, 10, 0), ("b", 4, 30, 0), ("c", 4, 30, 0))
    assert remaining_work(a, 64) == 10 + 4  # nothing computed yet: the prompt counts too
    assert plugin.select_preemption_victim([a, b, c], a) is c  # tie b/c: the newest
    c.num_preemptions = 1
    assert plugin.select_preemption_victim([a, b, c], a) is b  # c reached the bound
    b.num_preemptions = a.num_preemptions = 1
    assert plugin.select_preemption_victim([a, b, c], a) is c  # all did: longest again
    b.num_computed_tokens = 4  # b's prompt is computed: less work left than c
    assert plugin.select_preemption_victim([a, b, c], a) is c
    priority = LRWVictim(
        scripted_config(max_model_len=64, scheduling_policy="priority"), LRWVictim.Options()
    )
    low, high = running(("low", 4, 5, 0), ("high", 4, 50, 0))
    low.priority, high.priority = 5, 0  # lower value is more important
    assert priority.select_preemption_victim([high, low], high) is low
