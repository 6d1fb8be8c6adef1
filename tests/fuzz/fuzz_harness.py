"""A seeded fuzz harness for the whole engine on the scripted model.

`generate_workload(seed)` draws one workload, a plain dict (JSON-able, so a failing one can
be pasted into a regression test): engine limits (vocabulary, EOS, `max_model_len`, block
size, KV pools down to one max-length sequence, token budget, `max_num_seqs`,
`long_prefill_token_threshold`, prefix caching, FCFS or priority), optional drafts
(`scripted-drafter`, k, how many are right, `disable_by_batch_size`), optional
`fake-grammar`, and requests: prompts over shared stems (prefix hits), greedy or seeded
sampling (temperature, top-k/p, min-p, penalties, bad words, logprobs), stop tokens,
`min_tokens`, `ignore_eos`, `max_tokens` up to 10**6 (ended by `max_model_len`),
priorities, arrivals over steps, aborts (before the first step, in flight, after the
request finished, and from inside a step as a client thread's would arrive) and request
ids reused by later requests.

`run_workload(workload, mode)` drives one engine step by step (`inprocess` sync or async,
`thread`, `process`), with `check_invariants: true` (ledger and KV invariants after every
step), adding requests at their arrival step and queuing aborts at theirs, and fails on any
output after a request finished, an engine that does not become idle, and leaked blocks
or requests at the end.

`check_workload(workload, modes)` runs it under every mode and compares each request with
the synchronous in-process run token for token (an aborted request: a prefix), and each
unaborted greedy request without penalties or bad words with `greedy_reference`, computed
from the scripted model's logits without the engine. On failure it raises `FuzzFailure`,
whose message holds the seed, the modes, what differed, and the smallest workload (from
`shrink`) that still fails, as a dict.
"""

from __future__ import annotations

import json
import math
import pprint
import random
from dataclasses import dataclass, field
from typing import Any

from tandem.core import hookimpl
from tandem.core.engine_core import EngineCore
from tandem.core.scheduler_output import SchedulerOutput
from tandem.testing.engine import make_request, make_scripted_engine
from tandem.testing.scripted_model import scripted_next_token

#: Engine modes: (executor, async_scheduling).
MODES: dict[str, tuple[str, bool]] = {
    "sync": ("inprocess", False),
    "async": ("inprocess", True),
    "thread-sync": ("thread", False),
    "thread-async": ("thread", True),
    "process-async": ("process", True),
}
REFERENCE_MODE = "sync"
MAX_STEPS = 20_000
#: Ripple of the scripted logits: greedy ties are impossible while vocab <= 193.
MAX_VOCAB = 193

Outcome = tuple[list[int], "str | None"]


class FuzzFailure(AssertionError):
    """A workload failed; the message carries the seed and a reproduction."""


@dataclass
class RunResult:
    """One engine run: per request entry (index into `workload["requests"]`) its tokens and
    finish reason, and counters."""

    outcomes: list[Outcome]
    steps: int = 0
    preemptions: int = 0
    draft_tokens: int = 0
    deferred_steps: int = 0


@dataclass
class Stats:
    workloads: int = 0
    runs: int = 0
    steps: int = 0
    preemptions: int = 0
    draft_tokens: int = 0
    deferred_steps: int = 0
    requests: int = 0
    aborted: int = 0
    reused_ids: int = 0
    failures: int = 0
    runs_by_mode: dict[str, int] = field(default_factory=dict)

    def add(self, workload: dict[str, Any], results: dict[str, RunResult]) -> None:
        self.workloads += 1
        self.requests += len(workload["requests"])
        self.reused_ids += len(workload["requests"]) - len({r["rid"] for r in workload["requests"]})
        for mode, result in results.items():
            self.runs += 1
            self.runs_by_mode[mode] = self.runs_by_mode.get(mode, 0) + 1
            self.steps += result.steps
            self.preemptions += result.preemptions
            self.draft_tokens += result.draft_tokens
            self.deferred_steps += result.deferred_steps
            self.aborted += sum(1 for _, reason in result.outcomes if reason == "abort")

    def summary(self) -> str:
        modes = ", ".join(f"{m} {n}" for m, n in sorted(self.runs_by_mode.items()))
        return (
            f"{self.workloads} workloads, {self.runs} runs ({modes}), {self.steps} steps, "
            f"{self.preemptions} preemptions, {self.requests} requests "
            f"({self.reused_ids} reused ids, {self.aborted} aborted outcomes), "
            f"{self.draft_tokens} draft tokens verified, {self.deferred_steps} deferred "
            f"grammar steps; {self.failures} failed workloads"
        )


