"""Request identity in `AsyncLLM`: a client's `request_id` is a label; the engine runs every
sequence under an id the front end generated, so no label a client picks can make one
request receive another's tokens, state or finish.

Each request's prompt starts with a nonce (tokens no other request in the test has), and
its outputs must equal the scripted model's continuation of *its own* prompt."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tandem.engine import AsyncLLM
from tandem.schema.outputs import RequestOutput
from tandem.schema.sampling_params import RequestOutputKind, SamplingParams
from tandem.testing import expected_scripted_output

#: A deadline that turns a hang into a failure (never reached by a passing test).
HANG_S = 120.0


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLM]:
    eng = AsyncLLM(model="scripted", worker_num_threads=1, max_num_seqs=16)
    try:
        yield eng
    finally:
        eng.shutdown()


def nonce_prompt(nonce: int) -> list[int]:
    """A prompt no other nonce shares (two base-50 digits, then a fixed tail)."""
    return [3 + nonce % 50, 3 + nonce // 50 % 50, 11, 20]


def expected(eng: AsyncLLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    model = eng.config.model
    return expected_scripted_output(
        prompt, params, model.vocab_size, model.eos_token_id, eng.max_model_len
    )


async def run(
    eng: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str
) -> list[RequestOutput]:
    async def collect() -> list[RequestOutput]:
        return [out async for out in eng.generate(prompt, params, rid)]

    return await asyncio.wait_for(collect(), HANG_S)


def tokens(outs: list[RequestOutput], index: int = 0) -> list[int]:
    """The concatenated DELTA tokens of sequence `index`."""
    return [t for o in outs for c in o.outputs if c.index == index for t in c.token_ids]


def params(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, n=n, output_kind=RequestOutputKind.DELTA
    )


@pytest.mark.parametrize("child_first", [True, False], ids=["child-shape-first", "parent-first"])
def test_a_label_shaped_like_a_child_sequence_does_not_collide(engine, child_first) -> None:
    """Before: `n=2` request `r` ran sequences `0_r`, `1_r`, so a request labelled `0_r`
    collided with one of them: one hung and the other got the other prompt's tokens."""
    parent_prompt, child_prompt = nonce_prompt(1), nonce_prompt(2)

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        two = run(engine, parent_prompt, params(8, n=2), "r")
        lone = run(engine, child_prompt, params(8), "0_r")
        if child_first:
            lone_outs, two_outs = await asyncio.gather(lone, two)
        else:
            two_outs, lone_outs = await asyncio.gather(two, lone)
        return two_outs, lone_outs

    two_outs, lone_outs = asyncio.run(main())
    want_parent = expected(engine, parent_prompt, params(8))[0]
    assert tokens(two_outs, 0) == tokens(two_outs, 1) == want_parent
    assert tokens(lone_outs) == expected(engine, child_prompt, params(8))[0]
    assert {o.request_id for o in two_outs} == {"r"}
    assert {o.request_id for o in lone_outs} == {"0_r"}
    assert lone_outs[-1].finished and lone_outs[-1].outputs[0].finish_reason == "length"


def test_a_label_reused_right_after_aclose_gets_only_its_own_tokens(engine) -> None:
    """Before: in 30/30 trials the new request errored ("already in the engine"), got the
    old request's tokens, or got the old request's abort."""

    async def trial(i: int) -> None:
        old_prompt, new_prompt = nonce_prompt(100 + 2 * i), nonce_prompt(101 + 2 * i)
        stream = engine.generate(old_prompt, params(200), "again")
        first = await asyncio.wait_for(anext(stream), HANG_S)
        assert first.outputs[0].token_ids  # the old request is running
        await stream.aclose()
        outs = await run(engine, new_prompt, params(6), "again")
        want_tokens, want_reason = expected(engine, new_prompt, params(6))
        assert tokens(outs) == want_tokens, f"trial {i}"
        final = outs[-1]
        assert final.finished and final.outputs[0].finish_reason == want_reason, f"trial {i}"
        assert final.prompt_token_ids == new_prompt and final.error is None

    async def main() -> None:
        for i in range(30):
            await trial(i)

    asyncio.run(main())


def test_duplicate_labels_in_flight_each_get_their_own_output(engine) -> None:
    prompts = [nonce_prompt(300 + i) for i in range(6)]

    async def main() -> list[list[RequestOutput]]:
        return list(await asyncio.gather(*(run(engine, p, params(10), "same") for p in prompts)))

    for prompt, outs in zip(prompts, asyncio.run(main()), strict=True):
        assert tokens(outs) == expected(engine, prompt, params(10))[0]
        assert all(o.request_id == "same" and o.prompt_token_ids == prompt for o in outs)


def test_abort_by_label_ends_every_request_under_it_and_no_other(engine) -> None:
    async def main() -> None:
        started = [asyncio.Event() for _ in range(2)]

        async def consume(i: int) -> list[RequestOutput] | str:
            outs: list[RequestOutput] = []
            try:
                async for out in engine.generate(nonce_prompt(400 + i), params(300), "x"):
                    outs.append(out)
                    started[i].set()
                return outs
            except asyncio.CancelledError as exc:
                if "aborted" in str(exc):
                    return "aborted"
                raise

        doomed = [asyncio.ensure_future(consume(i)) for i in range(2)]
        other_prompt = nonce_prompt(410)
        other = asyncio.ensure_future(run(engine, other_prompt, params(12), "y"))
        # both doomed requests in flight (the short one may already have finished)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), HANG_S)
        await engine.abort("x")
        assert await asyncio.wait_for(asyncio.gather(*doomed), HANG_S) == ["aborted"] * 2
        outs = await other
        assert tokens(outs) == expected(engine, other_prompt, params(12))[0]

    asyncio.run(main())


def test_request_id_must_be_a_string(engine) -> None:
    async def main() -> None:
        with pytest.raises(TypeError, match="request_id"):
            await anext(engine.generate([3, 4], params(2), 7))  # type: ignore[arg-type]

    asyncio.run(main())
