"""The traffic generator of `tandem simulate`: arrivals, lengths, the CLI spec, trace files,
closed-loop clients and prompt token ids. Every draw is seeded, so the statistical checks are
deterministic (the tolerances hold for these seeds, with room to spare)."""

from __future__ import annotations

import json
import math
import random
import statistics
from itertools import pairwise
from pathlib import Path

import pytest

from tandem.simulate.traffic import (
    ClosedLoopClients,
    LengthDist,
    TrafficRequest,
    TrafficSpec,
    gamma_arrivals,
    generate,
    load_trace,
    parse_traffic,
    poisson_arrivals,
    prompt_token_ids,
)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in pairwise([0.0, *times])]


def _cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


# --- arrivals ---------------------------------------------------------------------------


def test_poisson_arrivals_have_mean_gap_one_over_rate() -> None:
    times = poisson_arrivals(20.0, 20_000, random.Random(7))
    assert len(times) == 20_000
    assert times[0] > 0.0  # the first arrival is at the first gap, not at 0
    assert all(a <= b for a, b in pairwise(times))
    gaps = _gaps(times)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.03)
    assert _cv(gaps) == pytest.approx(1.0, rel=0.05)  # exponential gaps


def test_poisson_infinite_rate_is_a_burst_at_zero() -> None:
    assert poisson_arrivals(math.inf, 5, random.Random(0)) == [0.0] * 5


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_arrivals_have_the_requested_mean_and_cv(cv: float) -> None:
    gaps = _gaps(gamma_arrivals(5.0, cv, 20_000, random.Random(3)))
    assert statistics.fmean(gaps) == pytest.approx(1 / 5.0, rel=0.08)
    assert _cv(gaps) == pytest.approx(cv, rel=0.1)


@pytest.mark.parametrize("rate, cv", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (math.nan, 1.0)])
def test_arrivals_reject_bad_parameters(rate: float, cv: float) -> None:
    with pytest.raises(ValueError):
        gamma_arrivals(rate, cv, 3, random.Random(0))


# --- the CLI spec -----------------------------------------------------------------------


def test_parse_the_documented_examples() -> None:
    spec = parse_traffic("poisson:rate=20,n=1000,prompt=512,output=128")
    assert (spec.kind, spec.rate, spec.num_requests) == ("poisson", 20.0, 1000)
    assert spec.prompt == LengthDist("fixed", 512) and spec.output == LengthDist("fixed", 128)
    spec = parse_traffic(
        "gamma:rate=5,cv=3,duration=3600,prompt=lognormal(1024,0.8),output=uniform(32,256),"
        "prefix_groups=8,prefix=256,seed=1"
    )
    assert (spec.rate, spec.cv, spec.duration_s, spec.num_requests) == (5.0, 3.0, 3600.0, None)
    assert (spec.prompt.kind, spec.prompt.mean, spec.prompt.sigma) == ("lognormal", 1024, 0.8)
    assert (spec.output.kind, spec.output.low, spec.output.high) == ("uniform", 32, 256)
    assert (spec.prefix_groups, spec.prefix_tokens, spec.seed) == (8, 256, 1)
    spec = parse_traffic("trace:path=azure_conv.csv,time_scale=0.5,n=5000")
    assert (spec.path, spec.time_scale, spec.num_requests) == ("azure_conv.csv", 0.5, 5000)
    spec = parse_traffic("closed:clients=16,think=0.5,n=500,prompt=256,output=64")
    assert (spec.clients, spec.think_s, spec.num_requests) == (16, 0.5, 500)
    assert parse_traffic("poisson:rate=inf,n=4").rate == math.inf
    assert parse_traffic("poisson: rate = 2 , n = 3 , priorities = 4").priorities == 4


@pytest.mark.parametrize(
    "text, named",
    [
        ("poisson:rate=abc,n=5", "'rate'"),
        ("poisson:rate=0,n=5", "'rate'"),
        ("poisson:rate=-2,n=5", "'rate'"),
        ("poisson:n=5", "'rate'"),
        ("gamma:rate=2,cv=0,n=5", "'cv'"),
        ("gamma:rate=2,cv=x,n=5", "'cv'"),
        ("poisson:rate=2", "'n'"),
        ("poisson:rate=2,n=1.5", "'n'"),
        ("poisson:rate=2,n=5,prompt=lots", "'prompt'"),
        ("poisson:rate=2,n=5,output=uniform(300,30)", "'output'"),
        ("poisson:rate=2,n=5,prompt=lognormal(100)", "'prompt'"),
        ("poisson:rate=2,n=5,speed=3", "'speed'"),
        ("poisson:rate=2,n=5,cv=3", "'cv'"),  # cv does not apply to poisson
        ("poisson:rate=2,n=5,n=6", "'n'"),
        ("poisson:rate=2,n=5,prefix_groups=4", "'prefix'"),
        ("closed:n=5", "'clients'"),
        ("closed:clients=2,n=5,think=-1", "'think'"),
        ("trace:n=5", "'path'"),
        ("trace:path=a.csv,time_scale=0", "'time_scale'"),
        ("uniform:rate=2,n=5", "'uniform'"),
    ],
)
def test_parse_errors_name_the_key(text: str, named: str) -> None:
    with pytest.raises(ValueError, match="traffic: ") as info:
        parse_traffic(text)
    assert named in str(info.value)