# Workloads ------------------------------------------------------------------------------


def generate_workload(seed: int) -> dict[str, Any]:
    """One random workload, a function of `seed` only."""
    rng = random.Random(seed)
    vocab = rng.choice([32, 64, 128, 128, MAX_VOCAB])
    eos = rng.choice([0, 1, 1, 5, vocab - 1])
    max_model_len = rng.choice([rng.randint(8, 48), rng.randint(16, 96), rng.randint(40, 160)])
    block_size = rng.choice([1, 2, 3, 4, 4, 8, 16])
    min_blocks = math.ceil(max_model_len / block_size)
    num_kv_blocks = rng.choice(
        [min_blocks, min_blocks + rng.randint(0, 3), rng.randint(min_blocks, 3 * min_blocks)]
    )
    engine = {
        "vocab_size": vocab,
        "eos_token_id": eos,
        "max_model_len": max_model_len,
        "block_size": block_size,
        "num_kv_blocks": num_kv_blocks,
        "max_num_batched_tokens": rng.choice([rng.randint(1, 8), rng.randint(1, 64), 512]),
        "max_num_seqs": rng.randint(1, 8),
        "long_prefill_token_threshold": rng.choice([0, 0, rng.randint(1, 16)]),
        "enable_prefix_caching": rng.random() < 0.6,
        "scheduling_policy": rng.choice(["fcfs", "priority"]),
    }
    spec = None
    if rng.random() < 0.35:
        k = rng.randint(1, 4)
        spec = {
            "k": k,
            "num_correct": rng.choice([None, rng.randint(0, k)]),
            "disable_by_batch_size": rng.choice([None, None, rng.randint(1, 4)]),
        }
    grammar = rng.random() < 0.35

    stems = [
        [rng.choice([2, 3, 5, 7]) for _ in range(rng.randint(1, 40))]
        for _ in range(rng.randint(1, 3))
    ]
    num_requests = rng.choice([rng.randint(1, 4), rng.randint(1, 10), rng.randint(6, 12)])
    requests: list[dict[str, Any]] = []
    for i in range(num_requests):
        requests.append(_request(rng, f"r{i}", stems, engine, grammar, spec))
    # Reused ids: a later request with the id of an earlier one (added once it finished).
    for earlier in list(requests):
        if rng.random() < 0.12:
            again = _request(rng, earlier["rid"], stems, engine, grammar, spec)
            again["arrival"] = earlier["arrival"] + rng.randint(0, 30)
            requests.append(again)
            if rng.random() < 0.5:  # the race: abort the finished one, then reuse its id
                earlier["abort_after_finish"] = True
    ghost_aborts = [rng.randint(0, 30) for _ in range(rng.choice([0, 0, 0, 1, 2]))]
    # Aborts that arrive during a step, after its last drain (as from a client thread).
    # Drawn from a second stream, so they left every other draw of a seed unchanged.
    threads = random.Random(f"abort-in-update-{seed}")
    for entry in requests:
        if threads.random() < 0.1:
            entry["abort_in_update"] = threads.choice([0, threads.randint(1, 40)])
        if entry.get("abort_after_finish") and threads.random() < 0.5:
            entry["abort_as_it_finishes"] = True  # then its id is reused
    return {
        "seed": seed,
        "engine": engine,
        "spec": spec,
        "grammar": grammar,
        "requests": requests,
        "ghost_aborts": ghost_aborts,
    }


