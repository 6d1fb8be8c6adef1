"""Bad input at the boundary (sampling parameters, prompts, request ids, config files) and
the token-level stop rules, through the engine on the scripted model."""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM
from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore
from tandem.core.outputs import EngineCoreOutput
from tandem.schema.config import ConfigError
from tandem.schema.sampling_params import SamplingParams, SamplingParamsError
from tandem.stack_file import load_config
from tandem.testing import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    make_scripted_engine,
    scripted_next_token,
)

VOCAB = 128
EOS = 1
MAX_MODEL_LEN = 32


def expected(prompt: list[int], **params: Any) -> tuple[list[int], str]:
    params.setdefault("temperature", 0.0)
    return expected_scripted_output(prompt, SamplingParams(**params), VOCAB, EOS, MAX_MODEL_LEN)


def engine(**overrides: Any) -> EngineCore:
    return make_scripted_engine(max_model_len=MAX_MODEL_LEN, **overrides)


def gather(outputs: list[EngineCoreOutput]) -> dict[str, tuple[list[int], str | None]]:
    """Per request: all its tokens in order and its finish reason (checked to be last)."""
    result: dict[str, tuple[list[int], str | None]] = {}
    for out in outputs:
        tokens, reason = result.get(out.request_id, ([], None))
        assert reason is None, f"{out.request_id}: output after it finished"
        result[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    return result


# 1. SamplingParams ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"unknown_field": 1}, "unknown_field"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_sampling_params_raise_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    assert field in str(info.value)
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams.build(**kwargs)


def test_unknown_sampling_field_is_reported_as_unknown() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.build(max_token=5)
    assert "max_token" in str(info.value)
    assert "unknown field" in str(info.value)


# 2. Bad prompts ----------------------------------------------------------------------------
GOOD_BEFORE = [5, 6, 7, 8]
GOOD_AFTER = [40, 41, 42]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("bad_prompt", "field"),
    [
        ([9] * MAX_MODEL_LEN, "prompt"),
        ([9] * (MAX_MODEL_LEN + 7), "prompt"),
        ([], "prompt"),
        ([3, VOCAB, 4], "prompt_token_ids"),
        ([3, -1, 4], "prompt_token_ids"),
        ([3, 10_000], "prompt_token_ids"),
    ],
    ids=["max_model_len", "longer", "empty", "vocab", "negative", "huge"],
)
def test_bad_prompt_is_rejected_and_others_still_finish(
    async_scheduling: bool, bad_prompt: list[int], field: str
) -> None:
    eng = engine(async_scheduling=async_scheduling)
    eng.add_request(make_request("before", GOOD_BEFORE, max_tokens=6))
    outputs, _ = eng.step_fn()  # "before" is running when the bad request arrives
    with pytest.raises(ValueError, match=field) as info:
        eng.add_request(make_request("bad", bad_prompt, max_tokens=6))
    assert "bad" in str(info.value)
    assert "bad" not in eng.scheduler_state.requests
    eng.add_request(make_request("after", GOOD_AFTER, max_tokens=6))
    outputs += eng.run_until_idle()
    assert gather(outputs) == {
        "before": expected(GOOD_BEFORE, max_tokens=6),
        "after": expected(GOOD_AFTER, max_tokens=6),
    }
    assert not eng.has_work()


@pytest.mark.parametrize("bad_prompt", [[9] * MAX_MODEL_LEN, [], [3, VOCAB]])
def test_bad_prompt_leaves_engine_unchanged(bad_prompt: list[int]) -> None:
    eng = engine()
    eng.add_request(make_request("before", GOOD_BEFORE, max_tokens=6))
    with pytest.raises(ValueError):
        eng.add_request(make_request("bad", bad_prompt, max_tokens=6))
    eng.add_request(make_request("after", GOOD_AFTER, max_tokens=6))
    # The rejected id left no trace: it can be used again for a valid prompt.
    eng.add_request(make_request("bad", [20, 21], max_tokens=3))
    result = collect_outputs(eng)
    assert result == {
        "before": expected(GOOD_BEFORE, max_tokens=6),
        "after": expected(GOOD_AFTER, max_tokens=6),
        "bad": expected([20, 21], max_tokens=3),
    }


def test_longest_valid_prompt_is_accepted() -> None:
    eng = engine()
    prompt = [(5 * i + 2) % VOCAB for i in range(MAX_MODEL_LEN - 1)]
    eng.add_request(make_request("edge", prompt, max_tokens=10))
    result = collect_outputs(eng)
    assert result["edge"] == expected(prompt, max_tokens=10)
    assert len(result["edge"][0]) == 1