def test_parse_error_says_what_was_expected() -> None:
    with pytest.raises(ValueError) as info:
        parse_traffic("poisson:rate=abc,n=5")
    assert str(info.value) == "traffic: 'rate' must be a positive number (requests/s), got 'abc'"


# --- synthetic requests -----------------------------------------------------------------

BURSTY = "gamma:rate=5,cv=3,n=2000,prompt=lognormal(600,0.8),output=uniform(32,256),seed=4"


def test_generate_is_deterministic_per_seed() -> None:
    spec = parse_traffic(BURSTY)
    first = generate(spec, 4096)
    assert first == generate(spec, 4096)
    other = generate(parse_traffic(BURSTY.replace("seed=4", "seed=5")), 4096)
    assert [r.arrival_s for r in first] != [r.arrival_s for r in other]
    assert [r.prompt_tokens for r in first] != [r.prompt_tokens for r in other]


def test_one_seed_gives_the_same_shapes_at_every_rate() -> None:
    slow = generate(parse_traffic(BURSTY), 4096)
    fast = generate(parse_traffic(BURSTY.replace("rate=5", "rate=50")), 4096)
    assert [(r.prompt_tokens, r.output_tokens) for r in slow] == [
        (r.prompt_tokens, r.output_tokens) for r in fast
    ]
    assert fast[-1].arrival_s < slow[-1].arrival_s


def test_lengths_stay_in_their_bounds_and_fit_the_model() -> None:
    requests = generate(parse_traffic(BURSTY), 1024)
    assert len(requests) == 2000
    assert all(a.arrival_s <= b.arrival_s for a, b in pairwise(requests))
    assert all(r.prompt_tokens + r.output_tokens <= 1024 for r in requests)
    assert all(r.prompt_tokens >= 1 and 1 <= r.output_tokens <= 256 for r in requests)
    unclamped = [r for r in requests if r.prompt_tokens + 256 <= 1024]
    assert all(r.output_tokens >= 32 for r in unclamped)
    assert any(r.prompt_tokens + r.output_tokens == 1024 for r in requests)  # some clamped


def test_lognormal_lengths_have_the_requested_mean() -> None:
    dist = LengthDist("lognormal", 1000, sigma=0.8)
    rng = random.Random(11)
    draws = [dist.draw(rng, 10**9) for _ in range(20_000)]
    assert statistics.fmean(draws) == pytest.approx(1000, rel=0.05)
    assert statistics.pstdev([math.log(d) for d in draws]) == pytest.approx(0.8, rel=0.05)


@pytest.mark.parametrize(
    "dist",
    [
        LengthDist("fixed", 500),
        LengthDist("uniform", 50, low=1, high=100),
        LengthDist("uniform", 50, low=60, high=0),
        LengthDist("lognormal", 40, sigma=2.0),
        LengthDist("lognormal", 40, high=45, sigma=1.0),
    ],
)
def test_length_draws_are_within_one_and_max_len(dist: LengthDist) -> None:
    rng = random.Random(2)
    draws = [dist.draw(rng, 50) for _ in range(2000)]
    assert min(draws) >= 1 and max(draws) <= min(50, dist.high or 50)


def test_output_is_clamped_before_the_prompt() -> None:
    def shape(prompt: int, output: int) -> tuple[int, int]:
        text = f"poisson:rate=1,n=1,prompt={prompt},output={output}"
        (request,) = generate(parse_traffic(text), 1000)
        return request.prompt_tokens, request.output_tokens

    assert shape(900, 300) == (900, 100)
    assert shape(1500, 300) == (999, 1)
    assert shape(100, 200) == (100, 200)


def test_duration_bounds_the_arrivals() -> None:
    timed = generate(parse_traffic("poisson:rate=10,duration=100,seed=2"), 2048)
    assert 900 <= len(timed) <= 1100
    assert timed[-1].arrival_s <= 100.0
    counted = generate(parse_traffic(f"poisson:rate=10,n={len(timed)},seed=2"), 2048)
    assert counted == timed  # the same process, cut by time instead of by count
    both = generate(parse_traffic("poisson:rate=10,duration=100,n=50,seed=2"), 2048)
    assert both == timed[:50]


