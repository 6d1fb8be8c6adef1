"""The EAGLE drafter in the engine, with a random head on a tiny random Llama target.

A random head's drafts are almost always rejected, so most tests check what must hold
whatever the head: greedy outputs equal the engine without speculation and transformers'
`generate()` (sync and async, chunked prefill, preemption with drafts in flight, prefix
caching), the ledger and KV invariants after every step, no KV leak at the end, and --
the drafter's own plumbing -- that every proposal equals an offline recomputation of the
head over the target's hidden states (full causal attention over the whole history, no
paged KV), so a wrong catch-up row, position, pairing or KV slot shows up as a mismatch.
A head trained in a few seconds to memorise the target's greedy continuations of a few
prompts (`memorized_head`) gives long accepted runs on those prompts: with it, max_tokens
and stop tokens fall inside accepted runs, and the catch-up over several accepted rows is
checked against the recomputation too. One short SmolLM2 run checks the embedded model.
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
from tandem.testing.memorized_eagle_head import train_memorized_head
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


MEMORIZED_PROMPTS = token_prompts(21, [8] * 12)
MEMORIZED_TOKENS = 32


@pytest.fixture(scope="module")
def memorized_head(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head trained (~2 s) on the target's own greedy continuations of MEMORIZED_PROMPTS
    (`tandem.testing.memorized_eagle_head`)."""
    return train_memorized_head(
        tiny_llama,
        MEMORIZED_PROMPTS,
        MEMORIZED_TOKENS,
        tmp_path_factory.mktemp("eagle-memorized") / "head",
    )


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
@pytest.mark.parametrize("head_fixture", ["random_head", "memorized_head"])
def test_proposals_equal_an_offline_recomputation(
    tiny_llama: Path,
    head_fixture: str,
    async_scheduling: bool,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Chunked prefill, preemption and prefix-cache hits (the second call shares the first
    call's prompts as prefixes): the head's KV must be right in all of them, also after
    steps that accepted several drafts (memorized head)."""
    head_dir: Path = request.getfixturevalue(head_fixture)
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
        speculative_config=eagle(head_dir),
        max_num_batched_tokens=12,
        num_kv_blocks=18,
        max_model_len=64,
        enable_prefix_caching=True,
    )
    prompts = token_prompts(5, [23, 30, 6]) + MEMORIZED_PROMPTS[:3]
    greedy(llm, prompts, [10, 14, 12, 20, 24, 16])
    greedy(llm, [p + token_prompts(6, [3])[0] for p in prompts[:3]], [12, 9, 11])
    greedy(llm, [p[:-2] for p in MEMORIZED_PROMPTS[:3]], [6, 6, 6])  # cached prefixes
    assert record.preempted and record.chunked
    if head_fixture == "memorized_head":  # whole runs of k drafts were accepted
        assert spec_metrics(llm)["acceptance_rate_per_position"][K - 1] > 0.05
    assert_idle_and_no_leak(llm)
    llm.engine.shutdown()

    target = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    head = load_eagle_head(head_dir)
    assert len(seen) > 20
    for history, proposal in seen[::2]:
        assert proposal == reference_drafts(target, head, history, K), len(history)


@pytest.mark.parametrize("async_scheduling", ASYNC)
def test_accepted_runs_with_max_tokens_stops_and_preemption(
    tiny_llama: Path, memorized_head: Path, async_scheduling: bool
) -> None:
    """Long accepted runs (the memorized prompts) under a tiny KV pool and token budget;
    every max_tokens from 1 to 13 and stop tokens from the middle of the output, so limits
    fall at each offset of a k+1-token run. Outputs equal the engine without drafts."""
    base, _ = make_llm(tiny_llama, False, max_model_len=64, num_kv_blocks=18)
    spec, record = make_llm(
        tiny_llama,
        async_scheduling,
        speculative_config=eagle(memorized_head),
        max_num_batched_tokens=12,
        num_kv_blocks=18,
        max_model_len=64,
    )
    prompts = MEMORIZED_PROMPTS[:6]
    lengths = [MEMORIZED_TOKENS] * len(prompts)
    full = greedy(base, prompts, lengths)
    assert greedy(spec, prompts, lengths) == full
    assert record.preempted and record.chunked
    prompt = MEMORIZED_PROMPTS[6]
    sweep = list(range(1, 14))
    assert greedy(spec, [prompt] * len(sweep), sweep) == greedy(base, [prompt] * len(sweep), sweep)
    stops = sorted(set(full[0][0][4:12]))
    for stop in stops:
        expected = greedy(base, prompts[:1], [MEMORIZED_TOKENS], stop_token_ids=[stop])
        assert expected[0][1] == "stop"
        assert greedy(spec, prompts[:1], [MEMORIZED_TOKENS], stop_token_ids=[stop]) == expected
    assert spec_metrics(spec)["mean_acceptance_length"] > 2.0
    for llm in (base, spec):
        assert_idle_and_no_leak(llm)
        llm.engine.shutdown()


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
    from tandem.schema.config import ConfigError

    with pytest.raises(ConfigError, match="not an EAGLE head checkpoint"):
        make_llm(tiny_llama, False, speculative_config=eagle(tmp_path))


# The embedded SmolLM2 ---------------------------------------------------------------------


def test_smollm2_random_head_keeps_greedy_outputs_sync_and_async(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    from tandem.llm import LLM
    from tandem.schema.sampling_params import SamplingParams

    head = save_random_eagle_head(smollm2_dir, tmp_path / "head", intermediate_size=256)
    prompts = ["The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = []
    for spec, async_scheduling in ((None, False), (eagle(head), False), (eagle(head), True)):
        llm = LLM(
            model="default",
            dtype="float32",
            num_kv_blocks=64,
            block_size=16,
            max_model_len=256,
            check_invariants=True,
            speculative_config=spec,
            async_scheduling=async_scheduling,
        )
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert_idle_and_no_leak(llm)
        llm.engine.shutdown()
    assert outputs[0] == outputs[1] == outputs[2]


class DeltaRecord:
    """Engine-side observer of each step's draft verdicts, as `update_from_output` gets
    them: (scheduled drafts, sampled tokens, the worker's explicit rejected count)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int | None]] = []

    @hookimpl(wrapper=True)
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        out = model_runner_output
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            index = out.req_id_to_index.get(rid)
            if drafts and index is not None and out.sampled_token_ids[index]:
                rejected = out.num_rejected_drafts.get(rid)
                self.seen.append((len(drafts), len(out.sampled_token_ids[index]), rejected))
        return (yield)


@pytest.mark.parametrize("async_scheduling", ASYNC)
def test_the_worker_reports_rejected_drafts_as_explicit_deltas(
    tiny_llama: Path, memorized_head: Path, async_scheduling: bool
) -> None:
    """Every request that verified drafts comes back with its rejected count, which is
    the drafts minus the accepted ones (tokens - 1); both verdicts occur."""
    llm, _ = make_llm(tiny_llama, async_scheduling, speculative_config=eagle(memorized_head))
    record = DeltaRecord()
    llm.engine.plugin_manager.register(record, name="test-delta-record")
    greedy(llm, MEMORIZED_PROMPTS[:4] + token_prompts(9, [7, 12]), [20] * 6)
    assert record.seen
    for drafts, tokens, rejected in record.seen:
        assert rejected == drafts - (tokens - 1), (drafts, tokens, rejected)
    assert any(r == 0 for *_, r in record.seen) and any(r for *_, r in record.seen)
    assert_idle_and_no_leak(llm)
    llm.engine.shutdown()