# 3. Duplicate request id ------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("steps_before", [0, 2])
def test_duplicate_request_id_is_rejected_and_original_finishes(
    async_scheduling: bool, steps_before: int
) -> None:
    eng = engine(async_scheduling=async_scheduling)
    eng.add_request(make_request("dup", GOOD_BEFORE, max_tokens=8))
    early: list[EngineCoreOutput] = []
    for _ in range(steps_before):
        early += eng.step_fn()[0]
    with pytest.raises(ValueError, match="request_id") as info:
        eng.add_request(make_request("dup", GOOD_AFTER, max_tokens=3))
    assert "dup" in str(info.value)
    outputs = early + eng.run_until_idle()
    assert gather(outputs) == {"dup": expected(GOOD_BEFORE, max_tokens=8)}
    assert not eng.has_work()


def test_request_id_can_be_reused_after_it_finished() -> None:
    eng = engine()
    eng.add_request(make_request("r", GOOD_BEFORE, max_tokens=3))
    assert collect_outputs(eng) == {"r": expected(GOOD_BEFORE, max_tokens=3)}
    eng.add_request(make_request("r", GOOD_AFTER, max_tokens=4))
    assert collect_outputs(eng) == {"r": expected(GOOD_AFTER, max_tokens=4)}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_request_id_reused_right_after_it_finished_gets_only_its_own_tokens(
    async_scheduling: bool,
) -> None:
    """The engine forgets a request id as soon as the request finishes. Under async
    scheduling a request that stops on EOS still has one step in flight at that moment;
    a new request added under the same id must not receive that step's token (or the id
    must be refused, naming request_id)."""
    prompt, _, _ = eos_prompt()
    eng = engine(async_scheduling=async_scheduling)
    eng.add_request(make_request("r", prompt, max_tokens=20))
    first: list[EngineCoreOutput] = []
    while not any(o.finish_reason for o in first):
        first += eng.step_fn()[0]
    assert gather(first) == {"r": expected(prompt, max_tokens=20)}
    try:
        eng.add_request(make_request("r", GOOD_AFTER, max_tokens=6))
    except ValueError as exc:  # refusing the id while a step for it is in flight is fine
        assert "request_id" in str(exc)
        eng.run_until_idle()
        eng.add_request(make_request("r", GOOD_AFTER, max_tokens=6))
    assert gather(eng.run_until_idle()) == {"r": expected(GOOD_AFTER, max_tokens=6)}
    assert not eng.has_work()


# 4. Config errors -------------------------------------------------------------------------
def write(tmp_path: Path, text: str, name: str = "stack.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "key_path", "expectation"),
    [
        ("scheduler: {max_num_seq: 4}\n", "scheduler.max_num_seq", "unknown field"),
        ("scheduler: {max_num_seqs: lots}\n", "scheduler.max_num_seqs", "integer"),
        ("scheduler: {max_num_seqs: 0}\n", "scheduler.max_num_seqs", "greater than"),
        ("cache: {enable_prefix_cache: true}\n", "cache.enable_prefix_cache", "unknown field"),
        ("scheduler: {scheduling_policy: lifo}\n", "scheduler.scheduling_policy", "fcfs"),
        ("model: {max_model_len: short}\n", "model.max_model_len", "integer"),
        ("schedular: {max_num_seqs: 4}\n", "schedular", "unknown field"),
        ("scheduler: 5\n", "scheduler", "dictionary"),
    ],
    ids=[
        "unknown-key",
        "wrong-type",
        "too-small",
        "unknown-cache-key",
        "bad-literal",
        "model-type",
        "unknown-section",
        "section-not-mapping",
    ],
)
def test_config_file_errors_name_file_key_and_expectation(
    tmp_path: Path, text: str, key_path: str, expectation: str
) -> None:
    path = write(tmp_path, text, "my-stack.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "my-stack.yaml" in message
    assert key_path in message
    assert expectation.lower() in message.lower()


def test_config_invalid_yaml_names_file(tmp_path: Path) -> None:
    path = write(tmp_path, "scheduler: {max_num_seqs: 4\nplugins: [a\n", "broken.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "broken.yaml" in str(info.value)
    assert "YAML" in str(info.value)


def test_config_root_not_a_mapping_names_file(tmp_path: Path) -> None:
    path = write(tmp_path, "- reference-scheduler\n", "list.yaml")
    with pytest.raises(ConfigError, match="list.yaml") as info:
        load_config(path)
    assert "mapping" in str(info.value)


def test_config_missing_file_names_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="absent.yaml"):
        load_config(tmp_path / "absent.yaml")


def test_unknown_plugin_in_stack_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model: {model: scripted, max_model_len: 64}\nplugins: [no-such-plugin]\n",
        "plugins.yaml",
    )
    with pytest.raises(ConfigError) as info:  # names are resolved with the config
        resolve_config(load_config(path))
    message = str(info.value)
    assert "plugins.yaml" in message
    assert "plugins[0].name" in message
    assert "no-such-plugin" in message
    assert "reference-scheduler" in message  # what was expected: an installed plugin
    with pytest.raises(ConfigError) as info:
        LLM(config=path)
    assert "plugins.yaml" in str(info.value) and "no-such-plugin" in str(info.value)