def test_priorities_and_prefix_groups_are_drawn_in_range() -> None:
    text = "poisson:rate=10,n=3000,prompt=uniform(1,400),priorities=3,prefix_groups=4,prefix=100"
    requests = generate(parse_traffic(text), 4096)
    assert {r.priority for r in requests} == {0, 1, 2}
    assert {r.prefix_group for r in requests} == {0, 1, 2, 3}
    assert all(r.prefix_tokens == min(100, r.prompt_tokens - 1) for r in requests)


def test_closed_specs_are_not_lists() -> None:
    with pytest.raises(ValueError, match="ClosedLoopClients"):
        generate(parse_traffic("closed:clients=2,n=4"), 1024)


def test_requests_check_their_invariants() -> None:
    with pytest.raises(ValueError):
        TrafficRequest(0.0, 0, 5)
    with pytest.raises(ValueError):
        TrafficRequest(-1.0, 5, 5)
    with pytest.raises(ValueError):
        TrafficRequest(0.0, 5, 5, prefix_group=1, prefix_tokens=6)
    with pytest.raises(ValueError):
        TrafficRequest(0.0, 5, 5, prefix_tokens=2)  # a prefix needs a group


# --- prompt token ids -------------------------------------------------------------------


def test_prompt_ids_share_the_group_prefix_and_differ_after_it() -> None:
    a = TrafficRequest(0.0, 300, 8, prefix_group=1, prefix_tokens=200)
    b = TrafficRequest(1.0, 250, 8, prefix_group=1, prefix_tokens=200)
    c = TrafficRequest(2.0, 300, 8, prefix_group=2, prefix_tokens=200)
    short = TrafficRequest(3.0, 60, 8, prefix_group=1, prefix_tokens=59)  # a clamped prefix
    ids = [prompt_token_ids(r, i, 32_000, seed=3) for i, r in enumerate([a, b, c, short])]
    assert [len(x) for x in ids] == [300, 250, 300, 60]
    assert all(0 <= t < 32_000 for x in ids for t in x)
    assert ids[0][:200] == ids[1][:200]
    assert ids[0][200:250] != ids[1][200:250]
    assert ids[0][:200] != ids[2][:200]
    assert ids[3][:59] == ids[0][:59]
    assert ids[0] == prompt_token_ids(a, 0, 32_000, seed=3)  # deterministic
    assert ids[0] != prompt_token_ids(a, 0, 32_000, seed=4)


def test_prompt_ids_without_a_group_differ_per_index() -> None:
    request = TrafficRequest(0.0, 1000, 8)
    first, second = (prompt_token_ids(request, i, 151_936) for i in (0, 1))
    assert len(first) == 1000 and first != second
    assert max(first) < 151_936 and len(set(first)) > 900  # spread over the vocabulary
    assert set(prompt_token_ids(request, 0, 2)) == {0, 1}


# --- trace files ------------------------------------------------------------------------


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,4808,10
2023-11-16 18:15:50.9951690,3180,8
2023-11-16 18:15:47.1000000,0,12
2023-11-17 00:00:00.0000001,100,1
"""


def test_azure_trace_arrivals_and_lengths(tmp_path: Path) -> None:
    requests = load_trace(_write(tmp_path, "azure.csv", AZURE))
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == pytest.approx([0.0, 0.41941, 4.314579, 20653.3194101], abs=1e-6)
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [
        (4808, 10),
        (1, 12),  # a zero-length prompt becomes 1
        (3180, 8),
        (100, 1),
    ]
    scaled = load_trace(tmp_path / "azure.csv", time_scale=0.5, max_requests=3)
    assert [r.arrival_s for r in scaled] == pytest.approx([0.0, 0.209705, 2.1572895], abs=1e-6)


def test_azure_timestamps_with_zones(tmp_path: Path) -> None:
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10T02:00:00+02:00,5,5\n"
    text += "2024-05-10 00:00:01.5Z,6,6\n"
    requests = load_trace(_write(tmp_path, "zones.csv", text))
    assert [r.arrival_s for r in requests] == [0.0, 1.5]


BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
60.5,ChatGPT,0,9,9,Conversation log
"""


def test_burstgpt_trace_skips_failures(tmp_path: Path) -> None:
    requests = load_trace(_write(tmp_path, "burst.csv", BURSTGPT))
    assert [r.arrival_s for r in requests] == [0.0, 55.5, 113.0]
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [(472, 18), (1, 9), (417, 276)]