def _request(
    rng: random.Random,
    rid: str,
    stems: list[list[int]],
    engine: dict[str, Any],
    grammar: bool,
    spec: dict[str, Any] | None,
) -> dict[str, Any]:
    vocab, max_model_len = engine["vocab_size"], engine["max_model_len"]
    length = rng.randint(1, min(max_model_len - 1, 48))
    stem = rng.choice(stems)
    keep = rng.randint(0, min(length, len(stem)))
    prompt = stem[:keep] + [
        rng.choice([2, 3, 5, 7]) if rng.random() < 0.7 else rng.randrange(vocab)
        for _ in range(length - keep)
    ]
    params: dict[str, Any] = {
        "max_tokens": rng.choice(
            [rng.randint(1, 8), rng.randint(1, 40), rng.randint(1, 40), 10**6]
        ),
        "ignore_eos": rng.random() < 0.4,
    }
    if rng.random() < 0.4:
        params["temperature"] = rng.choice([0.5, 0.8, 1.0, 1.5])
        params["seed"] = rng.randrange(2**31)
        if rng.random() < 0.4:
            params["top_k"] = rng.randint(1, 20)
        if rng.random() < 0.4:
            params["top_p"] = rng.choice([0.5, 0.9, 0.95])
        if rng.random() < 0.15:
            params["min_p"] = 0.05
    else:
        params["temperature"] = 0.0
    stop_kind = rng.choice(["none", "none", "random", "own"])
    if stop_kind == "random":
        params["stop_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 2))]
    elif stop_kind == "own":  # a token the request is likely to produce: it stops mid-run
        own = _scripted_tokens(prompt, min(params["max_tokens"], 40), vocab)
        params["stop_token_ids"] = [rng.choice(own)]
    if rng.random() < 0.2:
        params["min_tokens"] = min(rng.choice([1, 2, 3, 8]), params["max_tokens"])
    if rng.random() < 0.08:
        params[rng.choice(["presence_penalty", "frequency_penalty"])] = rng.choice([-1.0, 0.5, 1.5])
    if rng.random() < 0.05:
        params["repetition_penalty"] = rng.choice([0.8, 1.3])
    if rng.random() < 0.05:
        params["bad_words_token_ids"] = [
            [rng.randrange(vocab) for _ in range(rng.randint(1, 2))] for _ in range(2)
        ]
    if rng.random() < 0.08:
        params["logprobs"] = rng.randint(0, 5)
    if grammar and rng.random() < 0.7:
        params["structured_outputs"] = {"custom": {"modulus": rng.randint(2, 7)}}
    entry: dict[str, Any] = {
        "rid": rid,
        "prompt": prompt,
        "params": params,
        "priority": rng.randint(0, 3),
        "arrival": rng.choice([0, 0, rng.randint(0, 12), rng.randint(0, 40)]),
    }
    if spec is not None and rng.random() < 0.5:
        entry["num_correct"] = rng.randint(0, spec["k"])
    if rng.random() < 0.18:  # 0: queued before its first step; later: most likely in flight
        entry["abort_after"] = rng.choice([0, rng.randint(1, 6), rng.randint(1, 40)])
    return entry


def _scripted_tokens(prompt: list[int], n: int, vocab: int) -> list[int]:
    history = list(prompt)
    for _ in range(n):
        history.append(scripted_next_token(history, vocab))
    return history[len(prompt) :]


# The reference without the engine ------------------------------------------------------


def greedy_reference(entry: dict[str, Any], engine: dict[str, Any]) -> Outcome | None:
    """What a greedy request must produce, from the scripted logits (the scripted token at
    8.0 over a ripple in [0, 2)) with the fake grammar's mask and the `min_tokens` block of
    EOS and stop tokens, and `check_stop`'s rules; None for a request this cannot predict
    (seeded sampling, penalties, bad words)."""
    params = entry["params"]
    if params.get("temperature", 0.0) != 0.0 or params.get("bad_words_token_ids"):
        return None
    if any(params.get(p) for p in ("presence_penalty", "frequency_penalty")):
        return None
    if params.get("repetition_penalty", 1.0) != 1.0:
        return None
    vocab, eos = engine["vocab_size"], engine["eos_token_id"]
    max_model_len = engine["max_model_len"]
    grammar = params.get("structured_outputs")
    modulus = grammar["custom"]["modulus"] if grammar else None
    stop_ids = set(params.get("stop_token_ids", ()))
    ignore_eos = params.get("ignore_eos", False)
    min_tokens = params.get("min_tokens", 0)
    max_tokens = params["max_tokens"]
    history = list(entry["prompt"])
    out: list[int] = []
    while True:
        scripted = scripted_next_token(history, vocab)
        blocked = set(stop_ids) if len(out) < min_tokens else set()
        if len(out) < min_tokens and not ignore_eos:
            blocked.add(eos)
        candidates = [
            t
            for t in range(vocab)
            if t not in blocked and (modulus is None or (t + history[-1]) % modulus == 0)
        ]
        if scripted in candidates:
            token = scripted
        else:
            token = max(candidates, key=lambda v: ((scripted * 131 + v * 71) % 193, -v))
        history.append(token)
        out.append(token)
        if len(out) < min_tokens:
            if len(history) >= max_model_len:
                return out, "length"
            continue
        if (not ignore_eos and token == eos) or token in stop_ids:
            return out, "stop"
        if len(history) >= max_model_len or len(out) >= max_tokens:
            return out, "length"


# Driving one engine -------------------------------------------------------------------


def engine_overrides(workload: dict[str, Any], mode: str) -> dict[str, Any]:
    executor, use_async = MODES[mode]
    overrides: dict[str, Any] = dict(workload["engine"])
    overrides["async_scheduling"] = use_async
    overrides["check_invariants"] = True
    overrides["parallel"] = {"executor": executor}
    plugins: list[dict[str, Any]] = [{"name": "reference-scheduler"}, {"name": "default-sampler"}]
    if workload["grammar"]:
        plugins.append({"name": "fake-grammar"})
    spec = workload["spec"]
    if spec is not None:
        overrides["speculative"] = {
            "method": "scripted",
            "num_speculative_tokens": spec["k"],
            "disable_by_batch_size": spec["disable_by_batch_size"],
        }
        by_request = {
            r["rid"]: r["num_correct"] for r in workload["requests"] if "num_correct" in r
        }
        options: dict[str, Any] = {"num_correct_by_request": by_request}
        if spec["num_correct"] is not None:
            options["num_correct"] = spec["num_correct"]
        plugins.append({"name": "scripted-drafter", "options": options})
    overrides["plugins"] = plugins
    return overrides


def run_workload(workload: dict[str, Any], mode: str) -> RunResult:
    """Drive one engine through the workload; see the module docstring."""
    engine = make_scripted_engine(**engine_overrides(workload, mode))
    try:
        return _drive(engine, workload)
    finally:
        engine.shutdown()


class _AbortInUpdate:
    """Queues aborts from inside `update_from_output`, after the scheduler's and after the
    kernel's last drain before it, as a client thread's abort can arrive: `pending` ids in
    this step's update (the driver delivers them itself after a step without one), and
    each id of `as_it_finishes` in the update that finishes it (the request is still live
    for the kernel then; its id may be reused right after)."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.pending: list[str] = []
        self.as_it_finishes: set[str] = set()

    @hookimpl(trylast=True)
    def update_from_output(self, scheduler_output: SchedulerOutput) -> None:
        registry = self.engine.scheduler_state.requests
        ids = self.pending + [
            rid
            for rid in scheduler_output.num_scheduled_tokens
            if rid in self.as_it_finishes and rid not in registry
        ]
        self.pending = []
        if ids:
            self.engine.abort_requests(ids)


def _drive(engine: EngineCore, workload: dict[str, Any]) -> RunResult:
    entries = workload["requests"]
    eos = workload["engine"]["eos_token_id"]
    tokens: list[list[int]] = [[] for _ in entries]
    reasons: list[str | None] = [None for _ in entries]
    added_at: list[int | None] = [None for _ in entries]
    live: dict[str, int] = {}  # rid -> entry index of the incarnation in the engine
    ghosts = list(workload.get("ghost_aborts", ()))
    step = 0
    num_added = 0
    in_update = _AbortInUpdate(engine)
    engine.plugin_manager.register(in_update, name="fuzz-abort-in-update")

    def finished(i: int) -> None:
        in_update.as_it_finishes.discard(entries[i]["rid"])
        if entries[i].get("abort_after_finish"):
            engine.abort_requests([entries[i]["rid"]])  # a no-op: it already finished

    while True:
        # Aborts first, then arrivals: an id freed this window may be reused right away.
        for i, entry in enumerate(entries):
            delay, added = entry.get("abort_after"), added_at[i]
            due = delay is not None and added is not None and added + delay == step
            # In flight, or after it finished; never once a later request has the id.
            if due and live.get(entry["rid"], i) == i:
                engine.abort_requests([entry["rid"]])
        if step in ghosts:
            engine.abort_requests([f"ghost-{step}"])
        for i, entry in enumerate(entries):
            if added_at[i] is not None or entry["arrival"] > step or entry["rid"] in live:
                continue
            if any(
                added_at[j] is None or reasons[j] is None
                for j in range(i)
                if entries[j]["rid"] == entry["rid"]
            ):
                continue  # an earlier request with this id has not finished yet
            request = make_request(
                entry["rid"],
                entry["prompt"],
                eos_token_id=eos,
                priority=entry["priority"],
                arrival_time=float(num_added),
                **entry["params"],
            )
            try:
                engine.add_request(request)
            except ValueError as exc:
                if "still in flight" in str(exc):
                    continue  # the finished request's last step is in flight: retry later
                raise
            added_at[i] = step
            live[entry["rid"]] = i
            num_added += 1
        for i, entry in enumerate(entries):
            delay, added = entry.get("abort_in_update"), added_at[i]
            due = delay is not None and added is not None and added + delay == step
            if due and live.get(entry["rid"], i) == i:
                in_update.pending.append(entry["rid"])
            if entry.get("abort_as_it_finishes") and live.get(entry["rid"]) == i:
                in_update.as_it_finishes.add(entry["rid"])
        done = all(r is not None for r in reasons) and all(a is not None for a in added_at)
        if done and step >= max(ghosts, default=0) and not engine.has_work():
            break
        outputs, _ = engine.step_fn()
        if in_update.pending:  # no update in this step (idle): deliver them between steps
            engine.abort_requests(in_update.pending)
            in_update.pending = []
        for out in outputs:
            i = live.get(out.request_id)
            if i is None:
                raise AssertionError(f"output for {out.request_id!r}, which is not live: {out}")
            tokens[i].extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[i] = out.finish_reason
                del live[out.request_id]
                finished(i)
        step += 1
        if step >= MAX_STEPS:
            raise AssertionError(f"the engine did not become idle within {MAX_STEPS} steps")

    assert not engine.batch_queue, "steps left in the batch queue"
    state = engine.scheduler_state
    kv = state.kv_cache_manager
    assert kv.all_blocks_free(), (
        f"KV leak: {kv.num_free_blocks} of {kv.num_blocks} free, {kv.num_fenced_blocks} fenced"
    )
    assert not state.requests, f"requests left in the scheduler: {sorted(state.requests)}"
    scheduler = engine.plugin_manager.plugins_with_role("scheduler")[0]
    grammar = engine.plugin_manager.plugins_with_role("grammar")
    return RunResult(
        outcomes=list(zip(tokens, reasons, strict=True)),
        steps=engine.num_steps,
        preemptions=scheduler.num_preemptions,
        draft_tokens=scheduler.spec_metrics.num_draft_tokens,
        deferred_steps=sum(grammar[0].steps) if grammar else 0,
    )


# Checking -------------------------------------------------------------------------------


def compare(workload: dict[str, Any], results: dict[str, RunResult]) -> list[str]:
    """Every difference between the runs and the references, in words."""
    problems: list[str] = []
    reference = results[REFERENCE_MODE].outcomes
    for i, entry in enumerate(workload["requests"]):
        name = f"request {i} ({entry['rid']!r})"
        outcomes = {mode: result.outcomes[i] for mode, result in results.items()}
        oracle = greedy_reference(entry, workload["engine"])
        aborted_any = any(reason == "abort" for _, reason in outcomes.values())
        may_abort = "abort_after" in entry or "abort_in_update" in entry
        for mode, (_, reason) in outcomes.items():
            if reason is None:
                problems.append(f"{name} under {mode}: never finished")
            elif reason == "abort" and not may_abort:
                problems.append(f"{name} under {mode}: aborted, but no abort targeted it")
            elif reason not in ("stop", "length", "abort"):
                problems.append(f"{name} under {mode}: finish_reason {reason!r}")
        if oracle is not None:
            for mode, (tokens, reason) in outcomes.items():
                if reason == "abort":
                    if tokens != oracle[0][: len(tokens)] or len(tokens) >= len(oracle[0]):
                        problems.append(
                            f"{name} under {mode}: aborted with {tokens}, not a proper prefix "
                            f"of the greedy reference {oracle[0]}"
                        )
                elif (tokens, reason) != oracle:
                    problems.append(
                        f"{name} under {mode}: {reason} {tokens} != greedy reference "
                        f"{oracle[1]} {oracle[0]}"
                    )
        if not aborted_any:
            for mode, outcome in outcomes.items():
                if outcome != reference[i]:
                    problems.append(
                        f"{name} under {mode}: {outcome[1]} {outcome[0]} != {REFERENCE_MODE} "
                        f"{reference[i][1]} {reference[i][0]}"
                    )
        else:  # aborted somewhere: every run's tokens are prefixes of the longest
            longest = max((tokens for tokens, _ in outcomes.values()), key=len)
            complete = {(tuple(t), r) for t, r in outcomes.values() if r != "abort"}
            for mode, (tokens, _) in outcomes.items():
                if tokens != longest[: len(tokens)]:
                    problems.append(
                        f"{name} under {mode}: {tokens} is not a prefix of {longest} "
                        f"(another run's tokens)"
                    )
            if len(complete) > 1:
                problems.append(f"{name}: runs that were not aborted differ: {sorted(complete)}")
    return problems


def check_workload(
    workload: dict[str, Any],
    modes: list[str],
    stats: Stats | None = None,
    shrink_on_failure: bool = True,
) -> dict[str, RunResult]:
    """Run `workload` under `modes` (the reference mode is added first) and compare; raise
    `FuzzFailure` with the seed and a (shrunk) reproduction on any failure."""
    modes = [REFERENCE_MODE] + [m for m in modes if m != REFERENCE_MODE]
    results, problems = _run_and_compare(workload, modes)
    if problems:
        small, small_problems = workload, problems
        if shrink_on_failure:
            small = shrink(workload, modes)
            small_problems = _run_and_compare(small, modes)[1]
        if stats is not None:
            stats.failures += 1
        raise FuzzFailure(failure_report(workload, modes, problems, small, small_problems))
    if stats is not None:
        stats.add(workload, results)
    return results


def _run_and_compare(
    workload: dict[str, Any], modes: list[str]
) -> tuple[dict[str, RunResult], list[str]]:
    try:
        results = {mode: run_workload(workload, mode) for mode in modes}
    except Exception as exc:  # noqa: BLE001 - any crash is a failure to report
        return {}, [f"{type(exc).__name__}: {exc}"]
    return results, compare(workload, results)


def _fails(workload: dict[str, Any], modes: list[str]) -> bool:
    return bool(_run_and_compare(workload, modes)[1])


def shrink(workload: dict[str, Any], modes: list[str], budget: int = 150) -> dict[str, Any]:
    """A smaller workload that still fails: drop requests, drafts, the grammar, aborts and
    sampling options one at a time while the failure persists (at most `budget` tries)."""
    current = json.loads(json.dumps(workload))
    tries = 0

    def attempt(candidate: dict[str, Any]) -> bool:
        nonlocal tries, current
        if tries >= budget:
            return False
        tries += 1
        if _fails(candidate, modes):
            current = candidate
            return True
        return False

    changed = True
    while changed and tries < budget:
        changed = False
        for i in reversed(range(len(current["requests"]))):
            if i < len(current["requests"]) and len(current["requests"]) > 1:
                candidate = json.loads(json.dumps(current))
                del candidate["requests"][i]
                changed |= attempt(candidate)
        for key, value in (("spec", None), ("grammar", False), ("ghost_aborts", [])):
            if current.get(key) != value:
                candidate = json.loads(json.dumps(current))
                candidate[key] = value
                if key == "grammar":
                    for r in candidate["requests"]:
                        r["params"].pop("structured_outputs", None)
                changed |= attempt(candidate)
        for i in range(len(current["requests"])):
            for key in ("abort_after", "abort_in_update", "abort_after_finish", "num_correct"):
                if key in current["requests"][i]:
                    candidate = json.loads(json.dumps(current))
                    del candidate["requests"][i][key]
                    changed |= attempt(candidate)
            for key in list(current["requests"][i]["params"]):
                if key != "max_tokens":
                    candidate = json.loads(json.dumps(current))
                    del candidate["requests"][i]["params"][key]
                    changed |= attempt(candidate)
            if current["requests"][i]["arrival"] != 0:
                candidate = json.loads(json.dumps(current))
                candidate["requests"][i]["arrival"] = 0
                changed |= attempt(candidate)
    return current


def failure_report(
    workload: dict[str, Any],
    modes: list[str],
    problems: list[str],
    small: dict[str, Any],
    small_problems: list[str],
) -> str:
    def shown(lines: list[str]) -> str:
        more = [f"... {len(lines) - 12} more"] if len(lines) > 12 else []
        return "\n  ".join(line[:600] for line in lines[:12] + more)

    return (
        f"fuzz workload seed={workload['seed']} failed under modes {modes}:\n  "
        f"{shown(problems)}\n"
        f"smallest failing workload found ({len(small['requests'])} of "
        f"{len(workload['requests'])} requests):\n  {shown(small_problems)}\n"
        f"reproduce (tests/fuzz/fuzz_harness.py; paste into a regression test):\n"
        f"check_workload(\n{pprint.pformat(small, width=100, compact=True, sort_dicts=False)},"
        f"\n{modes!r},\n)\n"
    )


def modes_for(seed: int) -> list[str]:
    """The modes a workload runs under: sync and async always, a worker-thread executor
    (sync or async by seed) and, for one seed in 100, the worker-process executor (it takes
    seconds to start)."""
    modes = ["sync", "async", "thread-async" if seed % 2 else "thread-sync"]
    if seed % 100 == 7:
        modes.append("process-async")
    return modes


#: Totals of every workload checked in this process (the fuzz tests report them).
STATS = Stats()