def test_unknown_plugin_through_keywords() -> None:
    with pytest.raises(ConfigError) as info:
        make_scripted_engine(plugins=["reference-scheduler", "no-such-plugin"])
    assert "plugins[1].name" in str(info.value)
    assert "no-such-plugin" in str(info.value)


def test_two_schedulers_in_one_stack(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model: {model: scripted, max_model_len: 64}\n"
        "plugins: [reference-scheduler, reference-scheduler]\n",
        "two.yaml",
    )
    with pytest.raises(ConfigError) as info:
        LLM(config=path)
    message = str(info.value)
    assert "two.yaml" in message
    assert message.count("reference-scheduler") >= 2
    assert "scheduler" in message.replace("reference-scheduler", "")
    with pytest.raises(ConfigError, match="scheduler"):
        make_scripted_engine(plugins=["reference-scheduler", "reference-scheduler"])


def test_bad_plugin_options_name_the_option(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model: {model: scripted, max_model_len: 64}\n"
        "plugins:\n  - name: reference-scheduler\n    options: {max_num_seqs: 3}\n"
        "  - default-sampler\n",
        "opts.yaml",
    )
    with pytest.raises(ConfigError) as info:
        LLM(config=path)
    message = str(info.value)
    assert "opts.yaml" in message
    assert "plugins[0].options" in message
    assert "max_num_seqs" in message and "unknown field" in message


def test_unknown_keyword_override() -> None:
    with pytest.raises(ConfigError, match="max_num_seq"):
        make_scripted_engine(max_num_seq=4)


# 5. stop_token_ids, min_tokens, ignore_eos ----------------------------------------------
def continuation(prompt: list[int], n: int) -> list[int]:
    history = list(prompt)
    out = []
    for _ in range(n):
        token = scripted_next_token(history, VOCAB)
        history.append(token)
        out.append(token)
    return out


@cache
def eos_prompt() -> tuple[list[int], list[int], int]:
    """A prompt whose greedy continuation reaches EOS as output k (5 <= k <= 10) with
    three distinct non-EOS tokens first, and goes on for 10 more tokens without EOS."""
    for a, b in itertools.product(range(2, VOCAB), repeat=2):
        prompt = [a, b, 3, 9]
        cont = continuation(prompt, 20)
        if EOS not in cont:
            continue
        k = cont.index(EOS) + 1
        if (
            5 <= k <= 10
            and len(set(cont[:3])) == 3
            and EOS not in cont[k : k + 10]
            and cont[2] not in cont[:2]
        ):
            return prompt, cont, k
    raise AssertionError("no prompt found")


def run_one(prompt: list[int], async_scheduling: bool, **params: Any) -> list[EngineCoreOutput]:
    eng = engine(async_scheduling=async_scheduling)
    eng.add_request(make_request("r", prompt, **params))
    outputs = eng.run_until_idle()
    assert not eng.has_work()
    return outputs


def tokens_and_reason(outputs: list[EngineCoreOutput]) -> tuple[list[int], str | None]:
    return [t for o in outputs for t in o.new_token_ids], outputs[-1].finish_reason


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request: pytest.FixtureRequest) -> bool:
    return request.param


def test_eos_stops_the_request(async_scheduling: bool) -> None:
    prompt, cont, k = eos_prompt()
    outputs = run_one(prompt, async_scheduling, max_tokens=20)
    assert tokens_and_reason(outputs) == (cont[:k], "stop") == expected(prompt, max_tokens=20)
    assert outputs[-1].stop_reason is None


def test_ignore_eos_generates_past_eos(async_scheduling: bool) -> None:
    prompt, cont, k = eos_prompt()
    outputs = run_one(prompt, async_scheduling, max_tokens=k + 5, ignore_eos=True)
    result = tokens_and_reason(outputs)
    assert result == expected(prompt, max_tokens=k + 5, ignore_eos=True)
    assert result == (cont[: k + 5], "length")
    assert result[0][k - 1] == EOS


