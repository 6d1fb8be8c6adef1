"""Grammar + preemption on the real model: under async scheduling, a KV pool far smaller
than the batch preempts constrained requests after their matchers have accepted output
(mid-grammar); they resume by recompute with the matcher still at their confirmed prefix.
Every output validates with `jsonschema` and equals, token for token, a sync run with a
pool large enough that nothing is preempted."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.testing.grammar_conformance import CORPUS, schema_errors

CASES = [
    c
    for c in CORPUS
    if c.name
    in {"int-bounds", "float-exclusive", "pattern-and-length", "enum-and-const", "nested-arrays"}
]
BACKENDS = ("xgrammar", "outlines")
MAX_TOKENS = 40


def run(async_scheduling: bool, num_kv_blocks: int) -> dict[str, Any]:
    from tandem import LLM, SamplingParams

    llm = LLM(
        model="default",
        dtype="float32",
        block_size=16,
        num_kv_blocks=num_kv_blocks,
        max_model_len=160,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
        check_invariants=True,
    )
    try:
        keys, prompts, params = [], [], []
        for backend in BACKENDS:
            for case in CASES:
                keys.append((backend, case.name))
                prompts.append(
                    llm.tokenizer.apply_chat_template(
                        [{"role": "user", "content": case.prompt}],
                        tokenize=False,
                        add_generation_prompt=True,
                    )
                )
                spec = {"json": case.schema, "backend": backend}
                params.append(
                    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec)
                )
        outputs = llm.generate(prompts, params, use_tqdm=False)
        manager = llm.engine.plugin_manager.get_plugin("structured-output")
        scheduler = llm.engine.plugin_manager.plugins_with_role("scheduler")[0]
        return {
            "outputs": dict(zip(keys, outputs, strict=True)),
            "preemptions": scheduler.num_preemptions,
            "preempted_mid_grammar": manager.num_preempted_mid_grammar,
            "deferred_steps": manager.num_deferred_steps,
        }
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    # 10 requests of ~60 prompt + 40 output tokens need ~70 blocks of 16; 10 blocks hold
    # one of them at a time.
    return {"sync": run(False, 512), "async-preempt": run(True, 10)}


def test_constrained_requests_are_preempted_mid_grammar(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["sync"]["preemptions"] == 0
    preempt = runs["async-preempt"]
    print({k: v for k, v in preempt.items() if k != "outputs"})
    assert preempt["preemptions"] > 0
    assert preempt["preempted_mid_grammar"] > 0, preempt
    assert preempt["deferred_steps"] > 0  # async: sampling deferred behind the grammar


def test_outputs_validate_and_equal_sync_token_for_token(
    runs: dict[str, dict[str, Any]],
) -> None:
    finished = 0
    for key, out in runs["async-preempt"]["outputs"].items():
        completion = out.outputs[0]
        reference = runs["sync"]["outputs"][key].outputs[0]
        assert completion.token_ids == reference.token_ids, (key, completion.text, reference.text)
        if completion.finish_reason == "stop":
            schema = next(c.schema for c in CASES if c.name == key[1])
            assert schema_errors(schema, completion.text) == [], (key, completion.text)
            finished += 1
    assert finished >= len(CASES)  # most requests finish inside max_tokens
