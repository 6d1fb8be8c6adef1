"""Failing fuzz workloads, kept as regression tests (../shared/reference/fuzz-failures.md and
this harness's own finds). Each ran wrong before its fix; `check_workload` runs it under
sync and async (and, where named, the thread executor), compares token for token, checks
the invariants after every step and that nothing leaks.

A. `fake-grammar` under async built draft rows from the scheduled `-1` placeholders, not
   from the drafts the worker verifies (now `Request.draft_token_ids` through
   `drafts_to_verify`): async output broke the grammar and differed from sync.
B. `fake-grammar.grammar_bitmask` raised KeyError for a constrained request that finished
   (or was aborted) while its step's sampling was deferred.
C. With `check_invariants`, "every block is free when idle" fired while a step whose
   sampling was deferred was still to re-enter the batch queue.
D. An abort queued for a request id that had already finished ended a later request that
   reused the id.
"""

from __future__ import annotations

from typing import Any

import pytest
from fuzz_harness import check_workload

MODULUS_3 = {"custom": {"modulus": 3}}
SEEDED = {"temperature": 0.5, "top_k": 15, "top_p": 0.9}


def table_workload(
    vocab: int,
    eos: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    threshold: int,
    prefix_caching: bool,
    policy: str,
    k: int,
    disable_by_batch_size: int | None,
    num_correct: int | None,
) -> dict[str, Any]:
    """A row of fuzz-failures.md's table A: its engine limits, drafts and grammar, with
    the request mix it describes (greedy and seeded, `ignore_eos`, stop tokens,
    `max_tokens` up to 10**6, modulus 3); `num_correct` None: a different count per
    request ("random")."""
    prompts = [[3, 5, 7, 2, 2, 3], [7] * 9, [2, 3, 5, 7, 11, 13, 2], [5, 5, 3]]
    params: list[dict[str, Any]] = [
        {"max_tokens": 10**6, "ignore_eos": True, "structured_outputs": MODULUS_3},
        {"max_tokens": 40, "seed": 7, "stop_token_ids": [9], **SEEDED,
         "structured_outputs": MODULUS_3},
        {"max_tokens": 30, "stop_token_ids": [4, 17], "structured_outputs": MODULUS_3},
        {"max_tokens": 10**6, "ignore_eos": True, "seed": 11, **SEEDED},
    ]  # fmt: skip
    requests = [
        {
            "rid": f"r{i + 1}",
            "prompt": prompt,
            "params": {"temperature": 0.0, **p},
            "priority": i % 3,
            "arrival": 6 * i,
            "num_correct": i % (k + 1),
        }
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
    ]
    return {
        "seed": -1,
        "engine": {
            "vocab_size": vocab,
            "eos_token_id": eos,
            "max_model_len": max_model_len,
            "block_size": block_size,
            "num_kv_blocks": num_blocks,
            "max_num_batched_tokens": budget,
            "max_num_seqs": max_num_seqs,
            "long_prefill_token_threshold": threshold,
            "enable_prefix_caching": prefix_caching,
            "scheduling_policy": policy,
        },
        "spec": {
            "k": k,
            "num_correct": num_correct,
            "disable_by_batch_size": disable_by_batch_size,
        },
        "grammar": True,
        "requests": requests,
    }


TABLE_A = {  # vocab, eos, len, block, blocks, budget, seqs, threshold, prefix, policy, k, ...
    "row1": (128, 0, 175, 8, 22, 56, 4, 7, False, "priority", 3, 2, None),
    "row2": (128, 1, 91, 16, 6, 5, 1, 2, True, "fcfs", 3, None, None),
    "row3": (64, 1, 43, 4, 16, 41, 4, 0, False, "priority", 4, None, 3),
    "row4": (128, 1, 102, 3, 43, 61, 3, 0, True, "priority", 4, None, 0),
    "row5": (193, 5, 72, 1, 98, 450, 2, 9, True, "fcfs", 2, None, 2),
}


@pytest.mark.parametrize("row", TABLE_A.values(), ids=TABLE_A.keys())
def test_a_async_grammar_with_drafts_matches_sync(row: tuple[Any, ...]) -> None:
    check_workload(table_workload(*row), ["sync", "async"], shrink_on_failure=False)


