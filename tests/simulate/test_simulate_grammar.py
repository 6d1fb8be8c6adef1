"""Grammar compiles as events on the virtual clock, and constrained requests in simulated
traffic: compile waits are measured compiles queued on `max_compile_workers` servers, the
cache shares them, the driver jumps to their completions, no compile thread runs, and the
token oracle emits only tokens the request's grammar allows."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from tandem.cli import main
from tandem.core import hookimpl
from tandem.core.clock import VirtualClock
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.plugin_manager import TandemPlugin, TandemPluginManager
from tandem.core.request import Request
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.grammar_tokens import GrammarTokens, allowed_tokens
from tandem.core.worker.step_shape import StepShape
from tandem.core.worker.token_oracle import TokenOracle
from tandem.schema.config import PluginSpec
from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.simulate.constrained import BUILTIN_SCHEMAS, SchemaPicker, load_schemas
from tandem.simulate.driver import SimulationResult, simulate
from tandem.simulate.plugin_events import IDLE_STEP_S
from tandem.simulate.traffic import TrafficRequest, generate, parse_traffic
from tandem.stack_file import load_config
from tandem.structured_output.backend import allocate_bitmask
from tandem.structured_output.compile_pool import CompilePool
from tandem.structured_output.manager import StructuredOutputManager
from tandem.structured_output.virtual_compile import VirtualCompilePool, timeout_instant

ROOT = Path(__file__).resolve().parents[2]
TAGGED = json.dumps(BUILTIN_SCHEMAS["tagged"])
PERSON = json.dumps(BUILTIN_SCHEMAS["person"])


class Spy(TandemPlugin):
    """Keeps the stack's grammar plugin and every request the engine took."""

    grammar: ClassVar[Any] = None
    requests: ClassVar[dict[str, Request]] = {}

    @hookimpl
    def tandem_stack_loaded(self, manager: TandemPluginManager) -> None:
        Spy.grammar = manager.plugins_with_role("grammar")[0]
        Spy.requests = {}

    @hookimpl
    def add_request(self, request: Request) -> None:
        Spy.requests[request.request_id] = request


class FixedCost(TandemPlugin):
    """Every step costs 1 ms per scheduled token."""

    @hookimpl
    def step_cost(self, step: StepShape) -> float:
        return 1e-3 * step.num_tokens


class HeldUntil(TandemPlugin):
    """Holds `sim-0` back until the clock reaches 0.05 s, announcing nothing."""

    @hookimpl
    def requests_not_ready(self) -> set[str] | None:
        return {"sim-0"} if self.clock.now() < 0.05 else None


def grammar_config(async_scheduling: bool = False, extra: tuple[str, ...] = (), **options: Any):  # noqa: ANN201
    grammar = {"name": "structured-output", "options": {"backend": "xgrammar"} | options}
    plugins = ["reference-scheduler", "default-sampler", grammar, f"{__name__}:Spy"]
    plugins += [f"{__name__}:FixedCost", *(f"{__name__}:{name}" for name in extra)]
    return load_config(
        model="scripted",
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        block_size=16,
        num_kv_blocks=256,
        async_scheduling=async_scheduling,
        plugins=plugins,
    )


def by_id(result: SimulationResult) -> dict[str, Any]:
    return {t.request_id: t for t in result.timelines}


def assert_documents_complete(request_ids: list[str]) -> None:
    """Each request's output is one JSON document with its schema's required keys."""
    tokenizer = Spy.grammar._tokenizer
    for rid in request_ids:
        request = Spy.requests[rid]
        text = tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        schema = request.sampling_params.structured_outputs.json
        # strict=False: xgrammar 0.2.9 lets a string with maxLength hold raw control
        # characters (the matcher accepted them), which strict JSON forbids.
        assert set(schema["required"]) <= set(json.loads(text, strict=False)), (rid, text)


def test_first_token_waits_for_the_measured_compile_and_the_clock_jumps_there() -> None:
    result = simulate(
        grammar_config(virtual_compile_scale=20.0),
        [TrafficRequest(0.25, 20, 30, json_schema=PERSON)],
    )
    pool = Spy.grammar.pool
    assert isinstance(pool, VirtualCompilePool) and pool.num_compiles == 1
    record = pool.records[0]
    assert record.compile_s > 0 and record.submitted_s == record.start_s == 0.25
    timeline = by_id(result)["sim-0"]
    assert timeline.token_times_s[0] >= 0.25 + record.compile_s
    assert timeline.scheduled_s == record.ready_at  # jumped to the completion, no polling
    assert timeline.finish_reason in ("stop", "length")


