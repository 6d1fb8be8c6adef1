"""The output path as a vLLM user meets it: `Logprob` objects with decoded tokens,
`cumulative_logprob`, `prompt_logprobs`, `output_kind` (cumulative, delta, final only),
`detokenize`, `truncate_prompt_tokens`, `spaces_between_special_tokens`, and the text of a
stop token or EOS left out of `text`.

Mostly the scripted model, whose logits are known exactly (`scripted_logits`), with a
one-character-per-token tokenizer; prompt logprobs are also checked against transformers
on a tiny random model, and the EOS text on the embedded SmolLM2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.detokenizer import IncrementalDetokenizer
from tandem.llm import LLM
from tandem.schema.outputs import Logprob, RequestOutput
from tandem.schema.sampling_params import RequestOutputKind, SamplingParams
from tandem.testing.engine import make_scripted_llm
from tandem.testing.scripted_model import scripted_logits, scripted_next_token

VOCAB = 64
EOS = 1


class CharTokenizer:
    """Token t >= 2 decodes to one character; 0 and 1 are special (`<0>`, `<1>`, dropped
    with `skip_special_tokens`). Records the keyword arguments of every decode."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        self.calls.append({"skip_special_tokens": skip_special_tokens, **kwargs})
        out = []
        for t in ids:
            if t < 2:
                if not skip_special_tokens:
                    out.append(f"<{t}>")
            else:
                out.append(chr(ord("A") + t - 2))
        return "".join(out)


def scripted_llm(tokenizer: bool = True, **overrides: Any) -> LLM:
    llm = make_scripted_llm(**{"vocab_size": VOCAB, "eos_token_id": EOS, **overrides})
    if tokenizer:  # detokenising and stop strings need it in the front end
        llm.output_processor.tokenizer = llm._builder.tokenizer = CharTokenizer()
    return llm


def generate(llm: LLM, prompts: list[list[int]], params: Any) -> list[RequestOutput]:
    return llm.generate(prompts, params, use_tqdm=False)


def prompt(i: int, n: int = 12) -> list[int]:
    return [(5 * i + 3 * j) % (VOCAB - 2) + 2 for j in range(n)]


def greedy_tokens(history: list[int], n: int) -> list[int]:
    history = list(history)
    for _ in range(n):
        history.append(scripted_next_token(history, VOCAB))
    return history[-n:]


def reference_logprobs(history: list[int]) -> torch.Tensor:
    """The scripted model's logprobs for the token after `history`."""
    nxt = torch.tensor([scripted_next_token(history, VOCAB)])
    return scripted_logits(nxt, VOCAB).log_softmax(dim=1)[0]


def check_entry(entry: dict[int, Logprob], token: int, ref: torch.Tensor, k: int) -> None:
    """`entry` holds `token` with its reference logprob and rank, then the top k."""
    assert all(isinstance(v, Logprob) for v in entry.values())
    assert abs(entry[token].logprob - float(ref[token])) < 1e-5
    assert entry[token].rank == int((ref > ref[token]).sum()) + 1
    top = ref.topk(k).indices.tolist() if k else []
    assert set(entry) == {token, *top}
    for rank, t in enumerate(top, 1):
        assert entry[t].rank == rank
        assert abs(entry[t].logprob - float(ref[t])) < 1e-5


# (1) Sample logprobs and cumulative_logprob -------------------------------------------------
def test_logprobs_are_logprob_objects_with_decoded_tokens() -> None:
    llm = scripted_llm()
    tokenizer = llm.output_processor.tokenizer
    p = prompt(0)
    out = generate(llm, [p], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))[0]
    completion = out.outputs[0]
    assert completion.token_ids == greedy_tokens(p, 6)
    assert completion.logprobs is not None and len(completion.logprobs) == 6
    history = list(p)
    total = 0.0
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        check_entry(entry, token, reference_logprobs(history), 3)
        for t, logprob in entry.items():
            assert logprob.decoded_token == tokenizer.decode([t])
        total += entry[token].logprob
        history.append(token)
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-6)


def test_no_logprobs_no_cumulative_logprob_and_zero_means_sampled_only() -> None:
    llm = scripted_llm()
    outs = generate(
        llm,
        [prompt(1), prompt(1)],
        [
            SamplingParams(temperature=0.0, max_tokens=4),
            SamplingParams(temperature=2.0, seed=3, max_tokens=4, logprobs=0),
        ],
    )
    assert outs[0].outputs[0].logprobs is None and outs[0].outputs[0].cumulative_logprob is None
    assert outs[0].prompt_logprobs is None
    sampled = outs[1].outputs[0]
    assert [list(e) for e in sampled.logprobs] == [[t] for t in sampled.token_ids]
    assert sampled.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(sampled.token_ids, sampled.logprobs, strict=True))
    )
    assert sampled.cumulative_logprob < 0


