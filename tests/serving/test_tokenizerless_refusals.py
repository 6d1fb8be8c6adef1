"""Fields that need the model's tokenizer are refused on a model without one, naming the
field, by every front door (before: `stop=["a"]` on the scripted model ran to `length`)."""

from __future__ import annotations

import asyncio

import pytest

from tandem import LLM
from tandem.engine import AsyncLLM
from tandem.schema.sampling_params import SamplingParams

NEEDS_TOKENIZER = [{"stop": ["a"]}, {"stop": "a"}, {"bad_words": ["a"]}]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(model="scripted", worker_num_threads=1)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("fields", NEEDS_TOKENIZER, ids=lambda f: next(iter(f)))
def test_llm_generate_refuses_fields_that_need_a_tokenizer(llm, fields) -> None:
    field = next(iter(fields))
    with pytest.raises(ValueError, match=rf"^{field}: needs the model's tokenizer"):
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, **fields), use_tqdm=False)
    # the engine is unharmed: the next request runs
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_async_llm_refuses_stop_strings_without_a_tokenizer() -> None:
    engine = AsyncLLM(model="scripted", worker_num_threads=1)

    async def main() -> None:
        with pytest.raises(ValueError, match=r"^stop: needs the model's tokenizer"):
            await anext(engine.generate([3, 4], SamplingParams(stop=["x"]), "r"))
        assert engine.num_unfinished() == 0

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