def test_a_cached_schema_costs_no_second_compile() -> None:
    traffic = [
        TrafficRequest(0.0, 20, 10, json_schema=TAGGED),
        TrafficRequest(0.0, 24, 10, json_schema=TAGGED),  # while the first compiles: shares it
        TrafficRequest(5.0, 28, 10, json_schema=TAGGED),  # long after: ready at once
    ]
    result = simulate(grammar_config(virtual_compile_scale=20.0), traffic)
    pool = Spy.grammar.pool
    assert pool.num_compiles == 1
    ready = pool.records[0].ready_at
    timelines = by_id(result)
    assert timelines["sim-0"].scheduled_s == timelines["sim-1"].scheduled_s == ready
    assert timelines["sim-2"].scheduled_s == 5.0  # not delayed by a compile


@pytest.mark.parametrize("workers", [1, 2])
def test_compile_workers_are_servers_of_a_queue_on_the_virtual_clock(workers: int) -> None:
    traffic = [
        TrafficRequest(0.0, 20, 10, json_schema=PERSON),
        TrafficRequest(0.0, 20, 10, json_schema=TAGGED),
    ]
    result = simulate(
        grammar_config(max_compile_workers=workers, virtual_compile_scale=20.0), traffic
    )
    first, second = Spy.grammar.pool.records
    assert first.start_s == 0.0
    timelines = by_id(result)
    if workers == 1:  # one after the other
        assert second.start_s == first.ready_at
        assert second.ready_at == first.ready_at + second.compile_s
        assert timelines["sim-1"].token_times_s[0] >= first.ready_at + second.compile_s
    else:  # side by side
        assert second.start_s == 0.0
    assert timelines["sim-1"].scheduled_s >= second.ready_at


def test_no_compile_thread_runs_on_the_virtual_clock() -> None:
    before = set(threading.enumerate())
    simulate(grammar_config(), generate(parse_traffic("poisson:rate=50,n=12,json=1"), 512))
    assert isinstance(Spy.grammar.pool, VirtualCompilePool)
    assert Spy.grammar.pool.num_compiles >= 2
    started = [t.name for t in set(threading.enumerate()) - before]
    assert not [name for name in started if name.startswith("tandem-grammar-")]


def test_a_compile_past_the_time_out_ends_its_request_at_the_time_out() -> None:
    traffic = [TrafficRequest(0.5, 20, 10, json_schema=PERSON), TrafficRequest(0.5, 20, 10)]
    result = simulate(grammar_config(compile_timeout_s=0.01, virtual_compile_scale=1e4), traffic)
    failed, other = by_id(result)["sim-0"], by_id(result)["sim-1"]
    assert Spy.grammar.pool.records[0].ready_at > 0.51  # the compile outlives the time-out
    assert failed.finish_reason == "error" and not failed.token_times_s
    assert failed.finish_s is not None and failed.finish_s >= timeout_instant(0.5, 0.01)
    assert other.finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_constrained_output_is_accepted_by_its_grammar(async_scheduling: bool) -> None:
    spec = parse_traffic("poisson:rate=40,n=40,prompt=uniform(16,64),output=80,json=0.5,seed=3")
    traffic = generate(spec, 512)
    result = simulate(grammar_config(async_scheduling, virtual_compile_scale=0.0), traffic)
    constrained = {f"sim-{i}" for i, t in enumerate(traffic) if t.json_schema is not None}
    assert 10 <= len(constrained) <= 30
    reasons = {t.request_id: t.finish_reason for t in result.timelines}
    assert all(reasons[rid] in ("stop", "length") for rid in constrained)
    assert all(reason == "length" for rid, reason in reasons.items() if rid not in constrained)
    stopped = [rid for rid in constrained if reasons[rid] == "stop"]
    assert len(stopped) >= len(constrained) // 2  # most grammars end within 80 tokens
    assert_documents_complete(stopped)
    manager = Spy.grammar
    if async_scheduling:  # constrained steps defer sampling one step under async
        assert manager.num_deferred_steps > 0
    else:
        assert manager.num_deferred_steps == 0


