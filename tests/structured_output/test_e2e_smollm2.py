"""Constrained generation end to end on the embedded SmolLM2, greedy: every output parses
and validates (JSON schemas with nested objects, arrays, enums and numbers; regexes;
choices; EBNF on xgrammar), with both backends, under sync, async and async + n-gram
speculation; async (with or without drafts) is token-identical to sync; the backends
agree; bad requests fail alone with a clear message.

The CI subset runs 6 cases per backend plus EBNF (13 requests) and 4 bad requests per
mode, plus an async run with a KV pool small enough to preempt constrained requests
mid-grammar; `test_sweep_50_requests` (marker `slow`) runs 50 per backend and mode.
"""

from __future__ import annotations

from typing import Any

import pytest
from so_workload import BAD_REQUESTS, CASES, MODES, SWEEP_MODES, Case, run_mode, sweep_cases

CI_CASES = [
    c
    for c in CASES
    if c.name in {"person", "reading", "date", "phone", "sentiment", "yes-no", "arith"}
]
CASE_BY_NAME = {c.name: c for c in CASES}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[Any, Any]]:
    return {mode: run_mode(mode, CI_CASES, max_tokens=48, num_kv_blocks=256) for mode in MODES}


def check_valid(outputs: dict[Any, Any], cases: list[Case]) -> int:
    by_name = {c.name: c for c in cases}
    checked = 0
    for key, out in outputs.items():
        if not isinstance(key, tuple):
            continue
        _, name = key
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (key, completion.text, out.error)
        by_name[name].validate(completion.text)
        checked += 1
    return checked


@pytest.mark.parametrize("mode", list(MODES))
def test_every_output_validates(runs: dict[str, dict[Any, Any]], mode: str) -> None:
    assert check_valid(runs[mode], CI_CASES) == 2 * len(CI_CASES) - 1


def test_async_defers_sampling_and_speculation_verifies_constrained_drafts(
    runs: dict[str, dict[Any, Any]],
) -> None:
    assert runs["sync"]["_stats"]["deferred_steps"] == 0
    assert runs["async"]["_stats"]["deferred_steps"] > 0
    spec = runs["async-ngram"]["_stats"]
    assert "ngram-drafter" in spec["stack"]
    assert spec["deferred_steps"] > 0 and spec["draft_rows"] > 0
    assert spec["accepted_drafts"] > 0


def test_small_kv_pool_preempts_constrained_requests(runs: dict[str, dict[Any, Any]]) -> None:
    assert runs["async-preempt"]["_stats"]["preemptions"] > 0
    assert runs["sync"]["_stats"]["preemptions"] == 0


@pytest.mark.parametrize("mode", ["async", "async-ngram", "async-preempt"])
def test_async_is_token_identical_to_sync(runs: dict[str, dict[Any, Any]], mode: str) -> None:
    for key, out in runs["sync"].items():
        if isinstance(key, tuple):
            assert runs[mode][key].outputs[0].token_ids == out.outputs[0].token_ids, key


def test_backends_agree(runs: dict[str, dict[Any, Any]]) -> None:
    sync = runs["sync"]
    for case in CI_CASES:
        if not case.xgrammar_only:
            xgr = sync[("xgrammar", case.name)].outputs[0]
            outl = sync[("outlines", case.name)].outputs[0]
            assert xgr.token_ids == outl.token_ids, (case.name, xgr.text, outl.text)


@pytest.mark.parametrize("mode", list(MODES))
def test_bad_requests_fail_alone_with_a_clear_message(
    runs: dict[str, dict[Any, Any]], mode: str
) -> None:
    for name, (_, words) in BAD_REQUESTS.items():
        out = runs[mode][name]
        assert out.outputs[0].finish_reason == "error", name
        assert out.outputs[0].token_ids == []
        assert out.error is not None and words in out.error, (name, out.error)


@pytest.mark.slow
def test_sweep_50_requests() -> None:
    cases = sweep_cases(50)
    by_name = {c.name: c for c in cases}
    results = {
        mode: run_mode(mode, cases, max_tokens=160, num_kv_blocks=1536, with_bad=False)
        for mode in SWEEP_MODES
    }
    problems: list[str] = []
    for mode, outputs in results.items():
        print(mode, outputs.pop("_stats"))
        for backend in ("xgrammar", "outlines"):
            valid = 0
            keys = [k for k in outputs if k[0] == backend]
            for key in keys:
                completion = outputs[key].outputs[0]
                try:
                    assert completion.finish_reason == "stop", completion.finish_reason
                    by_name[key[1]].validate(completion.text)
                    valid += 1
                except Exception as exc:  # collect every failure, then fail once
                    problems.append(f"{mode} {key}: {exc}: {completion.text!r}")
                if outputs[key].outputs[0].token_ids != results["sync"][key].outputs[0].token_ids:
                    problems.append(f"{mode} {key}: differs from sync")
            print(f"{mode} {backend}: {valid}/{len(keys)} outputs validate")
    disagree = [
        c.name
        for c in cases
        if not c.xgrammar_only
        and results["sync"][("xgrammar", c.name)].outputs[0].token_ids
        != results["sync"][("outlines", c.name)].outputs[0].token_ids
    ]
    print(f"backends disagree on {len(disagree)} of {len(cases)}: {disagree}")
    for name in disagree:
        for backend in ("xgrammar", "outlines"):
            print(f"  {backend} {name}: {results['sync'][(backend, name)].outputs[0].text!r}")
    assert not problems, "\n".join(problems)
