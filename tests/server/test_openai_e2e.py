"""End to end with the official `openai` client against a live `tandem serve scripted`
process on 127.0.0.1 (started and stopped by the module fixture): the routes, completions
streaming and not, n > 1, stop token ids, logprobs, seeded sampling, and chat refused on
a model without a tokenizer.

The scripted model takes token-id prompts only and is deterministic (its greedy rule is
`scripted_next_token`); with `ignore_eos` every request runs to `max_tokens`. The server
returns token ids (`token_ids`, `prompt_token_ids`) on a model without a tokenizer, as
vLLM's `return_token_ids` does. Chat on a model with a tokenizer: test_e2e_chat.py; the
streaming-load cases (64 clients, disconnects, a stalled reader): test_e2e_streams.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from e2e_helpers import (
    ServerProcess,
    assert_error_body,
    metric_values,
    post,
    running_server,
    sse_events,
    wait_idle,
)

from tandem.testing.scripted_model import scripted_next_token

VOCAB = 128
PROMPT = [5, 17, 42, 9]


def scripted_greedy(prompt: list[int], count: int) -> list[int]:
    """The scripted model's greedy continuation of `prompt`, `count` tokens."""
    history = list(prompt)
    for _ in range(count):
        history.append(scripted_next_token(history, VOCAB))
    return history[len(prompt) :]


def ids(choice: Any) -> list[int]:
    """A completion choice's `token_ids` (the server's extra field), which must be there."""
    extra = choice.model_extra or {}
    assert isinstance(extra.get("token_ids"), list), f"no token_ids in {choice}"
    return extra["token_ids"]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("scripted", "--max-num-seqs", "16") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60) as c:
        yield c


def complete(client: openai.OpenAI, **kw: Any) -> Any:
    """A completions call on the scripted model; `extra` fields go in the body."""
    extra = {"ignore_eos": True, **kw.pop("extra", {})}
    return client.completions.create(model="scripted", extra_body=extra, **kw)


# Routes ---------------------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["scripted"]
    card = models.data[0]
    assert card.object == "model" and card.owned_by
    assert (card.model_extra or {}).get("max_model_len") == 1024


def test_version_and_health(server: ServerProcess) -> None:
    from tandem import __version__

    version = httpx.get(f"{server.url}/version", timeout=5)
    assert version.status_code == 200 and version.json() == {"version": __version__}
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_metrics_show_the_tandem_names(server: ServerProcess, client: openai.OpenAI) -> None:
    complete(client, prompt=PROMPT, max_tokens=4, temperature=0)
    resp = httpx.get(f"{server.url}/metrics", timeout=5)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    for name in (
        "tandem:num_requests_running",
        "tandem:num_requests_waiting",
        "tandem:kv_cache_usage_perc",
        "tandem:prompt_tokens_total",
        "tandem:generation_tokens_total",
        "tandem:time_to_first_token_seconds_bucket",
        "tandem:inter_token_latency_seconds_bucket",
        "tandem:e2e_request_latency_seconds_bucket",
        "tandem:request_success_total",
    ):
        assert f"\n{name}{{" in resp.text, name
    assert sum(metric_values(server.url, "tandem:generation_tokens_total")) >= 4
    assert sum(metric_values(server.url, "tandem:prompt_tokens_total")) >= len(PROMPT)


def test_tokenize_and_detokenize_need_a_tokenizer(server: ServerProcess) -> None:
    """The scripted model has no tokenizer: both routes answer 400 naming the field, in
    vLLM's request shapes."""
    resp = post(server.url, "/tokenize", {"model": "scripted", "prompt": "hello"})
    assert assert_error_body(resp, 400, "tokenizer")["param"] == "prompt"
    resp = post(server.url, "/detokenize", {"model": "scripted", "tokens": [5, 6, 7]})
    assert assert_error_body(resp, 400, "tokenizer")["param"] == "tokens"
    resp = post(server.url, "/detokenize", {"model": "scripted", "tokens": "abc"})
    assert assert_error_body(resp, 400, "tokens")["param"] == "tokens"


# Completions ----------------------------------------------------------------------------