def test_min_tokens_below_the_eos_position_changes_nothing(async_scheduling: bool) -> None:
    prompt, cont, k = eos_prompt()
    params = {"max_tokens": 20, "min_tokens": k - 1}
    result = tokens_and_reason(run_one(prompt, async_scheduling, **params))
    assert result == expected(prompt, **params) == (cont[:k], "stop")


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_min_tokens_keeps_eos_out_of_the_first_outputs(async_scheduling: bool, extra: int) -> None:
    """Before min_tokens outputs EOS is not a stop (and the sampler masks it: the greedy
    continuation diverges where it would have produced EOS)."""
    prompt, cont, k = eos_prompt()
    min_tokens = k + extra
    params = {"max_tokens": min_tokens + 6, "min_tokens": min_tokens}
    tokens, reason = tokens_and_reason(run_one(prompt, async_scheduling, **params))
    assert (tokens, reason) == expected(prompt, **params)
    assert len(tokens) >= min_tokens
    assert EOS not in tokens[:min_tokens]
    assert tokens[: k - 1] == cont[: k - 1]
    if reason == "stop":
        assert tokens[-1] == EOS and len(tokens) > min_tokens
    else:
        assert len(tokens) == min_tokens + 6


def test_stop_token_id_stops_with_stop_reason(async_scheduling: bool) -> None:
    prompt, cont, _ = eos_prompt()
    stop = cont[2]
    outputs = run_one(prompt, async_scheduling, max_tokens=20, stop_token_ids=[stop, 127 - stop])
    assert tokens_and_reason(outputs) == (cont[:3], "stop")
    assert tokens_and_reason(outputs) == expected(
        prompt, max_tokens=20, stop_token_ids=[stop, 127 - stop]
    )
    assert outputs[-1].stop_reason == stop


def test_stop_token_id_ignored_before_min_tokens(async_scheduling: bool) -> None:
    prompt, cont, k = eos_prompt()
    stop = cont[2]
    params = {"max_tokens": 20, "min_tokens": 4, "stop_token_ids": [stop]}
    tokens, reason = tokens_and_reason(run_one(prompt, async_scheduling, **params))
    assert (tokens, reason) == expected(prompt, **params)
    assert tokens[:2] == cont[:2]
    assert stop not in tokens[:4] and EOS not in tokens[:4]
    assert len(tokens) > 4
    if reason == "stop":
        assert tokens[-1] in (stop, EOS)


def test_stop_token_id_still_applies_with_ignore_eos(async_scheduling: bool) -> None:
    prompt, cont, k = eos_prompt()
    stop = cont[k + 1]  # the token right after EOS
    params = {"max_tokens": 20, "ignore_eos": True, "stop_token_ids": [stop]}
    outputs = run_one(prompt, async_scheduling, **params)
    result = tokens_and_reason(outputs)
    assert result == expected(prompt, **params)
    first = cont.index(stop) + 1
    assert result == (cont[:first], "stop")
    assert outputs[-1].stop_reason == stop


def test_eos_on_the_last_allowed_token_finishes_with_stop(async_scheduling: bool) -> None:
    """As vLLM's `check_stop`: EOS is checked before the length cap, so a request whose
    `max_tokens`-th token is EOS reports `stop`."""
    prompt, cont, k = eos_prompt()
    result = tokens_and_reason(run_one(prompt, async_scheduling, max_tokens=k))
    assert result == (cont[:k], "stop") == expected(prompt, max_tokens=k)


def test_stop_token_on_the_last_allowed_token_finishes_with_stop(async_scheduling: bool) -> None:
    prompt, cont, k = eos_prompt()
    params = {"max_tokens": 2, "stop_token_ids": [cont[1]], "ignore_eos": True}
    outputs = run_one(prompt, async_scheduling, **params)
    assert tokens_and_reason(outputs) == (cont[:2], "stop") == expected(prompt, **params)
    assert outputs[-1].stop_reason == cont[1]


def test_stop_rules_in_a_mixed_batch(async_scheduling: bool) -> None:
    prompt, cont, k = eos_prompt()
    cases = {
        "plain": {"max_tokens": 20},
        "ignore": {"max_tokens": k + 3, "ignore_eos": True},
        "min": {"max_tokens": k + 4, "min_tokens": k + 1},
        "stop": {"max_tokens": 20, "stop_token_ids": [cont[1]]},
        "short": {"max_tokens": 2},
    }
    eng = engine(async_scheduling=async_scheduling, max_num_batched_tokens=16)
    for rid, params in cases.items():
        eng.add_request(make_request(rid, prompt, **params))
    assert collect_outputs(eng) == {rid: expected(prompt, **p) for rid, p in cases.items()}