def test_a_plugin_that_announces_nothing_is_polled_not_jumped_over() -> None:
    """A compile announces its end (long after 0.05 s); `HeldUntil` announces nothing, so
    the driver polls and starts sim-0 right after 0.05 s instead of jumping to the compile."""
    result = simulate(
        grammar_config(extra=("HeldUntil",), virtual_compile_scale=500.0, compile_timeout_s=1e4),
        [TrafficRequest(0.0, 20, 5), TrafficRequest(0.0, 20, 5, json_schema=TAGGED)],
    )
    ready = Spy.grammar.pool.records[0].ready_at
    assert ready > 0.05 + 2 * IDLE_STEP_S
    held, compiled = by_id(result)["sim-0"], by_id(result)["sim-1"]
    assert held.scheduled_s is not None and 0.05 <= held.scheduled_s < 0.05 + 2 * IDLE_STEP_S
    assert compiled.scheduled_s is not None and compiled.scheduled_s >= ready


def test_the_manager_keeps_its_thread_pool_on_the_wall_clock() -> None:
    config = load_config(model="scripted")
    options = StructuredOutputManager.Options(max_compile_workers=3, cache_size=7)
    wall = StructuredOutputManager(config, options)
    wall.tandem_stack_loaded(manager=None)
    assert isinstance(wall.pool, CompilePool) and wall.next_event_time() is None
    virtual = StructuredOutputManager(config, options)
    virtual.clock = VirtualClock()
    virtual.tandem_stack_loaded(manager=None)
    assert isinstance(virtual.pool, VirtualCompilePool)
    assert (virtual.pool.max_workers, virtual.pool.cache_size) == (3, 7)


class Failing:
    name = "failing"

    def compile(self, spec: Any) -> None:
        raise ValueError("no such grammar")


def test_a_compile_error_is_reported_when_the_compile_would_have_ended() -> None:
    clock = VirtualClock(1.0)
    pool = VirtualCompilePool(clock, 1, 4, scale=1.0)
    future = pool.submit(Failing(), StructuredOutputsParams(regex="a+"))
    assert future.ready_at > 1.0 and not future.done()  # the failed compile's own time
    clock.advance_to(future.ready_at)
    assert future.done() and "no such grammar" in str(future.exception())
    assert pool.submit(Failing(), StructuredOutputsParams(regex="a+")) is future  # cached


# --- the token choice -------------------------------------------------------------------


def bitmask_allowing(rows: list[set[int]], vocab: int) -> torch.Tensor:
    """The int32 bitmask allowing exactly `rows[i]` in row i (bits packed as xgrammar's)."""
    width = allocate_bitmask(1, vocab).shape[1]
    bits = torch.zeros(len(rows), width * 32, dtype=torch.int64)
    for row, ids in enumerate(rows):
        bits[row, list(ids)] = 1
    words = (bits.view(len(rows), width, 32) << torch.arange(32)).sum(-1)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


def test_choices_are_allowed_and_eos_only_when_nothing_else_is() -> None:
    vocab, eos = 100, 2
    rows = [{5, 40, 2}, {2}, {63, 64, 99}, set()]
    bitmask = bitmask_allowing(rows, vocab)
    assert [
        set(r.nonzero().squeeze(1).tolist())
        for r in allowed_tokens(bitmask, torch.arange(4), vocab)
    ] == rows
    tokens = GrammarTokens(vocab, eos, seed=1)
    seen: set[int] = set()
    for _ in range(50):
        first, only_eos, third, empty = tokens.choose(bitmask, [0, 1, 2, 3])
        assert first in {5, 40} and only_eos == eos and third in {63, 64, 99} and empty == eos
        seen.add(first)
    assert seen == {5, 40}  # random among the allowed, seeded


def test_drafts_the_grammar_rejects_are_cut_from_the_oracles_answer() -> None:
    vocab, draft = 64, 2
    oracle = TokenOracle(draft, num_spec_tokens=2, acceptance_rate=1.0)
    oracle.computed, oracle.known = {"g": 9, "u": 9}, {"g": 10, "u": 10}
    step = SchedulerOutput(
        step_id=1,
        num_scheduled_tokens={"g": 3, "u": 3},
        total_num_scheduled_tokens=6,
        scheduled_spec_decode_tokens={"g": [draft, draft], "u": [draft, draft]},
        structured_output_request_ids=["g"],
    )
    output = oracle.step(step)
    assert output.sampled_token_ids == [[draft] * 3, [draft] * 3]  # both accepted all
    # g: row 0 allows the draft, row 1 does not: one draft kept, the bonus from row 1.
    bitmask = bitmask_allowing([{draft, 7}, {9}, {11}], vocab)
    GrammarTokens(vocab, eos_token_id=1).apply(output, step, bitmask, oracle)
    assert output.sampled_token_ids == [[draft, 9], [draft] * 3]
    assert output.num_rejected_drafts["g"] == 1
    assert (oracle.computed["g"], oracle.known["g"]) == (11, 12)
    assert (oracle.computed["u"], oracle.known["u"]) == (12, 13)
    with pytest.raises(ValueError, match="rows"):
        GrammarTokens(vocab, 1).apply(ModelRunnerOutput(), step, bitmask[:2], oracle)