def test_logprobs_stay_aligned_when_a_stop_string_cuts_a_multi_token_step() -> None:
    """n-gram drafts make steps of several tokens: the tokens (and their logprobs and
    share of cumulative_logprob) after a stop string are dropped."""
    llm = scripted_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    p = [5, 6, 7, 8] * 4
    plain = generate(llm, [p], SamplingParams(temperature=0.0, max_tokens=20, logprobs=1))[0]
    text = plain.outputs[0].text
    stop = text[6:8]
    cut = generate(
        llm, [p], SamplingParams(temperature=0.0, max_tokens=20, logprobs=1, stop=[stop])
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    assert len(cut.logprobs) == len(cut.token_ids)
    assert cut.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(cut.token_ids, cut.logprobs, strict=True))
    )


# (2) Prompt logprobs ----------------------------------------------------------------------
def check_prompt_logprobs(out: RequestOutput, k: int) -> None:
    p = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(p)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(p)):
        check_entry(out.prompt_logprobs[i], p[i], reference_logprobs(p[:i]), k)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="sync"),
        pytest.param({"async_scheduling": True}, id="async"),
        pytest.param({"max_num_batched_tokens": 8}, id="chunked"),
        pytest.param({"async_scheduling": True, "max_num_batched_tokens": 5}, id="async-chunked"),
        pytest.param(
            {"num_kv_blocks": 16, "max_model_len": 64, "max_num_batched_tokens": 16},
            id="preempted",
        ),
        pytest.param({"executor": "process", "async_scheduling": True}, id="process-async"),
    ],
)
def test_prompt_logprobs_match_the_model(overrides: dict[str, Any]) -> None:
    llm = scripted_llm(**overrides)
    prompts = [prompt(i, 9 + 4 * i) for i in range(5)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=i % 3, ignore_eos=True)
        for i in range(5)
    ]
    params[3] = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = generate(llm, prompts, params)
    for i, out in enumerate(outs):
        if i == 3:
            assert out.prompt_logprobs is None
        else:
            check_prompt_logprobs(out, i % 3)
        assert out.outputs[0].token_ids == greedy_tokens(prompts[i], 12)
    if "num_kv_blocks" in overrides:
        scheduler = llm.engine.plugin_manager.plugins_with_role("scheduler")[0]
        assert scheduler.num_preemptions > 0


def test_prompt_logprobs_are_computed_even_when_the_prompt_is_cached() -> None:
    llm = scripted_llm()
    p = prompt(2, 30)
    first = generate(llm, [p], SamplingParams(temperature=0.0, max_tokens=2))[0]
    again = generate(llm, [p], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert again.num_cached_tokens > 0 and first.num_cached_tokens == 0
    out = generate(llm, [p], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))[0]
    check_prompt_logprobs(out, 2)


def test_prompt_logprobs_with_n_and_a_one_token_prompt() -> None:
    llm = scripted_llm()
    outs = generate(
        llm,
        [prompt(3), [7]],
        SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=1),
    )
    check_prompt_logprobs(outs[0], 1)
    assert outs[1].prompt_logprobs == [None]


def test_prompt_logprobs_decoded_tokens() -> None:
    llm = scripted_llm()
    out = generate(llm, [prompt(4)], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    for i, entry in enumerate(out.prompt_logprobs[1:], 1):
        token = out.prompt_token_ids[i]
        assert entry[token].decoded_token == chr(ord("A") + token - 2)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"async_scheduling": False}, id="sync"),
        pytest.param({"async_scheduling": True, "max_num_batched_tokens": 8}, id="async-chunked"),
    ],
)
def test_prompt_logprobs_match_transformers(
    tiny_models: dict[str, Path], hf_reference: Any, overrides: dict[str, Any]
) -> None:
    model_dir = tiny_models["llama"]
    llm = LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64, block_size=4, **overrides)
    p = [(31 * j + 7) % 380 + 3 for j in range(21)]
    out = llm.generate([p], SamplingParams(max_tokens=2, prompt_logprobs=5), use_tqdm=False)[0]
    model = hf_reference.model(model_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([p])).logits[0].float()
    ref = logits.log_softmax(dim=1)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(p)):
        entry, row = out.prompt_logprobs[i], ref[i - 1]
        assert abs(entry[p[i]].logprob - float(row[p[i]])) < 1e-3
        assert entry[p[i]].rank == int((row > row[p[i]]).sum()) + 1
        top = row.topk(5)
        pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        for rank, (t, lp) in enumerate(pairs, 1):
            assert entry[t].rank == rank and abs(entry[t].logprob - lp) < 1e-3