def test_a_draft_rows_use_the_drafts_the_worker_verifies() -> None:
    """Shrunk from fuzz seed 10: one greedy constrained request, every draft right."""
    check_workload(
        {
            "seed": 10,
            "engine": {"vocab_size": 193, "eos_token_id": 0, "max_model_len": 35,
                       "block_size": 4, "num_kv_blocks": 17, "max_num_batched_tokens": 512,
                       "max_num_seqs": 8, "long_prefill_token_threshold": 0,
                       "enable_prefix_caching": True, "scheduling_policy": "priority"},
            "spec": {"k": 2, "num_correct": 2, "disable_by_batch_size": None},
            "grammar": True,
            "requests": [
                {"rid": "r2", "prompt": [3, 3, 5, 7, 7, 7, 7, 14, 5, 3, 5, 5, 5, 5, 5, 7, 150,
                                         5, 103, 43, 106, 16, 5, 5, 2],
                 "params": {"max_tokens": 40, "structured_outputs": {"custom": {"modulus": 4}}},
                 "priority": 1, "arrival": 0},
            ],
        },
        ["sync", "async", "thread-async"],
        shrink_on_failure=False,
    )  # fmt: skip


def test_b_grammar_request_that_stops_while_its_sampling_is_deferred() -> None:
    """Shrunk from fuzz seed 1: the request hits EOS while the next step, which schedules
    it, waits to sample; its bitmask rows must still come, without a KeyError."""
    check_workload(
        {
            "seed": 1,
            "engine": {"vocab_size": 64, "eos_token_id": 63, "max_model_len": 48,
                       "block_size": 16, "num_kv_blocks": 6, "max_num_batched_tokens": 7,
                       "max_num_seqs": 8, "long_prefill_token_threshold": 0,
                       "enable_prefix_caching": True, "scheduling_policy": "fcfs"},
            "spec": None,
            "grammar": True,
            "requests": [
                {"rid": "r0", "prompt": [2, 5, 2, 2, 2, 2, 7, 3, 7, 2, 3, 7, 7, 3, 5, 3, 3, 7, 5,
                                         2, 7, 2, 3, 5, 7, 2, 5, 50, 3],
                 "params": {"max_tokens": 4, "structured_outputs": {"custom": {"modulus": 6}}},
                 "priority": 0, "arrival": 0},
            ],
        },
        ["sync", "async", "thread-async"],
        shrink_on_failure=False,
    )  # fmt: skip


def test_c_no_idle_alarm_while_a_deferred_step_is_pending() -> None:
    """Shrunk from fuzz seed 14: the last request stops at EOS in the step processed while
    the next step's sampling is deferred; the engine is not idle yet (that step is in
    flight, its blocks behind a fence)."""
    check_workload(
        {
            "seed": 14,
            "engine": {"vocab_size": 32, "eos_token_id": 31, "max_model_len": 133,
                       "block_size": 3, "num_kv_blocks": 54, "max_num_batched_tokens": 39,
                       "max_num_seqs": 7, "long_prefill_token_threshold": 0,
                       "enable_prefix_caching": True, "scheduling_policy": "priority"},
            "spec": None,
            "grammar": True,
            "requests": [
                {"rid": "r6", "prompt": [2, 7, 7, 3, 7, 7, 5, 30, 3, 3, 3, 7, 3, 2, 13, 24, 29, 2,
                                         3, 3, 23, 7, 2, 13, 3, 27, 3, 7, 7, 5, 7, 3, 5, 2, 7,
                                         7, 5, 2, 5, 5, 5, 7, 7, 3, 3, 5, 2],
                 "params": {"max_tokens": 10**6, "structured_outputs": {"custom": {"modulus": 3}}},
                 "priority": 2, "arrival": 0},
            ],
        },
        ["sync", "async", "thread-async"],
        shrink_on_failure=False,
    )  # fmt: skip


def test_d_abort_after_finish_does_not_end_the_request_reusing_the_id() -> None:
    """Shrunk from fuzz seed 3: "r3" finishes, the client aborts "r3" (too late) and adds a
    new "r3" before the next step; the new one must run to its end."""
    check_workload(
        {
            "seed": 3,
            "engine": {"vocab_size": 64, "eos_token_id": 63, "max_model_len": 158,
                       "block_size": 4, "num_kv_blocks": 40, "max_num_batched_tokens": 512,
                       "max_num_seqs": 4, "long_prefill_token_threshold": 7,
                       "enable_prefix_caching": True, "scheduling_policy": "priority"},
            "spec": None,
            "grammar": False,
            "requests": [
                {"rid": "r3", "prompt": [2], "params": {"max_tokens": 2}, "priority": 3,
                 "arrival": 0, "abort_after_finish": True},
                {"rid": "r3", "prompt": [7, 2, 2, 3, 2, 5, 2, 5, 7, 7, 3, 41, 5, 2],
                 "params": {"max_tokens": 10**6}, "priority": 3, "arrival": 0},
            ],
        },
        ["sync", "async", "thread-async"],
        shrink_on_failure=False,
    )  # fmt: skip