def test_completion_not_streaming(client: openai.OpenAI) -> None:
    out = complete(client, prompt=PROMPT, max_tokens=10, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == "scripted" and len(out.choices) == 1
    choice = out.choices[0]
    assert ids(choice) == scripted_greedy(PROMPT, 10)
    assert (choice.model_extra or {}).get("prompt_token_ids") == PROMPT
    assert choice.index == 0 and choice.finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (4, 10)
    assert out.usage.total_tokens == 14


def test_completion_streaming_with_the_openai_client(client: openai.OpenAI) -> None:
    stream = complete(
        client,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    tokens: list[int] = []
    finish: list[str | None] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == [] and usage is None
            usage = chunk.usage
            continue
        assert len(chunk.choices) == 1 and chunk.choices[0].index == 0
        tokens += ids(chunk.choices[0])
        finish.append(chunk.choices[0].finish_reason)
    assert tokens == scripted_greedy(PROMPT, 10)
    assert len(finish) >= 2 and finish[-1] == "length" and set(finish[:-1]) == {None}
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (4, 10)


def test_completion_sse_framing(server: ServerProcess) -> None:
    """vLLM's framing: one `data:` event per chunk, a usage chunk with empty choices when
    asked, then `data: [DONE]`; nothing after it."""
    body = {
        "model": "scripted",
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(resp.iter_lines()))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    *token_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    streamed = [t for c in token_chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == scripted_greedy(PROMPT, 6)
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_choices_are_indexed(client: openai.OpenAI) -> None:
    out = complete(client, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(len(ids(c)) == 6 and c.finish_reason == "length" for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 18
    stream = complete(client, prompt=PROMPT, max_tokens=6, n=3, temperature=0, stream=True)
    per_index: dict[int, list[int]] = {}
    finished: dict[int, str | None] = {}
    for chunk in stream:
        for choice in chunk.choices:
            per_index.setdefault(choice.index, []).extend(ids(choice))
            finished[choice.index] = choice.finish_reason
    greedy = scripted_greedy(PROMPT, 6)
    assert per_index == {0: greedy, 1: greedy, 2: greedy}
    assert finished == {0: "length", 1: "length", 2: "length"}


def test_a_batch_of_prompts_gets_choice_per_prompt(client: openai.OpenAI) -> None:
    prompts = [PROMPT, [9, 8, 7]]
    out = complete(client, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1]
    by_index = {c.index: ids(c) for c in out.choices}
    assert by_index == {i: scripted_greedy(p, 5) for i, p in enumerate(prompts)}


def test_stop_token_ids_end_the_output(client: openai.OpenAI) -> None:
    greedy = scripted_greedy(PROMPT, 20)
    at = next(i for i in range(3, 20) if greedy[i] not in greedy[:i])
    stop = greedy[at]
    out = complete(
        client, prompt=PROMPT, max_tokens=20, temperature=0, extra={"stop_token_ids": [stop]}
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert (choice.model_extra or {}).get("stop_reason") == stop
    got = ids(choice)
    assert got in (greedy[:at], greedy[: at + 1]), (got, greedy, at)


def test_logprobs_shapes(client: openai.OpenAI) -> None:
    out = complete(client, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    choice = out.choices[0]
    tokens = ids(choice)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert lp.tokens == [f"token_id:{t}" for t in tokens]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for sampled, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value is not None and -50 < value <= 0
        assert len(top) == 2 and sampled in top  # greedy: the sampled token is the top one
        assert top[sampled] == pytest.approx(value) and value == pytest.approx(max(top.values()))


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[int]:
        out = complete(client, prompt=PROMPT, max_tokens=32, temperature=1.0, seed=seed)
        return ids(out.choices[0])

    first, second = sample(7), sample(7)
    assert first == second and len(first) == 32
    other = sample(8)
    assert len(other) == 32  # a different seed may give other tokens
    greedy = scripted_greedy(PROMPT, 32)
    assert first != greedy or other != greedy, "temperature 1 never left the greedy path"


# Chat on a model without a tokenizer -----------------------------------------------------


def test_chat_on_a_model_without_tokenizer_is_400(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="scripted", messages=messages, stream=stream)
        assert info.value.status_code == 400
        body: Any = info.value.body
        assert body["param"] == "messages" and "tokenizer" in body["message"]
    out = complete(client, prompt=PROMPT, max_tokens=3, temperature=0)
    assert ids(out.choices[0]) == scripted_greedy(PROMPT, 3)


def test_unknown_fields_are_accepted_and_logged_once(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    for _ in range(2):
        out = complete(
            client, prompt=PROMPT, max_tokens=3, temperature=0, extra={"frobnicate_level": 3}
        )
        assert ids(out.choices[0]) == scripted_greedy(PROMPT, 3)
    assert server.log().count("frobnicate_level") == 1, server.log()


def test_top_k_top_p_min_p_reach_the_sampler(client: openai.OpenAI) -> None:
    """At temperature 1 each of these leaves only the most likely token (the scripted
    peak): the output is the greedy one, which plain temperature-1 sampling (seeded) is
    not."""
    greedy = scripted_greedy(PROMPT, 32)
    plain = complete(client, prompt=PROMPT, max_tokens=32, temperature=1.0, seed=7)
    assert ids(plain.choices[0]) != greedy
    knobs: list[dict[str, Any]] = [{"top_k": 1}, {"min_p": 1.0}]
    for extra in knobs:
        out = complete(client, prompt=PROMPT, max_tokens=32, temperature=1.0, seed=7, extra=extra)
        assert ids(out.choices[0]) == greedy, extra
    out = complete(client, prompt=PROMPT, max_tokens=32, temperature=1.0, seed=7, top_p=0.01)
    assert ids(out.choices[0]) == greedy


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_budget_line_and_idle_uses_next_to_no_cpu(server: ServerProcess, client) -> None:
    assert "compute threads 1 + 1*1 = 2 <=" in server.log()
    client.completions.create(model="scripted", prompt=[1, 2, 3], max_tokens=4)
    wait_idle(server.url)
    pids = [server.proc.pid, *server.engine_core_pids()]
    assert len(pids) == 2
    before = sum(cpu_seconds(p) for p in pids)
    time.sleep(3.0)
    used = sum(cpu_seconds(p) for p in pids) - before
    assert used < 0.3, f"idle server and engine core used {used:.2f} s of CPU in 3 s"
