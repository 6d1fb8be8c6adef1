"""The draft-model drafter in the engine, with the target as its own draft model.

Drafting with the target itself must be accepted 100% under greedy sampling (the scheduler's
spec metrics count every draft accepted), so these tests are a plumbing check of the whole
speculative path -- draft KV catch-up, the bonus token, verification, rollback accounting --
with long accepted runs in every scenario: sync and async, chunked prefill, preemption
with drafts in flight, max_tokens and stop tokens falling inside an accepted run. Outputs
must equal the engine without speculation; invariants are checked after every step and no
KV block is left held. One SmolLM2 run (SmolLM2 drafting for itself, a stop string inside
an accepted run) checks the embedded model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from drafter_helpers import assert_idle_and_no_leak, greedy, make_llm, spec_metrics, token_prompts

from tandem.testing.tiny_model import save_tiny_model

K = 3
ASYNC = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
LENGTHS = [5, 40, 13, 1, 27, 9]
MAX_TOKENS = [20, 9, 30, 17, 12, 25]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("draft-target") / "llama")


@pytest.fixture(scope="module")
def no_spec_outputs(tiny_llama: Path) -> list[tuple[list[int], str | None]]:
    llm, _ = make_llm(tiny_llama, async_scheduling=False)
    outs = greedy(llm, token_prompts(0, LENGTHS), MAX_TOKENS)
    llm.engine.shutdown()
    return outs


def self_draft(model: Path | str) -> dict[str, Any]:
    return {"method": "draft_model", "num_speculative_tokens": K, "model": str(model)}


def assert_all_accepted(metrics: dict[str, Any]) -> None:
    assert metrics["num_draft_tokens"] > 0
    assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"], metrics
    assert metrics["mean_acceptance_length"] == pytest.approx(K + 1)


@pytest.mark.parametrize("async_scheduling", ASYNC)
def test_target_as_its_own_drafter_is_always_accepted(
    tiny_llama: Path,
    no_spec_outputs: list[tuple[list[int], str | None]],
    async_scheduling: bool,
) -> None:
    llm, _ = make_llm(tiny_llama, async_scheduling, speculative_config=self_draft(tiny_llama))
    assert "draft-model-drafter" in llm.engine.plugin_manager.plugin_names()
    assert greedy(llm, token_prompts(0, LENGTHS), MAX_TOKENS) == no_spec_outputs
    assert_all_accepted(spec_metrics(llm))
    assert_idle_and_no_leak(llm)
    llm.engine.shutdown()


@pytest.mark.parametrize("async_scheduling", ASYNC)
def test_chunked_prefill_and_preemption_with_drafts_in_flight(
    tiny_llama: Path,
    no_spec_outputs: list[tuple[list[int], str | None]],
    async_scheduling: bool,
) -> None:
    llm, record = make_llm(
        tiny_llama,
        async_scheduling,
        speculative_config=self_draft(tiny_llama),
        max_num_batched_tokens=12,
        num_kv_blocks=18,
        max_model_len=64,
    )
    assert greedy(llm, token_prompts(0, LENGTHS), MAX_TOKENS) == no_spec_outputs
    assert record.preempted, "the small KV pool must preempt a request with drafts in flight"
    assert record.chunked, "the small token budget must chunk a prefill"
    assert_all_accepted(spec_metrics(llm))
    assert_idle_and_no_leak(llm)
    llm.engine.shutdown()


@pytest.mark.parametrize("async_scheduling", ASYNC)
def test_max_tokens_and_stop_tokens_inside_an_accepted_run(
    tiny_llama: Path, async_scheduling: bool
) -> None:
    """Every max_tokens from 1 to 13 (so the limit falls at each offset of a k+1-token run),
    and stop tokens taken from the middle of the unconstrained output."""
    prompt = token_prompts(8, [7])[0]
    base, _ = make_llm(tiny_llama, False)
    spec, _ = make_llm(tiny_llama, async_scheduling, speculative_config=self_draft(tiny_llama))
    lengths = list(range(1, 14))
    assert greedy(spec, [prompt] * len(lengths), lengths) == greedy(
        base, [prompt] * len(lengths), lengths
    )
    full = greedy(base, [prompt], [24])[0][0]
    for stop in sorted(set(full[2:10])):
        expected = greedy(base, [prompt], [24], stop_token_ids=[stop])
        assert expected[0][1] == "stop"
        assert greedy(spec, [prompt], [24], stop_token_ids=[stop]) == expected
    assert_all_accepted(spec_metrics(spec))
    for llm in (base, spec):
        assert_idle_and_no_leak(llm)
        llm.engine.shutdown()


def test_missing_model_is_a_config_error(tiny_llama: Path) -> None:
    from tandem.schema.config import ConfigError

    with pytest.raises(ConfigError, match="speculative.model"):
        make_llm(
            tiny_llama,
            False,
            speculative_config={"method": "draft_model", "num_speculative_tokens": K},
        )


def test_smollm2_as_its_own_drafter_sync_and_async(smollm2_dir: Path) -> None:
    from tandem.llm import LLM
    from tandem.schema.sampling_params import SamplingParams

    prompt = "Once upon a time, in a small village by the sea,"
    settings: dict[str, Any] = {
        "model": "default",
        "dtype": "float32",
        "num_kv_blocks": 64,
        "block_size": 16,
        "max_model_len": 256,
        "check_invariants": True,
    }
    base = LLM(**settings)
    text = base.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0]
    words = text.outputs[0].text.split()
    assert len(words) > 4
    stop = words[3]  # a stop string inside the output, so inside an accepted run
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[stop])
    expected = base.generate([prompt], params)[0].outputs[0]
    base.engine.shutdown()
    assert expected.finish_reason == "stop"
    for async_scheduling in (False, True):
        spec = LLM(
            **settings,
            speculative_config=self_draft("default"),
            async_scheduling=async_scheduling,
        )
        out = spec.generate([prompt], params)[0].outputs[0]
        assert (out.text, out.token_ids, out.finish_reason) == (
            expected.text,
            expected.token_ids,
            expected.finish_reason,
        )
        assert_all_accepted(spec_metrics(spec))
        assert_idle_and_no_leak(spec)
        spec.engine.shutdown()
