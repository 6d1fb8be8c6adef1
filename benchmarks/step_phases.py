"""Wall time of each engine step split into phases, by wrapping the real call sites at run time.

`instrument(llm)` (a context manager) replaces, in this process only and until it exits,
the methods and hook callers that make up a step with timed wrappers. Nothing in the tree
is changed; everything is restored on exit (class attributes included), so a test process
stays clean.

Accounting: every wrapper adds its *exclusive* time (its own wall time less that of the
wrapped calls nested in it) to its phase, so the phases never double count. A step is one
turn of `LLM._run`'s loop: from one `engine.run_step()` call to the next; the part of it
no wrapper saw is `remainder` (the loop, futures, `has_work`, aborts: "Python overhead").
Hence, per step, the phases plus the remainder equal the step's wall time exactly, and
each is non-negative. Everything runs on the caller's thread (the `inprocess` executor),
so phases never overlap in time; under async scheduling one step schedules, executes and
samples step N+1 and then applies step N's output: each phase counts in the loop turn
that ran it.

Each step also records what it scheduled and what it applied (requests, tokens, new
requests), so callers can pick the steps where every scheduled request decodes.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

#: Phase -> the category the report groups it under.
CATEGORY = {
    "schedule": "scheduling",
    "update_after_schedule": "scheduling",
    "update_states": "input_preparation",
    "prepare_inputs": "input_preparation",
    "fill_sampled_inputs": "input_preparation",
    "sampling_metadata": "input_preparation",
    "attention_metadata": "input_preparation",
    "linears": "forward",
    "attention": "forward",
    "kv_write": "forward",
    "decode_kernel": "forward",
    "forward_other": "forward",
    "logits": "logits",
    "sampling": "sampling",
    "runner_output": "output_processing",
    "update_from_output": "output_processing",
    "frontend_output": "output_processing",
    "execute_model_other": "python_overhead",
    "loop_hooks": "python_overhead",
    "remainder": "python_overhead",
}
#: The model's own compute (the phases issue 16 does not ask to cut or explain).
MODEL_COMPUTE = ("linears", "attention", "kv_write", "decode_kernel", "logits")


@dataclass
class Step:
    """One loop turn: wall seconds, exclusive seconds per phase, what it did."""

    wall_s: float
    phases: dict[str, float]
    #: (requests, tokens, new requests) of each `schedule()` / applied step in this turn.
    scheduled: list[tuple[int, int, int]] = field(default_factory=list)
    applied: list[tuple[int, int, int]] = field(default_factory=list)

    def is_decode(self, batch: int) -> bool:
        """Every scheduled and every applied step decoded `batch` requests, one token each."""
        full = (batch, batch, 0)
        return (
            bool(self.scheduled)
            and bool(self.applied)
            and (all(s == full for s in self.scheduled + self.applied))
        )

    def is_full_prefill(self, budget: int) -> bool:
        """Every scheduled and every applied step ran `budget` tokens, none a decode-only
        batch (a prefill-only workload: each step a full chunk of prompts)."""
        steps = self.scheduled + self.applied
        return (
            bool(self.scheduled)
            and bool(self.applied)
            and all(t == budget and t > r for r, t, _ in steps)
        )


def _shape(so: Any) -> tuple[int, int, int]:
    return (len(so.num_scheduled_tokens), so.total_num_scheduled_tokens, len(so.scheduled_new_reqs))


class PhaseClock:
    """Collects `Step`s. `wrap(phase, fn)` returns `fn` timed into `phase`."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.calls = 0
        self._stack: list[list[float]] = []  # per open call: [seconds of nested calls]
        self._acc: dict[str, float] = defaultdict(float)
        self._scheduled: list[tuple[int, int, int]] = []
        self._applied: list[tuple[int, int, int]] = []
        self._turn_start: float | None = None

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        stack, acc, clock = self._stack, self._acc, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            frame = [0.0]
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - start
                stack.pop()
                acc[phase] += elapsed - frame[0]
                if stack:
                    stack[-1][0] += elapsed
                self.calls += 1

        return timed

    def note_scheduled(self, so: Any) -> None:
        self._scheduled.append(_shape(so))

    def note_applied(self, so: Any) -> None:
        self._applied.append(_shape(so))

    def turn(self) -> None:
        """A loop turn begins (close the previous one)."""
        now = time.perf_counter()
        if self._turn_start is not None:
            self._close(now)
        self._turn_start = now

    def finish(self) -> None:
        """The loop ended: close the last turn."""
        if self._turn_start is not None:
            self._close(time.perf_counter())
            self._turn_start = None

    def _close(self, now: float) -> None:
        assert self._turn_start is not None and not self._stack
        wall = now - self._turn_start
        phases = dict(self._acc)
        phases["remainder"] = wall - sum(phases.values())
        self.steps.append(Step(wall, phases, self._scheduled, self._applied))
        self._acc.clear()
        self._scheduled, self._applied = [], []


