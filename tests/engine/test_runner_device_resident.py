"""The runner under async scheduling keeps sampled ids on the device (spec: model runner).

Driven step by step with hand-built scheduler outputs on the scripted model, whose paged
"KV" stores every input token id, so the test can read back exactly which ids the runner
fed to the model:

- `sample_tokens` returns an `AsyncModelRunnerOutput`; the runner's input batch holds a
  `-1` placeholder and `prev_sampled_token_ids` the ids, on the device;
- the next step's input ids come from `prev_sampled_token_ids`: by one slice copy when the
  batch kept its order, by index scatter when it changed;
- the placeholder becomes the real id once the next step samples, and before sampling when
  a penalty needs the history (`update_async_output_token_ids`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.core.model_runner_output import AsyncModelRunnerOutput, ModelRunnerOutput
from tandem.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tandem.core.worker.model_runner import ModelRunner
from tandem.core.worker.worker import Worker
from tandem.schema.sampling_params import SamplingParams
from tandem.testing import scripted_config
from tandem.testing.scripted_model import ScriptedModel, scripted_next_token

VOCAB = 128
BLOCK = 4
PROMPTS = {"a": [3, 4, 5], "b": [9, 8, 7, 6, 5], "c": [11, 12]}
BLOCKS = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """CPU always; CUDA (copy stream, pinned host copy, event) when a GPU exists."""
    return request.param


def make_worker(async_scheduling: bool = True, device: str = "cpu") -> Worker:
    config = scripted_config(
        async_scheduling=async_scheduling,
        num_kv_blocks=16,
        block_size=BLOCK,
        vocab_size=VOCAB,
        max_model_len=64,
    )
    model = ScriptedModel(VOCAB, num_blocks=16, block_size=BLOCK, device=device)
    return Worker(config, model=model)


def new_req(req_id: str, **params: Any) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        token_ids=list(PROMPTS[req_id]),
        num_prompt_tokens=len(PROMPTS[req_id]),
        sampling_params=SamplingParams(temperature=0.0, **params),
        block_ids=list(BLOCKS[req_id]),
        num_computed_tokens=0,
    )


def kv_token(runner: ModelRunner, req_id: str, position: int) -> int:
    """The input id the model was fed at `position` of `req_id` (read from the scripted KV)."""
    block = BLOCKS[req_id][position // BLOCK]
    return int(runner.model.kv_cache[block * BLOCK + position % BLOCK])  # type: ignore[attr-defined]


def prefill(worker: Worker, req_ids: list[str], **params: Any) -> dict[str, int]:
    """Step 0: whole prompts; returns each request's first sampled token."""
    so = SchedulerOutput(
        step_id=0,
        scheduled_new_reqs=[new_req(r, **params) for r in req_ids],
        num_scheduled_tokens={r: len(PROMPTS[r]) for r in req_ids},
    )
    worker.execute_model(so)
    out = worker.sample_tokens(None)
    assert isinstance(out, AsyncModelRunnerOutput)
    resolved = out.get_output()
    return {r: resolved.sampled_token_ids[resolved.req_id_to_index[r]][0] for r in req_ids}


def decode(
    worker: Worker, step_id: int, positions: dict[str, int], new: list[str] = (), **kw: Any
) -> ModelRunnerOutput:
    so = SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=[new_req(r) for r in new],
        scheduled_cached_reqs=[
            CachedRequestData(req_id=r, new_block_ids=[], num_computed_tokens=p)
            for r, p in positions.items()
        ],
        num_scheduled_tokens={**{r: 1 for r in positions}, **{r: len(PROMPTS[r]) for r in new}},
        **kw,
    )
    worker.execute_model(so)
    out = worker.sample_tokens(None)
    assert isinstance(out, AsyncModelRunnerOutput)
    return out.get_output()


def test_sampled_ids_stay_on_device_with_placeholders(device: str) -> None:
    worker = make_worker(device=device)
    runner = worker.model_runner
    first = prefill(worker, ["a", "b"])
    for r in ("a", "b"):
        assert first[r] == scripted_next_token(PROMPTS[r], VOCAB)
        assert runner.input_batch.token_ids_of(r) == [*PROMPTS[r], -1]
    assert runner.device_outputs.prev_req_id_to_index == {"a": 0, "b": 1}
    prev_sampled = runner.device_outputs.prev_sampled_token_ids
    assert prev_sampled is not None
    assert prev_sampled[:, 0].tolist() == [first["a"], first["b"]]


def test_unchanged_batch_takes_its_inputs_from_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = make_worker()
    runner = worker.model_runner
    first = prefill(worker, ["a", "b"])
    index_copies: list[int] = []
    original = torch.Tensor.index_copy_
    monkeypatch.setattr(
        torch.Tensor,
        "index_copy_",
        lambda self, *a: index_copies.append(1) or original(self, *a),
    )
    out = decode(worker, 1, {"a": 3, "b": 5})
    # The scripted model stored the ids it was fed: the real first tokens, not -1.
    assert kv_token(runner, "a", 3) == first["a"]
    assert kv_token(runner, "b", 5) == first["b"]
    for r in ("a", "b"):
        want = scripted_next_token([*PROMPTS[r], first[r]], VOCAB)
        assert out.sampled_token_ids[out.req_id_to_index[r]] == [want]
        # The previous placeholder is resolved, the new one pending.
        assert runner.input_batch.token_ids_of(r) == [*PROMPTS[r], first[r], -1]
    # Slice-copy path: the only index_copy_ calls are the scripted model's KV writes.
    assert len(index_copies) == 1


def test_changed_batch_scatters_the_previous_ids(device: str) -> None:
    worker = make_worker(device=device)
    runner = worker.model_runner
    first = prefill(worker, ["a", "b"])
    # `a` finished; `b` decodes next to a new request `c`: b's previous row (1) no longer
    # matches its flat position, so the ids are scattered.
    out = decode(worker, 1, {"b": 5}, new=["c"], finished_req_ids={"a"})
    assert kv_token(runner, "b", 5) == first["b"]
    assert "a" not in runner.input_batch.req_id_to_row
    assert out.sampled_token_ids[out.req_id_to_index["b"]] == [
        scripted_next_token([*PROMPTS["b"], first["b"]], VOCAB)
    ]
    assert out.sampled_token_ids[out.req_id_to_index["c"]] == [
        scripted_next_token(PROMPTS["c"], VOCAB)
    ]


def test_penalties_see_real_ids_before_sampling(device: str) -> None:
    worker = make_worker(device=device)
    runner = worker.model_runner
    first = prefill(worker, ["a"], presence_penalty=0.5)
    seen: list[list[list[int]]] = []
    sample = runner.hooks.sample

    def spy(*, logits: torch.Tensor, metadata: Any) -> Any:
        seen.append([list(h) for h in metadata.output_token_ids])
        return sample(logits=logits, metadata=metadata)

    runner.hooks = type("Hooks", (), {"sample": staticmethod(spy), "propose_drafts": None})()
    decode(worker, 1, {"a": 3})
    assert seen == [[[first["a"]]]]  # the placeholder was resolved before the sampler ran


def test_sync_runner_returns_host_outputs() -> None:
    worker = make_worker(async_scheduling=False)
    so = SchedulerOutput(
        step_id=0, scheduled_new_reqs=[new_req("a")], num_scheduled_tokens={"a": 3}
    )
    worker.execute_model(so)
    out = worker.sample_tokens(None)
    assert isinstance(out, ModelRunnerOutput)
    assert worker.model_runner.input_batch.token_ids_of("a")[-1] == out.sampled_token_ids[0][0] >= 0
    assert worker.model_runner.device_outputs is None
