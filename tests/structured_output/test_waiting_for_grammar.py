"""The scheduling contract: a request whose grammar is still compiling (a plugin reports it
in `requests_not_ready`) stays in WAITING, keeps its place and does not block the requests
behind it; it runs once ready. On the scripted model (no grammar plugin) a constrained
request is a clear per-request error."""

from __future__ import annotations

import pytest

from tandem.core import hookimpl
from tandem.core.request import RequestStatus
from tandem.schema.request_checks import RequestRejectedError
from tandem.testing import collect_outputs, make_request, make_scripted_engine
from tandem.testing.engine import expected_scripted_output

PROMPTS = {"a": [3, 4, 5], "b": [7, 8, 9, 10], "c": [11, 12]}


class Compiling:
    """A readiness plugin: the requests in `ids` are still compiling."""

    def __init__(self, *ids: str) -> None:
        self.ids = set(ids)

    @hookimpl
    def requests_not_ready(self) -> set[str]:
        return self.ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_compiling_request_is_skipped_not_blocking_then_runs(async_scheduling: bool) -> None:
    engine = make_scripted_engine(async_scheduling=async_scheduling, num_kv_blocks=64)
    compiling = Compiling("a")  # first in line, still compiling
    engine.plugin_manager.register(compiling)
    requests = {
        rid: make_request(rid, prompt, max_tokens=6, ignore_eos=True)
        for rid, prompt in PROMPTS.items()
    }
    for request in requests.values():
        engine.add_request(request)
    scheduled: list[set[str]] = []
    for _ in range(3):
        engine.step_fn()
        state = engine.scheduler_state
        assert requests["a"].status == RequestStatus.WAITING
        assert [r.request_id for r in state.waiting] == ["a"]  # kept its place
        scheduled.append({r.request_id for r in state.running})
    assert scheduled[0] == {"b", "c"}  # the requests behind it were not blocked
    compiling.ids.clear()
    outputs = collect_outputs(engine)
    params = requests["a"].sampling_params
    expected, _ = expected_scripted_output(PROMPTS["a"], params, 128, 1, 256)
    assert requests["a"].output_token_ids == expected
    assert all(reason == "length" for _, reason in outputs.values())


def test_skipped_requests_keep_their_order_behind_each_other() -> None:
    engine = make_scripted_engine(num_kv_blocks=64, max_num_seqs=1)
    requests = [make_request(rid, [5, 6], max_tokens=2, ignore_eos=True) for rid in "xyz"]
    engine.plugin_manager.register(Compiling("x", "y"))
    for request in requests:
        engine.add_request(request)
    engine.step_fn()
    state = engine.scheduler_state
    assert [r.request_id for r in state.running] == ["z"]
    assert [r.request_id for r in state.waiting] == ["x", "y"]


def test_scripted_model_rejects_a_constrained_request_clearly() -> None:
    engine = make_scripted_engine()
    with pytest.raises(RequestRejectedError, match="structured_outputs: .*no grammar backend"):
        engine.add_request(make_request("r", [1, 2], structured_outputs={"regex": "a+"}))
    engine.add_request(make_request("ok", [1, 2], max_tokens=3, ignore_eos=True))
    assert collect_outputs(engine)["ok"][1] == "length"
