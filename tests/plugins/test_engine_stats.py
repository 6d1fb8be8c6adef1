"""The `engine_stats` numbers the bundled plugins report (merged by `EngineCore.stats()`):
gauges that follow the engine's state, cumulative counters that agree with the scheduler's
own accounting, and observation lists handed out exactly once.

Engines run on the scripted model (block_size 4, invariants checked every step)."""

from __future__ import annotations

import time
from typing import Any, cast

from tandem.core.engine_core import EngineCore
from tandem.plugins.reference_scheduler import ReferenceScheduler
from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.structured_output.backend import GrammarBackend
from tandem.structured_output.manager import StructuredOutputManager
from tandem.testing import collect_outputs, make_request, make_scripted_engine

BLOCK = 4
GAUGES = ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "num_output_placeholders")


def scheduler_of(engine: EngineCore) -> ReferenceScheduler:
    return cast(ReferenceScheduler, engine.plugin_manager.plugins_with_role("scheduler")[0])


def prompt(seed: int, length: int) -> list[int]:
    return [2 + (seed * 31 + 7 * i + i * i) % 120 for i in range(length)]


# Gauges ------------------------------------------------------------------------------------
def test_idle_engine_reports_zero_gauges_and_no_observations() -> None:
    stats = make_scripted_engine(num_kv_blocks=64).stats()
    assert {key: stats[key] for key in GAUGES} == dict.fromkeys(GAUGES, 0)
    assert stats["batch_queue_depth"] == 0
    assert stats["num_preemptions"] == 0
    assert stats["request_queue_time_s"] == []
    assert "spec_decode_num_drafts" not in stats  # no drafter configured


def test_gauges_follow_running_waiting_and_kv_then_return_to_zero_when_idle() -> None:
    engine = make_scripted_engine(num_kv_blocks=64, max_num_seqs=2)
    for i in range(3):
        engine.add_request(make_request(str(i), prompt(i, 10), max_tokens=6, ignore_eos=True))
    engine.step_fn()
    stats = engine.stats()
    assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (2, 1)
    held = sum(len(scheduler_of(engine).kv_cache_manager.get_block_ids(r)) for r in "01")
    assert stats["kv_cache_usage"] == held / 64 > 0
    collect_outputs(engine)
    stats = engine.stats()
    assert {key: stats[key] for key in GAUGES} == dict.fromkeys(GAUGES, 0)


def test_async_scheduling_reports_placeholders_and_the_batch_queue_in_flight() -> None:
    engine = make_scripted_engine(num_kv_blocks=64, async_scheduling=True)
    for i in range(3):
        engine.add_request(make_request(str(i), prompt(i, 10), max_tokens=6, ignore_eos=True))
    engine.step_fn()  # the prefill is queued; each request holds one placeholder
    stats = engine.stats()
    assert stats["batch_queue_depth"] == 1
    assert stats["num_output_placeholders"] == 3
    collect_outputs(engine)
    stats = engine.stats()
    assert (stats["batch_queue_depth"], stats["num_output_placeholders"]) == (0, 0)
    assert stats["kv_cache_usage"] == 0


# Preemptions and queue time ------------------------------------------------------------------
def test_preemptions_are_counted_and_queue_time_is_observed_once_per_request() -> None:
    engine = make_scripted_engine(num_kv_blocks=10, max_model_len=40, enable_prefix_caching=False)
    arrival = time.monotonic() - 5.0  # queued for at least 5 s before its first step
    for i in range(4):
        engine.add_request(
            make_request(str(i), prompt(i, 8), max_tokens=12, ignore_eos=True, arrival_time=arrival)
        )
    queue_times: list[float] = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.step_fn()
        queue_times += engine.stats()["request_queue_time_s"]
    scheduler = scheduler_of(engine)
    assert scheduler.num_preemptions > 0, "the tiny pool must preempt"
    stats = engine.stats()
    assert stats["num_preemptions"] == scheduler.num_preemptions
    assert len(queue_times) == 4  # preempted requests resumed: not observed again
    assert all(t >= 5.0 for t in queue_times)
    assert stats["request_queue_time_s"] == []
    assert "prefix_cache_queries" not in stats  # prefix caching off