# --- traffic ----------------------------------------------------------------------------


def test_json_traffic_keeps_the_shapes_and_constrains_about_the_fraction(tmp_path: Path) -> None:
    plain = generate(parse_traffic("gamma:rate=5,cv=2,n=400,prompt=uniform(8,64),seed=2"), 512)
    mixed = generate(
        parse_traffic("gamma:rate=5,cv=2,n=400,prompt=uniform(8,64),seed=2,json=0.25"), 512
    )
    assert [(t.arrival_s, t.prompt_tokens) for t in plain] == [
        (t.arrival_s, t.prompt_tokens) for t in mixed
    ]
    schemas = [t.json_schema for t in mixed if t.json_schema is not None]
    assert 70 <= len(schemas) <= 130 and len(set(schemas)) == len(BUILTIN_SCHEMAS)
    path = tmp_path / "schemas.json"
    path.write_text(json.dumps([{"type": "object"}, BUILTIN_SCHEMAS["flag"]]))
    spec = parse_traffic(f"closed:clients=2,n=10,json=1,schema={path}")
    assert spec.schema_path == str(path)
    picker = SchemaPicker.of(spec)
    assert {picker.apply(TrafficRequest(0.0, 1, 1)).json_schema for _ in range(40)} == set(
        load_schemas(path)
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("poisson:rate=1,n=3,json=1.5", "'json' must be a fraction"),
        ("poisson:rate=1,n=3,json=x", "'json' must be a fraction"),
        ("poisson:rate=1,n=3,schema=s.json", "'schema' needs 'json' > 0"),
    ],
)
def test_bad_json_traffic_names_the_key(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_traffic(text)


def test_a_bad_schema_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="bad.json must hold a JSON schema"):
        load_schemas(path)


def test_the_grammar_example_stack_runs_from_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    argv = ["simulate", "--stack", str(ROOT / "examples/simulate/grammar-async.yaml")]
    argv += ["--traffic", "poisson:rate=20,n=30,prompt=uniform(32,256),output=64,json=0.5"]
    argv += ["--device", "h100", "--max-model-len", "1024", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads(out.read_text())["stacks"]["grammar-async"]
    assert summary["completed"] == 30 and summary["failed"] == 0


def test_json_traffic_on_a_stack_without_a_grammar_plugin_is_a_clear_error() -> None:
    config = load_config(model="scripted", max_model_len=256, num_kv_blocks=64)
    with pytest.raises(ValueError, match="JSON schema .* no grammar plugin"):
        simulate(config, [TrafficRequest(0.0, 10, 5, json_schema=TAGGED)])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafts_of_constrained_requests_are_kept_only_while_the_grammar_allows(
    async_scheduling: bool,
) -> None:
    """The oracle's drafts (its fixed id) verified against grammar rows: a draft the grammar
    rejects is never accepted, so no constrained request ends in a grammar error."""
    base = grammar_config(async_scheduling, virtual_compile_scale=0.0)  # deterministic
    config = load_config(
        base,
        speculative={"method": "ngram", "num_speculative_tokens": 3},
        plugins=[*base.plugins[:2], PluginSpec(name="ngram-drafter"), *base.plugins[2:]],
    )
    traffic = generate(parse_traffic("poisson:rate=40,n=30,prompt=32,output=80,json=0.5"), 512)
    result = simulate(config, traffic, acceptance_rate=0.8)
    assert "error" not in [t.finish_reason for t in result.timelines]
    stopped = [
        t.request_id
        for t, r in zip(result.timelines, traffic, strict=True)
        if r.json_schema is not None and t.finish_reason == "stop"
    ]
    assert stopped
    assert_documents_complete(stopped)
    assert Spy.grammar.num_draft_rows > 0  # constrained requests did verify drafts
