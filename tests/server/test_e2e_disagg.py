"""`tandem serve --disaggregated`: a prefill server and a decode server (`kv-disagg`) behind
one proxy. With the official openai client, streaming and not, the pair's greedy tokens
equal a single engine's; the decode server loaded the prompts' blocks over the transport;
the API key is enforced; an error from the prefill side reaches the client."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import openai
import pytest

from tandem import LLM, SamplingParams
from tandem.server.disagg import child_argv, prefill_body
from tandem.testing.tiny_model import save_tiny_model
from tests.server.e2e_helpers import metric_values, running_server, token_ids

KEY = "disagg-key"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("disagg-e2e") / "llama")


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(5, 200) for _ in range(rng.randrange(40, 100))] for _ in range(3)]


def test_the_pair_serves_a_single_engines_tokens(tiny: Path) -> None:
    prompts = _prompts()
    single = LLM(model=str(tiny), worker_num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = single.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in outs]
    single.engine.shutdown()
    with running_server(str(tiny), "--disaggregated", "--api-key", KEY) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        got = []
        for prompt in prompts[:2]:
            out = client.completions.create(
                model=str(tiny), prompt=prompt, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            got.append(token_ids(out.choices[0]))
        stream = client.completions.create(
            model=str(tiny), prompt=prompts[2], max_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        got.append([t for chunk in stream for c in chunk.choices for t in token_ids(c)])
        assert got == expected
        loaded = metric_values(
            server.url, "tandem:kv_connector_loaded_tokens_total", 'tier="remote"'
        )
        assert sum(loaded) >= sum((len(p) - 1) // 16 * 16 for p in prompts) > 0
        # the key is enforced behind the proxy; a prefill-side error comes back as it is
        wrong = openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=str(tiny), prompt=[5, 6], max_tokens=2)
        bad = httpx.post(
            f"{server.base_url}/completions",
            json={"model": str(tiny), "prompt": [5, 6], "temperature": -3},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        assert bad.status_code == 400 and "temperature" in bad.text
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_the_children_get_the_flags_but_the_address() -> None:
    argv = ["m", "--host", "0.0.0.0", "--port=9000", "--disaggregated", "--kv-port", "7", "-x"]
    assert child_argv(argv) == ["m", "-x"]
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "n": 3, "min_tokens": 9}
    body["stream_options"] = {"include_usage": True}
    assert prefill_body(body) == {"prompt": "hi", "max_tokens": 1, "stream": False, "n": 1}