# (3) output_kind ------------------------------------------------------------------------------
def stream(llm: LLM, p: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Drive the engine step by step as a streaming front end would."""
    llm._add("s", None, p, params, 0)
    results: list[RequestOutput] = []
    while llm.engine.has_work():
        outputs, _ = llm.engine.run_step()
        results += llm.output_processor.stream(outputs)
        if llm.output_processor.ended_here:
            llm.engine.abort_requests(list(llm.output_processor.ended_here))
            llm.output_processor.ended_here = {}
    assert "s" not in llm.output_processor.records  # forgotten after its final output
    return results


STREAM_PARAMS = {
    "temperature": 0.0,
    "max_tokens": 10,
    "logprobs": 1,
    "prompt_logprobs": 1,
    "ignore_eos": True,
}


def final_output(**params: Any) -> RequestOutput:
    return generate(scripted_llm(), [prompt(5)], SamplingParams(**{**STREAM_PARAMS, **params}))[0]


def test_cumulative_stream_grows_to_the_final_output() -> None:
    final = final_output()
    outs = stream(scripted_llm(), prompt(5), SamplingParams(**STREAM_PARAMS))
    assert len(outs) == 10
    assert [o.finished for o in outs] == [False] * 9 + [True]
    for before, after in zip(outs, outs[1:], strict=False):
        assert after.outputs[0].token_ids[: len(before.outputs[0].token_ids)] == (
            before.outputs[0].token_ids
        )
    last = outs[-1].outputs[0]
    assert last.token_ids == final.outputs[0].token_ids and last.text == final.outputs[0].text
    assert last.cumulative_logprob == pytest.approx(final.outputs[0].cumulative_logprob)


def test_delta_stream_concatenates_to_the_final_output() -> None:
    final = final_output()
    outs = stream(
        scripted_llm(async_scheduling=True),
        prompt(5),
        SamplingParams(**STREAM_PARAMS, output_kind=RequestOutputKind.DELTA),
    )
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 10
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    text = "".join(o.outputs[0].text for o in outs)
    logprobs = [e for o in outs for e in o.outputs[0].logprobs]
    assert tokens == final.outputs[0].token_ids
    assert text == final.outputs[0].text
    assert logprobs == final.outputs[0].logprobs
    assert outs[0].prompt_logprobs == final.prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_final_only_stream_gives_one_output() -> None:
    final = final_output()
    outs = stream(
        scripted_llm(), prompt(5), SamplingParams(**STREAM_PARAMS, output_kind="final_only")
    )
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].token_ids == final.outputs[0].token_ids
    assert outs[0].prompt_logprobs == final.prompt_logprobs


def test_streamed_text_is_never_retracted_by_a_stop_string() -> None:
    """A stop string may complete a token later: streamed text holds back
    len(stop) - 1 characters until the request ends, so a delta is never taken back."""
    text = final_output(max_tokens=20).outputs[0].text
    stop = text[7:10]
    expected = text[: text.index(stop)]
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        params = SamplingParams(
            **{**STREAM_PARAMS, "max_tokens": 20}, stop=[stop], output_kind=kind
        )
        outs = stream(scripted_llm(), prompt(5), params)
        if kind == RequestOutputKind.DELTA:
            assert "".join(o.outputs[0].text for o in outs) == expected
        else:
            for o in outs:
                assert expected.startswith(o.outputs[0].text) or o.outputs[0].text == expected
            assert outs[-1].outputs[0].text == expected
        assert outs[-1].outputs[0].finish_reason == "stop"


def test_offline_generate_returns_final_outputs_for_every_kind() -> None:
    final = final_output()
    for kind in ("delta", "final_only"):
        out = final_output(output_kind=kind)
        assert out.outputs[0].token_ids == final.outputs[0].token_ids
        assert out.outputs[0].text == final.outputs[0].text
        assert out.outputs[0].logprobs == final.outputs[0].logprobs


# (4) detokenize, truncate_prompt_tokens, spaces_between_special_tokens ----------------------
def test_detokenize_false_returns_token_ids_without_text() -> None:
    llm = scripted_llm()
    p = prompt(6)
    out = generate(
        llm,
        [p],
        SamplingParams(
            temperature=0.0, max_tokens=5, detokenize=False, logprobs=1, prompt_logprobs=1
        ),
    )[0]
    assert out.outputs[0].text == ""
    assert out.outputs[0].token_ids == greedy_tokens(p, 5)
    assert all(lp.decoded_token is None for e in out.outputs[0].logprobs for lp in e.values())
    assert all(lp.decoded_token is None for e in out.prompt_logprobs[1:] for lp in e.values())
    with_text = generate(llm, [p], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert with_text.outputs[0].text == CharTokenizer().decode(greedy_tokens(p, 5))


def test_truncate_prompt_tokens_keeps_the_last_k() -> None:
    llm = scripted_llm(max_model_len=32)
    p = prompt(7, 40)
    out = generate(
        llm, [p], SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=5)
    )
    assert out[0].prompt_token_ids == p[-5:]
    assert out[0].outputs[0].token_ids == greedy_tokens(p[-5:], 4)
    # -1: as much as fits (max_model_len - 1, one position left for output).
    out = generate(
        llm, [p], SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=-1)
    )
    assert out[0].prompt_token_ids == p[-31:]
    with pytest.raises(ValueError, match="prompt"):
        generate(llm, [p], SamplingParams(temperature=0.0, max_tokens=1))


def test_spaces_between_special_tokens_reaches_the_decoder() -> None:
    llm = scripted_llm()
    tokenizer = llm.output_processor.tokenizer
    generate(llm, [prompt(8)], SamplingParams(max_tokens=3, spaces_between_special_tokens=False))
    text_calls = [c for c in tokenizer.calls if "spaces_between_special_tokens" in c]
    assert text_calls and all(c["spaces_between_special_tokens"] is False for c in text_calls)
    tokenizer.calls.clear()
    generate(llm, [prompt(8)], SamplingParams(max_tokens=3))
    assert all(
        c["spaces_between_special_tokens"] is True
        for c in tokenizer.calls
        if "spaces_between_special_tokens" in c
    )


# (5) Stop tokens and EOS: the token stays in token_ids, its text leaves `text` ------------------
def _greedy_with_a_fresh_token(p: list[int]) -> tuple[list[int], int]:
    """Greedy tokens of `p` and an index whose token did not appear before it."""
    tokens = greedy_tokens(p, 12)
    index = next(i for i in range(3, 12) if tokens[i] not in tokens[:i] and tokens[i] > 1)
    return tokens, index


@pytest.mark.parametrize("include", [False, True], ids=["dropped", "included"])
def test_stop_token_text_is_dropped_unless_included(include: bool) -> None:
    llm = scripted_llm()
    decode = CharTokenizer().decode
    p = prompt(9)
    tokens, i = _greedy_with_a_fresh_token(p)
    out = generate(
        llm,
        [p],
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            stop_token_ids=[tokens[i]],
            include_stop_str_in_output=include,
        ),
    )[0].outputs[0]
    assert out.token_ids == tokens[: i + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[i]
    assert out.text == decode(tokens[: i + 1] if include else tokens[:i])


def test_eos_text_is_dropped_but_a_length_cap_keeps_the_last_token() -> None:
    p = prompt(10)
    tokens, i = _greedy_with_a_fresh_token(p)
    decode = CharTokenizer().decode
    llm = scripted_llm(eos_token_id=tokens[i])
    params = SamplingParams(temperature=0.0, max_tokens=12, skip_special_tokens=False)
    out = generate(llm, [p], params)[0].outputs[0]
    assert out.token_ids == tokens[: i + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None
    assert out.text == decode(tokens[:i])
    capped = generate(llm, [p], SamplingParams(temperature=0.0, max_tokens=i + 1, ignore_eos=True))
    assert capped[0].outputs[0].finish_reason == "length"
    assert capped[0].outputs[0].text == decode(tokens[: i + 1])


def test_detokenizer_leaves_out_a_stop_terminated_token() -> None:
    det = IncrementalDetokenizer(CharTokenizer(), [], False, 0, True)
    assert det.append([2, 3]) is None
    det.append([4, 5], stop_terminated=True)
    assert det.text == "ABC" and det.token_ids == [2, 3, 4, 5]
    kept = IncrementalDetokenizer(CharTokenizer(), [], True, 0, True)
    kept.append([2, 3, 4, 5], stop_terminated=True)
    assert kept.text == "ABCD"
    held = IncrementalDetokenizer(CharTokenizer(), ["XYZ"], False, 0, True)
    held.append([2, 3, 4, 5])
    assert held.visible_text(finished=False) == "AB" and held.visible_text(finished=True) == "ABCD"


def test_smollm2_eos_text_not_in_output_and_decoded_logprob_tokens(smollm2_llm: LLM) -> None:
    llm = smollm2_llm
    chat = [{"role": "user", "content": "Say hello."}]
    params = SamplingParams(temperature=0.0, max_tokens=64, skip_special_tokens=False, logprobs=1)
    out = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    eos = llm.config.model.eos_token_id
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    eos_text = llm.tokenizer.decode([eos])
    assert eos_text and eos_text not in out.text
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=False)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
