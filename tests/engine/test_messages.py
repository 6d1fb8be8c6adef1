"""Typed messages (`tandem.core.messages`): every one round-trips exactly through MessagePack,
and the process executor's pipe carries them as bytes, never pickled objects."""

from __future__ import annotations

from multiprocessing.connection import Connection

import msgspec
import pytest
import torch

from tandem.core.messages import (
    ExecuteModel,
    FromWorker,
    SampleTokens,
    Shutdown,
    TensorData,
    ToWorker,
    WorkerError,
    WorkerReply,
    decoder,
    encode,
)
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.outputs import EngineCoreOutput
from tandem.core.request import Request
from tandem.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tandem.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    FromEngineCore,
    ToEngineCore,
)
from tandem.schema.sampling_params import RequestOutputKind, SamplingParams
from tandem.testing import collect_outputs, make_request, make_scripted_engine

PARAMS = SamplingParams(
    n=2,
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    seed=2**64 - 1,
    max_tokens=33,
    min_tokens=2,
    stop=["\n\n", "end"],
    stop_token_ids=[7, 9],
    presence_penalty=0.5,
    repetition_penalty=1.2,
    logprobs=3,
    bad_words_token_ids=[[4, 5]],
    logit_bias={11: -3.5, 12: 100.0},
    allowed_token_ids=[1, 2, 3, 11, 12],
    structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    output_kind=RequestOutputKind.DELTA,
)


def roundtrip(message: object, channel: object) -> object:
    data = encode(message)
    assert isinstance(data, bytes)
    return decoder(channel).decode(data)


def scheduler_output(batch: int = 64) -> SchedulerOutput:
    new = [
        NewRequestData(f"new-{i}", list(range(100, 140)), 30, PARAMS, [i, i + 64], 16, 2)
        for i in range(4)
    ]
    cached = [
        CachedRequestData(f"run-{i}", [200 + i] if i % 16 == 0 else [], 40 + i)
        for i in range(batch)
    ]
    return SchedulerOutput(
        step_id=7,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={c.req_id: 1 for c in cached} | {n.req_id: 14 for n in new},
        total_num_scheduled_tokens=batch + 56,
        scheduled_spec_decode_tokens={"run-0": [5, 6, 7]},
        num_spec_tokens_to_schedule=3,
        finished_req_ids={"gone-1", "gone-2"},
        preempted_req_ids={"run-63"},
        pending_structured_output_tokens=True,
        structured_output_request_ids=["new-0"],
    )


def test_execute_model_roundtrips_scheduler_output_and_sampling_params() -> None:
    message = ExecuteModel(scheduler_output())
    back = roundtrip(message, ToWorker)
    assert back == message
    params = back.scheduler_output.scheduled_new_reqs[0].sampling_params
    assert isinstance(params, SamplingParams) and params == PARAMS
    assert params.structured_outputs == PARAMS.structured_outputs
    assert isinstance(back.scheduler_output.finished_req_ids, set)


@pytest.mark.parametrize("shape", [(3, 5), (0, 4), (1,)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.bfloat16])
def test_tensors_travel_as_raw_bytes_shape_and_dtype(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    tensor = (torch.randn(shape) * 1000).to(dtype)
    back = roundtrip(SampleTokens(TensorData.of(tensor)), ToWorker)
    restored = back.grammar_bitmask.to_tensor()
    assert restored.dtype == dtype and restored.shape == tensor.shape
    assert torch.equal(restored, tensor)
    assert roundtrip(SampleTokens(), ToWorker) == SampleTokens(None)


def test_worker_replies_roundtrip_model_runner_output() -> None:
    output = ModelRunnerOutput(
        req_ids=["a", "b"],
        req_id_to_index={"a": 0, "b": 1},
        sampled_token_ids=[[3, 4], []],
        logprobs=[[{3: (-0.125, 1), 9: (-2.5, 2)}, {4: (-1e-9, 1)}], None],
        draft_token_ids={"a": [5, 6]},
        failed={"c": "sampling failed: boom"},
        prompt_logprobs={"a": [{1: (-0.5, 3)}]},
    )
    assert roundtrip(WorkerReply(output), FromWorker) == WorkerReply(output)
    assert roundtrip(WorkerReply(), FromWorker) == WorkerReply(None)
    assert roundtrip(WorkerError("Traceback..."), FromWorker) == WorkerError("Traceback...")
    assert roundtrip(Shutdown(), ToWorker) == Shutdown()


def test_front_end_messages_roundtrip() -> None:
    request = Request("r-1", [5, 6, 7], PARAMS, eos_token_id=2, arrival_time=12.5, priority=-3)
    back = roundtrip(AddRequest.of(request), ToEngineCore)
    rebuilt = back.to_request()
    for field in ("request_id", "prompt_token_ids", "sampling_params", "eos_token_id"):
        assert getattr(rebuilt, field) == getattr(request, field)
    assert (rebuilt.arrival_time, rebuilt.priority) == (12.5, -3)
    assert roundtrip(AbortRequests(["a", "b"]), ToEngineCore) == AbortRequests(["a", "b"])
    outputs = EngineCoreOutputs(
        [
            EngineCoreOutput("a", [1, 2], new_logprobs=[{1: (-0.5, 1)}, {2: (-0.25, 1)}]),
            EngineCoreOutput("b", [], finish_reason="stop", stop_reason="end"),
            EngineCoreOutput.ended("c", "error", "boom"),
        ]
    )
    assert roundtrip(outputs, FromEngineCore) == outputs


def test_a_channel_accepts_only_its_own_messages() -> None:
    with pytest.raises(msgspec.ValidationError):
        decoder(ToWorker).decode(encode(WorkerReply()))
    with pytest.raises(msgspec.ValidationError):
        decoder(FromWorker).decode(encode(Shutdown()))


def test_process_executor_sends_no_pickled_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Connection.send`/`recv` pickle; the executor only uses `send_bytes`/`recv_bytes`."""

    def pickled(*args: object, **kwargs: object) -> None:
        raise AssertionError("an object was pickled onto the worker pipe")

    monkeypatch.setattr(Connection, "send", pickled)
    monkeypatch.setattr(Connection, "recv", pickled)
    engine = make_scripted_engine(parallel={"executor": "process"}, async_scheduling=True)
    try:
        engine.add_request(make_request("r", [3, 4, 5], max_tokens=5, ignore_eos=True))
        assert len(collect_outputs(engine)["r"][0]) == 5
    finally:
        engine.shutdown()
