"""The runner's persistent input batch (spec: model runner, DESIGN.md section 5).

- A step's flattened inputs are gathered from the persistent rows; they equal, field by
  field, the flattening of the same requests written as plain Python over lists (the
  specification of `FlatBatch`), for any mix of prefill chunks, decodes and drafts, with
  rows moved by holes, condensing and unscheduled requests.
- The worker keeps its own `num_computed_tokens`: advanced by what it executed, rolled
  back by the drafts it rejected. The scheduler's `CachedRequestData.num_computed_tokens`
  is checked against it, never adopted: equal under sync scheduling, under async at most
  the rejected drafts of the step the scheduler had not processed above it.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tandem.core.worker.draft_context import DraftContext
from tandem.core.worker.flat_batch import prepare_flat_batch
from tandem.core.worker.input_batch import InputBatch
from tandem.core.worker.model_runner import ModelRunner
from tandem.plugins.default_sampler import DefaultSampler
from tandem.schema.sampling_params import SamplingParams
from tandem.testing import scripted_config
from tandem.testing.scripted_model import ScriptedModel, scripted_next_token

VOCAB = 128
BLOCK = 4


# Flattening: the persistent batch against the list specification ------------------------------
def reference_flat_batch(
    token_ids: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    drafts: list[list[int]],
    block_ids: list[list[int]],
) -> dict[str, Any]:
    """Request r's input is `(token_ids[r] + drafts[r])[start : start + n]`; it samples
    when that reaches its last known token, at its last `1 + drafts in the window` rows."""
    flat: list[int] = []
    positions: list[int] = []
    logits: list[int] = []
    sampling: list[int] = []
    ks: list[int] = []
    draft_ids: list[int] = []
    offset = 0
    for r, (tokens, start, n, draft) in enumerate(
        zip(token_ids, num_computed, num_scheduled, drafts, strict=True)
    ):
        end, known = start + n, len(tokens)
        flat += (tokens + draft)[start:end]
        positions += range(start, end)
        if end >= known:
            k = end - known
            sampling.append(r)
            ks.append(k)
            draft_ids += draft[:k]
            logits += range(offset + n - 1 - k, offset + n)
        offset += n
    width = max([len(b) for b in block_ids] + [1])
    table = [b + [0] * (width - len(b)) for b in block_ids]
    req_of = [r for r, n in enumerate(num_scheduled) for _ in range(n)]
    slots = [
        table[r][p // BLOCK] * BLOCK + p % BLOCK for r, p in zip(req_of, positions, strict=True)
    ]
    starts = [0]
    for n in num_scheduled:
        starts.append(starts[-1] + n)
    return {
        "input_ids": flat,
        "positions": positions,
        "slot_mapping": slots,
        "query_start_loc": starts,
        "seq_lens": [s + n for s, n in zip(num_computed, num_scheduled, strict=True)],
        "block_tables": table,
        "logits_indices": logits,
        "sample_req_indices": sampling,
        "num_draft_tokens": ks,
        "draft_token_ids": draft_ids,
        "num_computed_tokens": list(num_computed),
    }


@st.composite
def steps(draw: st.DrawFn) -> dict[str, Any]:
    """Requests in a persistent batch (some removed before, some not scheduled) and one
    step over the scheduled ones: prefill chunks, decodes and decodes with drafts."""
    num_reqs = draw(st.integers(1, 6))
    requests = []
    next_block = 0
    for i in range(num_reqs):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14))
        outputs = draw(st.lists(st.integers(0, VOCAB - 1), max_size=4))
        tokens = prompt + outputs
        if draw(st.booleans()):  # a decode, maybe verifying drafts
            start = len(tokens) - 1
            drafts = draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))
            n = 1 + len(drafts)
        else:  # a prefill chunk, reaching the end or not
            start = draw(st.integers(0, len(tokens) - 1))
            drafts = []
            n = draw(st.integers(1, len(tokens) - start))
        num_blocks = -(-(start + n) // BLOCK) + draw(st.integers(0, 2))
        blocks = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        requests.append(
            {
                "id": f"r{i}",
                "tokens": tokens,
                "prompt": len(prompt),
                "start": start,
                "n": n,
                "drafts": drafts,
                "blocks": draw(st.permutations(blocks)),
                "scheduled": draw(st.booleans()) or i == 0,
            }
        )
    return {"requests": requests, "holes": draw(st.lists(st.integers(0, 8), max_size=3))}


@settings(max_examples=200, deadline=None)
@given(steps())
def test_flat_batch_from_persistent_rows_equals_the_list_specification(step: dict) -> None:
    batch = InputBatch(max_num_reqs=2, max_num_tokens=4)  # both grow on the way
    for h in range(9):  # requests that come and go leave holes to be filled and condensed
        batch.add(f"gone{h}", SamplingParams(), token_ids=[1, 2])
    for h in range(9):
        if h not in step["holes"]:
            batch.remove(f"gone{h}")
    for req in step["requests"]:
        batch.add(
            req["id"],
            SamplingParams(),
            token_ids=req["tokens"],
            num_prompt_tokens=req["prompt"],
            block_ids=req["blocks"][:1],
            num_computed_tokens=req["start"],
        )
        batch.block_table.append(batch.req_id_to_row[req["id"]], req["blocks"][1:])
    for h in step["holes"]:
        batch.remove(f"gone{h}")
    batch.condense()
    scheduled = sorted(
        (r for r in step["requests"] if r["scheduled"]),
        key=lambda r: batch.req_id_to_row[r["id"]],
    )
    flat = prepare_flat_batch(
        batch,
        [r["id"] for r in scheduled],
        [batch.req_id_to_row[r["id"]] for r in scheduled],
        [r["n"] for r in scheduled],
        {r["id"]: r["drafts"] for r in scheduled if r["drafts"]},
        BLOCK,
        torch.device("cpu"),
    )
    want = reference_flat_batch(
        [r["tokens"] for r in scheduled],
        [r["start"] for r in scheduled],
        [r["n"] for r in scheduled],
        [r["drafts"] for r in scheduled],
        [r["blocks"] for r in scheduled],
    )
    for name, value in want.items():
        got = getattr(flat, name)
        assert (got.tolist() if isinstance(got, torch.Tensor) else got) == value, name
    for r in step["requests"]:  # the batch advanced the scheduled rows' ledger only
        row = batch.req_id_to_row[r["id"]]
        expected = r["start"] + r["n"] if r["scheduled"] else r["start"]
        assert int(batch.num_computed_tokens[row]) == expected
        assert batch.token_ids_of(r["id"]) == r["tokens"]


# The ledger: the worker's own count, the scheduler's claim checked ------------------------------
class Hooks:
    """The worker's hooks: the default sampler, and a drafter proposing two wrong drafts."""

    def __init__(self) -> None:
        self.sampler = DefaultSampler(scripted_config(vocab_size=VOCAB), DefaultSampler.Options())

    def sample(self, **kwargs: Any) -> Any:
        return self.sampler.sample(**kwargs)

    def propose_drafts(self, *, context: DraftContext) -> list[list[int]]:
        return [[(scripted_next_token(h, VOCAB) + 1) % VOCAB, 0] for h in context.token_ids]