class _Patches:
    """Attribute replacements, undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        had_own = name in vars(owner) if hasattr(owner, "__dict__") else False
        self._undo.append((owner, name, getattr(owner, name), had_own))
        setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, old, had_own in reversed(self._undo):
            if had_own or isinstance(owner, type):
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._undo.clear()


def _wrap_engine(clock: PhaseClock, p: _Patches, llm: Any) -> None:
    engine = llm.engine
    hook = engine.hook
    schedule, after, update = hook.schedule, hook.update_after_schedule, hook.update_from_output
    timed_schedule = clock.wrap("schedule", schedule)

    def scheduled(*a: Any, **k: Any) -> Any:
        so = timed_schedule(*a, **k)
        clock.note_scheduled(so)
        return so

    timed_update = clock.wrap("update_from_output", update)

    def applied(*a: Any, **k: Any) -> Any:
        clock.note_applied(k["scheduler_output"])
        return timed_update(*a, **k)

    p.set(hook, "schedule", scheduled)
    p.set(hook, "update_after_schedule", clock.wrap("update_after_schedule", after))
    p.set(hook, "update_from_output", applied)
    p.set(hook, "grammar_bitmask", clock.wrap("loop_hooks", hook.grammar_bitmask))
    run_step = engine.run_step

    def turn() -> Any:
        clock.turn()
        return run_step()

    p.set(engine, "run_step", turn)
    p.set(
        llm.output_processor, "process", clock.wrap("frontend_output", llm.output_processor.process)
    )
    import tandem.core.engine_core as engine_core

    p.set(engine_core, "resolve_output", clock.wrap("runner_output", engine_core.resolve_output))


def _wrap_runner(clock: PhaseClock, p: _Patches, runner: Any) -> None:
    for name, phase in (
        ("execute_model", "execute_model_other"),
        ("_update_states", "update_states"),
        ("_prepare_inputs", "prepare_inputs"),
        ("sample_tokens", "runner_output"),
        ("_sample", "sampling"),
        ("_sampling_metadata", "sampling_metadata"),
    ):
        p.set(runner, name, clock.wrap(phase, getattr(runner, name)))
    if runner.device_outputs is not None:
        fill = runner.device_outputs.fill_sampled_inputs
        p.set(runner.device_outputs, "fill_sampled_inputs", clock.wrap("fill_sampled_inputs", fill))


def _wrap_hf_model(clock: PhaseClock, p: _Patches, model: Any) -> None:
    """The real model's forward: linears, attention (KV write, decode kernel), LM head,
    attention metadata; what is left of the forward is `forward_other` (embedding, norms,
    RoPE, activations, residual adds, the logits' gather and copy)."""
    import tandem.models.cpu_kernels as cpu_kernels
    import tandem.models.fused_decoder as fused_decoder
    import tandem.models.hf_model as hf_model
    import tandem.models.packed_linear as packed_linear
    import tandem.models.paged_attention as paged_attention
    import tandem.models.panel_linear as panel_linear

    head = model.lm_head
    head_call = type(head).__call__  # before the classes' calls are wrapped below
    for linear_type in (packed_linear.PackedLinear, panel_linear.PanelLinear):
        p.set(linear_type, "__call__", clock.wrap("linears", linear_type.__call__))
    p.set(model, "lm_head", clock.wrap("logits", lambda x: head_call(head, x)))
    p.set(hf_model, "build_metadata", clock.wrap("attention_metadata", hf_model.build_metadata))
    p.set(fused_decoder, "paged_attention", clock.wrap("attention", fused_decoder.paged_attention))
    p.set(paged_attention, "_write_kv", clock.wrap("kv_write", paged_attention._write_kv))
    kernel = cpu_kernels.PagedDecodeKernel
    p.set(kernel, "__call__", clock.wrap("decode_kernel", kernel.__call__))


@contextmanager
def instrument(llm: Any) -> Iterator[PhaseClock]:
    """Time `llm`'s steps (an `LLM` with the in-process executor) until the block exits."""
    worker = getattr(llm.engine.executor, "worker", None)
    if worker is None or type(llm.engine.executor).__name__ != "InProcessExecutor":
        raise ValueError("step phases need the inprocess executor (one thread, no overlap)")
    clock = PhaseClock()
    patches = _Patches()
    try:
        _wrap_engine(clock, patches, llm)
        _wrap_runner(clock, patches, worker.model_runner)
        model = worker.model_runner.model
        p_forward = clock.wrap("forward_other", model.forward)
        if hasattr(model, "fused"):  # a transformers model (hf_model.HFStepModel)
            _wrap_hf_model(clock, patches, model)
        patches.set(model, "forward", p_forward)
        yield clock
    finally:
        clock.finish()
        patches.undo()


def wrapper_cost_s(calls: int = 20000) -> float:
    """Seconds one timed wrapper adds around a call (measured on a no-op, this process)."""
    clock = PhaseClock()
    noop = clock.wrap("x", lambda: None)
    plain = lambda: None  # noqa: E731
    start = time.perf_counter()
    for _ in range(calls):
        plain()
    base = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        noop()
    return max(0.0, (time.perf_counter() - start - base) / calls)