# Prefix cache --------------------------------------------------------------------------------
def test_prefix_cache_counts_looked_up_and_cached_tokens() -> None:
    engine = make_scripted_engine(num_kv_blocks=64, enable_prefix_caching=True)
    repeated = prompt(1, 18)
    engine.add_request(make_request("first", repeated, max_tokens=3))
    collect_outputs(engine)
    stats = engine.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (18, 0)
    engine.add_request(make_request("again", repeated, max_tokens=3))
    collect_outputs(engine)
    stats = engine.stats()
    # The last prompt token is never a hit: (18 - 1) // 4 full blocks of 4 tokens.
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (36, 16)
    assert stats["kv_cache_usage"] == 0  # cached blocks are free blocks


# Speculative decoding ------------------------------------------------------------------------
def test_spec_decode_counters_equal_the_front_doors_metrics() -> None:
    from tandem import LLM, SamplingParams

    vocab = 5
    llm = LLM(
        model="scripted",
        vocab_size=vocab,
        eos_token_id=1,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        async_scheduling=False,
        max_model_len=256,
        block_size=BLOCK,
    )
    try:
        phrases = [[2 + (s + i * i) % (vocab - 2) for i in range(3 + s % 3)] for s in range(4)]
        prompts = [(p * 4)[:12] for p in phrases]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        stats = llm.engine.stats()
        metrics = llm.spec_decode_metrics()
    finally:
        llm.shutdown()
    assert metrics is not None and metrics["num_accepted_tokens"] > 0
    steps = metrics["num_verify_steps"]
    assert stats["spec_decode_num_drafts"] == steps > 0
    assert stats["spec_decode_num_draft_tokens"] == metrics["num_draft_tokens"]
    assert stats["spec_decode_num_accepted_tokens"] == metrics["num_accepted_tokens"]
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3
    assert per_pos == [round(r * steps) for r in metrics["acceptance_rate_per_position"]]
    assert sum(per_pos) == metrics["num_accepted_tokens"]


# Grammar compile time ------------------------------------------------------------------------
class AnyTokenMatcher:
    """Allows every token, never terminates."""

    def accept_token(self, token_id: int) -> bool:
        return True

    def rollback(self, num_tokens: int) -> None:
        return None

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        return None

    def is_terminated(self) -> bool:
        return False


class AnyTokenBackend:
    """A grammar backend that compiles anything to nothing (no tokenizer needed)."""

    name = "xgrammar"
    label = "any-token"

    def check(self, spec: StructuredOutputsParams) -> None:
        return None

    def compile(self, spec: StructuredOutputsParams) -> None:
        return None

    def matcher(self, compiled: Any) -> AnyTokenMatcher:
        return AnyTokenMatcher()

    def fill_bitmasks(self, matchers: list[Any], bitmask: Any, rows: list[int]) -> None:
        return None


class AnyTokenGrammar(StructuredOutputManager):
    """The bundled structured-output plugin over `AnyTokenBackend`."""

    needs_tokenizer = False

    def backend(self, name: str) -> GrammarBackend:
        return cast(GrammarBackend, AnyTokenBackend())


def test_grammar_compile_times_are_observed_once_per_request() -> None:
    plugins = [
        {"name": "reference-scheduler"},
        {"name": "default-sampler"},
        {"name": f"{__name__}:AnyTokenGrammar"},  # by path: not installed for other tests
    ]
    engine = make_scripted_engine(num_kv_blocks=64, plugins=plugins)
    grammar = {"regex": "[0-9]+"}
    for i in range(2):
        engine.add_request(
            make_request(str(i), prompt(i, 6), max_tokens=4, structured_outputs=grammar)
        )
    engine.add_request(make_request("free", prompt(9, 6), max_tokens=4))
    observed: list[float] = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step_fn()
        observed += engine.stats()["grammar_compile_time_s"]
    assert len(observed) == 2  # the constrained requests only, once each
    assert all(t >= 0 for t in observed)
    assert engine.stats()["grammar_compile_time_s"] == []
