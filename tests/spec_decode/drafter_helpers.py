"""Shared helpers for the model-based drafter tests: tiny targets, engines, step records."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.core import hookimpl
from tandem.core.scheduler_output import SchedulerOutput
from tandem.llm import LLM
from tandem.schema.sampling_params import SamplingParams
from tandem.testing.tiny_model import TINY_VOCAB

SYNC_AND_ASYNC_IDS = ["sync", "async"]


def token_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in lengths]


@dataclass
class StepRecord:
    """Engine-side observer: preemptions and chunked prefills seen while the engine ran."""

    preempted: list[str] = field(default_factory=list)
    chunked: set[str] = field(default_factory=set)

    @hookimpl(trylast=True)
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        so = scheduler_output
        self.preempted.extend(so.preempted_req_ids)
        for new in so.scheduled_new_reqs:
            if new.num_computed_tokens + so.num_scheduled_tokens[new.req_id] < len(new.token_ids):
                self.chunked.add(new.req_id)


def make_llm(model_dir: Path, async_scheduling: bool, **overrides: Any) -> tuple[LLM, StepRecord]:
    """An LLM on a tiny target with invariant checks on, and a `StepRecord` registered."""
    settings: dict[str, Any] = {
        "max_model_len": 128,
        "num_kv_blocks": 256,
        "block_size": 4,
        "enable_prefix_caching": False,
        "check_invariants": True,
        "async_scheduling": async_scheduling,
    }
    settings.update(overrides)
    llm = LLM(model=str(model_dir), **settings)
    assert llm.config.scheduler.async_scheduling is async_scheduling
    record = StepRecord()
    llm.engine.plugin_manager.register(record, name="test-step-record")
    return llm, record


def greedy(
    llm: LLM, prompts: list[list[int]], max_tokens: list[int], **params: Any
) -> list[tuple[list[int], str | None]]:
    sampling = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **params) for n in max_tokens
    ]
    outs = llm.generate(prompts, sampling)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def spec_metrics(llm: LLM) -> dict[str, Any]:
    return llm.engine.plugin_manager.plugins_with_role("scheduler")[0].spec_metrics.as_dict()


def assert_idle_and_no_leak(llm: LLM) -> None:
    scheduler = llm.engine.plugin_manager.plugins_with_role("scheduler")[0]
    assert not scheduler.requests
    assert scheduler.kv_cache_manager.all_blocks_free()