def make_runner(async_scheduling: bool, num_spec_tokens: int = 2) -> ModelRunner:
    model = ScriptedModel(VOCAB, num_blocks=16, block_size=BLOCK)
    return ModelRunner(model, Hooks(), BLOCK, num_spec_tokens, async_scheduling)


def kv_token(runner: ModelRunner, blocks: list[int], position: int) -> int:
    block = blocks[position // BLOCK]
    return int(runner.model.kv_cache[block * BLOCK + position % BLOCK])  # type: ignore[attr-defined]


def prefill(runner: ModelRunner, prompt: list[int], blocks: list[int]) -> Any:
    new = NewRequestData(
        req_id="a",
        token_ids=prompt,
        num_prompt_tokens=len(prompt),
        sampling_params=SamplingParams(temperature=0.0),
        block_ids=blocks,
        num_computed_tokens=0,
    )
    runner.execute_model(
        SchedulerOutput(step_id=0, scheduled_new_reqs=[new], num_scheduled_tokens={"a": 3})
    )
    return runner.sample_tokens(None)


def verify(runner: ModelRunner, step_id: int, claim: int, drafts: list[int]) -> Any:
    so = SchedulerOutput(
        step_id=step_id,
        scheduled_cached_reqs=[CachedRequestData("a", [], claim)],
        num_scheduled_tokens={"a": 1 + len(drafts)},
        scheduled_spec_decode_tokens={"a": drafts},
    )
    runner.execute_model(so)
    return runner.sample_tokens(None)


def test_the_worker_starts_at_its_own_count_whatever_the_claim() -> None:
    """The scheduler's `num_computed_tokens` is not read: a step starts at the worker's
    own count (3 after the prompt), even when the claim says otherwise."""
    runner = make_runner(async_scheduling=False, num_spec_tokens=0)
    first = prefill(runner, [3, 4, 5], [0, 1])
    assert int(runner.input_batch.num_computed_tokens[0]) == 3
    verify(runner, 1, claim=99, drafts=[])
    assert kv_token(runner, [0, 1], 3) == first.sampled_token_ids[0][0]
    assert int(runner.input_batch.num_computed_tokens[0]) == 4


def test_under_async_a_claim_may_exceed_the_count_by_the_drafts_rejected_in_flight() -> None:
    prompt, blocks = [3, 4, 5], [0, 1, 2]
    runner = make_runner(async_scheduling=True)
    first = prefill(runner, prompt, blocks)
    proposal = first.draft_token_ids["a"]  # reported under async too
    assert len(proposal) == 2 and proposal[0] != scripted_next_token(
        [*prompt, *first.sampled_token_ids[0]], VOCAB
    )
    # The scheduler holds `-1` placeholders; the worker verifies its proposal (both wrong).
    out = verify(runner, 1, claim=3, drafts=[-1, -1])
    assert [kv_token(runner, blocks, p) for p in (4, 5)] == proposal
    assert len(out.sampled_token_ids[0]) == 1
    assert int(runner.input_batch.num_computed_tokens[0]) == 4  # 3 + 3 - 2 rejected
    # The scheduler planned the next step before it learned of the rejections: 3 + 3.
    verify(runner, 2, claim=6, drafts=[-1, -1])
    assert kv_token(runner, blocks, 4) == out.sampled_token_ids[0][0]  # restarted at 4


def test_rejected_drafts_come_back_as_explicit_deltas() -> None:
    """Both drafts of the kept proposal are wrong: the output says 2 rejected, and the
    worker's own count has moved back by them (3 + 3 - 2)."""
    runner = make_runner(async_scheduling=True)
    prefill(runner, [3, 4, 5], [0, 1, 2])
    out = verify(runner, 1, claim=3, drafts=[-1, -1])
    assert out.num_rejected_drafts == {"a": 2}
    assert int(runner.input_batch.num_computed_tokens[0]) == 4


def test_preemption_drops_the_row_and_its_proposal() -> None:
    runner = make_runner(async_scheduling=True)
    prefill(runner, [3, 4, 5], [0, 1, 2])
    assert "a" in runner.drafts.proposals
    runner.execute_model(SchedulerOutput(step_id=1, preempted_req_ids={"a"}))
    runner.sample_tokens(None)
    assert "a" not in runner.drafts.proposals and "a" not in runner.input_batch.req_id_to_row