def test_tandem_trace_in_jsonl_and_csv(tmp_path: Path) -> None:
    rows = [
        {"arrival_s": 10.0, "prompt_tokens": 50, "output_tokens": 5, "priority": 1},
        {"arrival_s": 12.5, "prompt_tokens": 80, "output_tokens": 7, "prefix_group": 3,
         "prefix_tokens": 32},
    ]  # fmt: skip
    jsonl = _write(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    csv_text = "arrival_s,prompt_tokens,output_tokens,priority,prefix_group,prefix_tokens\n"
    csv_text += "10.0,50,5,1,,\n12.5,80,7,,3,32\n"
    expected = [TrafficRequest(0.0, 50, 5, 1), TrafficRequest(2.5, 80, 7, 0, 3, 32)]
    assert load_trace(jsonl) == expected
    assert load_trace(_write(tmp_path, "t.csv", csv_text)) == expected


@pytest.mark.parametrize(
    "name, text, line, column",
    [
        ("a.csv", AZURE.replace("3180", "abc"), 3, "ContextTokens"),
        ("b.csv", AZURE.replace(",12\n", ",\n"), 4, "GeneratedTokens"),
        ("c.csv", AZURE.replace("2023-11-17 00:00", "2023-13-17 00:00"), 5, "TIMESTAMP"),
        ("d.csv", BURSTGPT.replace("118,", "soon,"), 4, "Timestamp"),
        ("e.jsonl", '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n'
         '{"arrival_s": 1, "prompt_tokens": 5}\n', 2, "output_tokens"),
        ("f.csv", "arrival_s,prompt_tokens,output_tokens,prefix_tokens\n0,9,1,4\n", 2,
         "prefix_group"),
    ],
)  # fmt: skip
def test_a_bad_row_names_file_line_and_column(
    tmp_path: Path, name: str, text: str, line: int, column: str
) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(ValueError) as info:
        load_trace(path)
    assert f"{path}:{line}: column {column!r}" in str(info.value)


def test_an_unknown_layout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown trace layout"):
        load_trace(_write(tmp_path, "x.csv", "when,tokens\n1,2\n"))


def test_generate_replays_a_trace_within_the_model_length(tmp_path: Path) -> None:
    path = _write(tmp_path, "azure.csv", AZURE)
    spec = parse_traffic(f"trace:path={path},time_scale=2,n=3")
    requests = generate(spec, 4096)
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, 0.83882, 8.629158], abs=1e-6)
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [(4095, 1), (1, 12), (3180, 8)]
    assert len(generate(TrafficSpec("trace", path=str(path), duration_s=1.0), 4096)) == 2


# --- closed loop ------------------------------------------------------------------------


def _run_closed(spec: TrafficSpec, service_s: float) -> list[tuple[float, TrafficRequest]]:
    """Drive the clients with a fixed service time: (finish time, next request) pairs."""
    clients = ClosedLoopClients(spec, 2048)
    pending = [(r.arrival_s + service_s, c) for c, r in clients.initial()]
    assert len(pending) == min(spec.clients, spec.num_requests or spec.clients)
    follow_ups = []
    while pending:
        pending.sort()
        finish, client = pending.pop(0)
        nxt = clients.on_finish(client, finish)
        if nxt is not None:
            follow_ups.append((finish, nxt))
            pending.append((nxt.arrival_s + service_s, client))
    assert clients.issued == len(follow_ups) + min(spec.clients, spec.num_requests or 0)
    return follow_ups


def test_closed_loop_issues_exactly_n_requests() -> None:
    spec = parse_traffic("closed:clients=4,n=50,prompt=256,output=64")
    follow_ups = _run_closed(spec, service_s=0.25)
    assert len(follow_ups) == 46
    assert all(r.arrival_s == finish for finish, r in follow_ups)  # no think time
    assert all((r.prompt_tokens, r.output_tokens) == (256, 64) for _, r in follow_ups)


def test_closed_loop_arrivals_are_finish_plus_think() -> None:
    spec = parse_traffic("closed:clients=8,think=0.5,n=4000,seed=9")
    follow_ups = _run_closed(spec, service_s=0.1)
    thinks = [r.arrival_s - finish for finish, r in follow_ups]
    assert len(thinks) == 3992 and min(thinks) >= 0.0
    assert statistics.fmean(thinks) == pytest.approx(0.5, rel=0.06)


def test_closed_loop_refuses_a_client_without_a_request() -> None:
    clients = ClosedLoopClients(parse_traffic("closed:clients=2,n=3"), 1024)
    assert [c for c, _ in clients.initial()] == [0, 1]
    assert clients.on_finish(1, 1.0) == TrafficRequest(1.0, 512, 128)
    assert clients.on_finish(0, 2.0) is None  # all 3 issued: client 0 is now idle
    with pytest.raises(ValueError):
        clients.on_finish(0, 3.0)
    with pytest.raises(ValueError):
        clients.on_finish(5, 1.0)
    with pytest.raises(RuntimeError):
        clients.initial()
    with pytest.raises(ValueError):
        ClosedLoopClients(parse_traffic("poisson:rate=1,n=3"), 1024)
