"""The EAGLE drafter in the engine, with a random head on a tiny random Llama target.

A random head's drafts are almost always rejected, so these tests check what must hold
whatever the head: greedy outputs equal the engine without speculation and transformers'
`generate()` (sync and async, chunked prefill, preemption with drafts in flight, prefix
caching), the ledger and KV invariants after every step, no KV leak at the end, and --
the drafter's own plumbing -- that every proposal equals an offline recomputation of the
head over the target's hidden states (full causal attention over the whole history, no
paged KV), so a wrong catch-up row, position, pairing or KV slot shows up as a mismatch.
One short SmolLM2 run checks the same on the embedded model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from drafter_helpers import assert_idle_and_no_leak, greedy, make_llm, spec_metrics, token_prompts

from tandem.core import hookimpl
from tandem.core.worker.draft_context import DraftContext
from tandem.spec_decode.eagle import EagleDrafter
from tandem.spec_decode.eagle_head import (
    causal_attend,
    load_eagle_head,
    save_random_eagle_head,
)
from tandem.testing.tiny_model import save_tiny_model

K = 3
ASYNC = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
LENGTHS = [5, 40, 13, 1, 27, 9]
MAX_TOKENS = [20, 9, 30, 17, 12, 25]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("eagle-target") / "llama")


@pytest.fixture(scope="module")
def random_head(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_eagle_head(tiny_llama, tmp_path_factory.mktemp("eagle-head") / "head")


@pytest.fixture(scope="module")
def no_spec_outputs(tiny_llama: Path) -> list[tuple[list[int], str | None]]:
    llm, _ = make_llm(tiny_llama, async_scheduling=False)
    outs = greedy(llm, token_prompts(0, LENGTHS), MAX_TOKENS)
    llm.engine.shutdown()
    return outs


def eagle(head: Path) -> dict[str, Any]:
    return {"method": "eagle", "num_speculative_tokens": K, "model": str(head)}


@pytest.mark.parametrize("async_scheduling", ASYNC)
def test_random_head_keeps_greedy_outputs(
    tiny_llama: Path,
    random_head: Path,
    no_spec_outputs: list[tuple[list[int], str | None]],
    async_scheduling: bool,
) -> None:
    llm, _ = make_llm(tiny_llama, async_scheduling, speculative_config=eagle(random_head))
    assert "eagle-drafter" in llm.engine.plugin_manager.plugin_names()
    assert greedy(llm, token_prompts(0, LENGTHS), MAX_TOKENS) == no_spec_outputs
    metrics = spec_metrics(llm)
    assert metrics["num_verify_steps"] > 0 and metrics["num_draft_tokens"] > 0
    assert_idle_and_no_leak(llm)
    llm.engine.shutdown()


def test_random_head_matches_transformers(tiny_llama: Path, random_head: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = token_prompts(3, [11])[0]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.int64),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    llm, _ = make_llm(tiny_llama, False, speculative_config=eagle(random_head))
    assert greedy(llm, [prompt], [24])[0][0] == reference
    llm.engine.shutdown()


@pytest.mark.parametrize("async_scheduling", ASYNC)
def test_chunked_prefill_and_preemption_keep_greedy_outputs(
    tiny_llama: Path,
    random_head: Path,
    no_spec_outputs: list[tuple[list[int], str | None]],
    async_scheduling: bool,
) -> None:
    llm, record = make_llm(
        tiny_llama,
        async_scheduling,
        speculative_config=eagle(random_head),
        max_num_batched_tokens=12,
        num_kv_blocks=18,
        max_model_len=64,
    )
    assert greedy(llm, token_prompts(0, LENGTHS), MAX_TOKENS) == no_spec_outputs
    assert record.preempted, "the small KV pool must preempt a request with drafts in flight"
    assert record.chunked, "the small token budget must chunk a prefill"
    assert_idle_and_no_leak(llm)
    llm.engine.shutdown()


# The drafter's plumbing against an offline recomputation -------------------------------------


def reference_drafts(target: Any, head: Any, history: list[int], k: int) -> list[int]:
    """The head's greedy drafts for `history`, recomputed from scratch: the target's hidden
    states for positions 0..N-2, then k passes of the head with full causal attention."""
    inner = target.model
    ids = torch.tensor(history)
    with torch.inference_mode():
        hidden = inner(input_ids=ids[None, :-1]).last_hidden_state[0]
        embeds = inner.embed_tokens(ids[1:])
        drafts: list[int] = []
        for _ in range(k):
            positions = torch.arange(embeds.shape[0])[None]
            cos, sin = inner.rotary_emb(embeds[None], positions)
            features = head(
                embeds[None], hidden[None], cos[:, :, None], sin[:, :, None], causal_attend
            )[0]
            token = int(target.lm_head(features[-1]).argmax())
            drafts.append(token)
            embeds = torch.cat((embeds, inner.embed_tokens(torch.tensor([token]))))
            hidden = torch.cat((hidden, features[-1:]))
    return drafts


@pytest.mark.parametrize("async_scheduling", ASYNC)
def test_proposals_equal_an_offline_recomputation(
    tiny_llama: Path,
    random_head: Path,
    async_scheduling: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunked prefill, preemption and prefix-cache hits (the second call shares the first
    call's prompts as prefixes): the head's KV must be right in all of them."""
    from transformers import AutoModelForCausalLM

    seen: list[tuple[list[int], list[int]]] = []
    original = EagleDrafter.propose_drafts

    @hookimpl
    def recording(self: EagleDrafter, context: DraftContext) -> list[list[int]]:
        proposals = original(self, context)
        for history, proposal in zip(context.token_ids, proposals, strict=True):
            if proposal:
                seen.append((list(history), list(proposal)))
        return proposals

    monkeypatch.setattr(EagleDrafter, "propose_drafts", recording)
    llm, record = make_llm(
        tiny_llama,
        async_scheduling,
        speculative_config=eagle(random_head),
        max_num_batched_tokens=12,
        num_kv_blocks=18,
        max_model_len=64,
        enable_prefix_caching=True,
    )
    prompts = token_prompts(5, [23, 30, 6])
    greedy(llm, prompts, [10, 14, 12])
    greedy(llm, [p + token_prompts(6, [3])[0] for p in prompts], [12, 9, 11])
    assert record.preempted and record.chunked
    assert_idle_and_no_leak(llm)
    llm.engine.shutdown()

    target = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    head = load_eagle_head(random_head)
    assert len(seen) > 20
    for history, proposal in seen[::2]:
        assert proposal == reference_drafts(target, head, history, K), len(history)


