"""`LLM` as a vLLM user meets it: `use_tqdm` on by default (or a callable), `chat`'s
arguments, `get_tokenizer()`, and bad arguments refused with one ValueError line that names
the argument, before anything runs, leaving the engine ready for the next call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.schema.sampling_params import SamplingParamsError

GREEDY = SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="scripted", async_scheduling=False, check_invariants=True)


@pytest.fixture(scope="module")
def chat_llm(tiny_chat_model: Path) -> LLM:
    return LLM(model=str(tiny_chat_model), max_model_len=64, num_kv_blocks=64, block_size=4)


def assert_ready(llm: LLM) -> None:
    """Nothing left behind, and the engine still serves."""
    assert not llm.engine.has_work()
    assert not llm.output_processor.records
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


# Bad arguments ------------------------------------------------------------------------
BAD_CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("empty prompt list", {"prompts": []}, "prompts: expected at least one prompt"),
    (
        "priority shorter than prompts",
        {"prompts": [[5, 6], [7, 8]], "priority": [1]},
        "priority: got 1 values for 2 prompts",
    ),
    (
        "priority longer than prompts",
        {"prompts": [[5, 6]], "priority": [1, 2]},
        "priority: got 2 values for 1 prompts",
    ),
    (
        "string priority",
        {"prompts": [[5, 6]], "priority": "1"},
        "priority: expected a list of integers",
    ),
    (
        "float in priority",
        {"prompts": [[5, 6]], "priority": [0.5]},
        "priority[0]: expected an integer",
    ),
    (
        "prompt_token_ids None",
        {"prompts": [{"prompt_token_ids": None}]},
        "prompts[0]['prompt_token_ids']: expected a list of integer token ids, got None",
    ),
    (
        "float token ids",
        {"prompts": [[5, 6], [7, 8.9]]},
        "prompts[1]: token ids must be integers, got 8.9 (float) at position 1",
    ),
    (
        "one prompt of float token ids",
        {"prompts": [5.0, 6.0]},
        "prompts[0]: token ids must be integers, got 5.0 (float) at position 0",
    ),
    ("empty token-id prompt", {"prompts": [[5], []]}, "prompts[1]: the prompt is empty"),
    (
        "dict without a prompt",
        {"prompts": [{"text": "hi"}]},
        "prompts[0]: expected a dict with 'prompt' or 'prompt_token_ids'",
    ),
    ("a number as prompts", {"prompts": 5}, "prompts: expected a string, a list of token ids"),
    (
        "sampling_params list of the wrong length",
        {"prompts": [[5], [6]], "sampling_params": [GREEDY]},
        "sampling_params: got 1 for 2 prompts",
    ),
    (
        "sampling_params of the wrong type",
        {"prompts": [[5]], "sampling_params": 0.5},
        "sampling_params: expected SamplingParams, a dict of its fields",
    ),
    (
        "use_tqdm of the wrong type (a priority list passed positionally)",
        {"prompts": [[5]], "sampling_params": GREEDY, "use_tqdm": [1]},
        "use_tqdm: expected True, False or a callable",
    ),
]


@pytest.mark.parametrize(("case", "kwargs", "message"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_argument_is_one_line_naming_it(
    llm: LLM, case: str, kwargs: dict[str, Any], message: str
) -> None:
    kwargs = {"sampling_params": GREEDY, **kwargs}
    with pytest.raises(ValueError) as info:
        llm.generate(**kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert_ready(llm)


def test_float_token_ids_are_refused_not_truncated(llm: LLM) -> None:
    """Before: `[5, 6.7]` ran as `[5, 6]`."""
    with pytest.raises(ValueError, match=r"got 6\.7 \(float\)"):
        llm.generate({"prompt_token_ids": [5, 6.7]}, GREEDY)
    assert_ready(llm)


def test_bad_prompt_after_good_ones_adds_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompts\[2\]"):
        llm.generate([[5, 6], [7, 8], [9, None]], GREEDY)
    assert_ready(llm)


# sampling_params as dicts ---------------------------------------------------------------
def test_sampling_params_dict_is_validated_into_sampling_params(llm: LLM) -> None:
    prompts = [[5, 6, 7], [8, 9]]
    expected = llm.generate(prompts, GREEDY, use_tqdm=False)
    as_dict = llm.generate(prompts, {"temperature": 0, "max_tokens": 3}, use_tqdm=False)
    per_prompt = llm.generate(
        prompts,
        [{"temperature": 0, "max_tokens": 3}, SamplingParams(temperature=0, max_tokens=3)],
        use_tqdm=False,
    )
    for a, b, c in zip(expected, as_dict, per_prompt, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -1}, "sampling_params: temperature"),
        ({"max_tokenz": 3}, "sampling_params: max_tokenz"),
        ([GREEDY, {"top_p": 2.0}], "sampling_params[1]: top_p"),
    ],
)
def test_bad_sampling_params_dict_names_the_field(llm: LLM, params: Any, message: str) -> None:
    prompts = [[5, 6], [7, 8]]
    with pytest.raises(SamplingParamsError) as info:
        llm.generate(prompts, params)
    assert str(info.value).startswith(message)
    assert_ready(llm)


# Progress bar ---------------------------------------------------------------------------
class RecordingBar:
    """A tqdm stand-in: records what `generate` tells it."""

    made: list[RecordingBar] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.updates: list[int] = []
        self.postfix = kwargs.get("postfix")
        self.closed = False
        RecordingBar.made.append(self)

    def update(self, n: int = 1) -> None:
        self.updates.append(n)

    def close(self) -> None:
        self.closed = True


def test_progress_bar_is_on_by_default(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate([[5, 6], [7, 8]], GREEDY)
    err = capsys.readouterr().err
    assert "Processed prompts" in err
    assert "2/2" in err
    assert "est. speed input" in err
    llm.generate([[5, 6], [7, 8]], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_progress_bar_factory_counts_prompts_not_sequences(llm: LLM) -> None:
    RecordingBar.made.clear()
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=3, n=3)
    outs = llm.generate([[5, 6], [7, 8]], params, use_tqdm=RecordingBar)
    assert [len(o.outputs) for o in outs] == [3, 3]
    (bar,) = RecordingBar.made
    assert bar.kwargs["total"] == 2
    assert bar.kwargs["desc"] == "Processed prompts"
    assert sum(bar.updates) == 2
    assert bar.closed
    assert "output:" in bar.postfix and "0.00 toks/s, output: 0.00" not in bar.postfix


# chat and get_tokenizer ------------------------------------------------------------------
def test_get_tokenizer(llm: LLM, chat_llm: LLM) -> None:
    assert llm.get_tokenizer() is None
    tokenizer = chat_llm.get_tokenizer()
    assert tokenizer is chat_llm.tokenizer
    assert tokenizer.encode("hello world", add_special_tokens=False) == [7, 8]


def test_chat_uses_the_models_template_by_default(chat_llm: LLM) -> None:
    out = chat_llm.chat([{"role": "user", "content": "hello world"}], GREEDY, use_tqdm=False)
    assert out[0].prompt == "<|user|> hello world <|assistant|> "


def test_chat_template_argument_replaces_the_models(chat_llm: LLM, tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}the"
    messages = [{"role": "user", "content": "hello world"}]
    out = chat_llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template)
    assert out[0].prompt == "hello world the"
    assert out[0].prompt_token_ids == [7, 8, 9]
    path = tmp_path / "template.jinja"
    path.write_text(template)
    again = chat_llm.chat(messages, GREEDY, use_tqdm=False, chat_template=str(path))
    assert again[0].prompt == "hello world the"
    assert again[0].outputs[0].token_ids == out[0].outputs[0].token_ids


def test_chat_template_kwargs_reach_the_template(chat_llm: LLM) -> None:
    template = "{{ messages[0]['content'] }}{% if shout %} France{% endif %}"
    messages = [{"role": "user", "content": "hello"}]
    out = chat_llm.chat(
        messages,
        GREEDY,
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"shout": True},
    )
    assert out[0].prompt == "hello France"


def test_chat_continue_final_message(chat_llm: LLM) -> None:
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "the capital"},
    ]
    out = chat_llm.chat(
        messages, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert out[0].prompt.endswith("the capital")
    assert "<|assistant|> the capital" in out[0].prompt
    with pytest.raises(
        ValueError, match="continue_final_message: True needs add_generation_prompt=False"
    ):
        chat_llm.chat(messages, GREEDY, continue_final_message=True)
    assert not chat_llm.output_processor.records


def test_chat_has_a_progress_bar_by_default(
    chat_llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    chat_llm.chat([{"role": "user", "content": "hello"}], GREEDY)
    assert "Processed prompts" in capsys.readouterr().err


def test_chat_without_any_template_says_so(chat_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_llm.tokenizer, "chat_template", None)
    with pytest.raises(
        ValueError, match="chat_template: the model's tokenizer has no chat template"
    ):
        chat_llm.chat([{"role": "user", "content": "hello"}], GREEDY)


def test_text_prompt_with_no_tokens_is_refused(chat_llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompts\[1\]: the prompt is empty"):
        chat_llm.generate(["hello", ""], GREEDY)
    assert not chat_llm.engine.has_work() and not chat_llm.output_processor.records