def test_draft_vocab_restricts_proposals(
    tiny_llama: Path,
    no_spec_outputs: list[tuple[list[int], str | None]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head with a draft vocabulary scores only those LM-head rows and maps back to
    target ids; a draft from it equals the full-vocabulary argmax over those rows."""
    vocab = list(range(3, 384, 2))
    head_dir = save_random_eagle_head(tiny_llama, tmp_path / "head", draft_vocab=vocab)
    proposed: list[int] = []
    original = EagleDrafter.propose_drafts

    @hookimpl
    def recording(self: EagleDrafter, context: DraftContext) -> list[list[int]]:
        proposals = original(self, context)
        proposed.extend(t for p in proposals for t in p)
        return proposals

    monkeypatch.setattr(EagleDrafter, "propose_drafts", recording)
    llm, _ = make_llm(tiny_llama, True, speculative_config=eagle(head_dir))
    assert greedy(llm, token_prompts(0, LENGTHS), MAX_TOKENS) == no_spec_outputs
    llm.engine.shutdown()
    assert proposed and set(proposed) <= set(vocab)
    assert load_eagle_head(head_dir).draft_vocab.tolist() == vocab


def test_missing_head_directory_is_a_config_error(tiny_llama: Path, tmp_path: Path) -> None:
    from tandem.core.config import ConfigError

    with pytest.raises(ConfigError, match="not an EAGLE head checkpoint"):
        make_llm(tiny_llama, False, speculative_config=eagle(tmp_path))


# The embedded SmolLM2 ---------------------------------------------------------------------


def test_smollm2_random_head_keeps_greedy_outputs(smollm2_dir: Path, tmp_path: Path) -> None:
    from tandem.core.sampling_params import SamplingParams
    from tandem.llm import LLM

    head = save_random_eagle_head(smollm2_dir, tmp_path / "head", intermediate_size=256)
    prompts = ["The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = []
    for spec in (None, eagle(head)):
        llm = LLM(
            model="default",
            dtype="float32",
            num_kv_blocks=64,
            block_size=16,
            max_model_len=256,
            check_invariants=True,
            speculative_config=spec,
        )
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert_idle_and_no_leak(llm)
        llm.engine.shutdown()
    assert outputs[0] == outputs[1]
