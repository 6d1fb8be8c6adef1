"""Scheduler kinds: the model, sampler and expectations the suite runs a scheduler with.

A scheduler's kind comes from its class: `num_sampled_tokens_per_step == 0` (it samples no
token from causal positions; canvases travel as spec tokens) makes it a *diffusion*
scheduler, anything else (and every policy plugin, which runs on `reference-scheduler`) an
*autoregressive* one.

- autoregressive: `model: scripted`, `default-sampler`; greedy requests are held to
  `expected_scripted_output`, seeded ones to the reference scheduler's run.
- diffusion: `model: scripted-diffusion` (canvas length `DIFFUSION_CANVAS`),
  `diffusion-sampler`; every request, seeded or not, is held to
  `expected_scripted_diffusion_output` (the scripted diffusion model commits the same
  canvases whatever the draws). The workloads are adapted (`adapt_workload`): no
  `min_tokens` (a diffusion model refuses it), stop tokens taken from the request's own
  committed stream, a token budget of at least one canvas.

What does not apply to a kind is listed in `NOT_APPLICABLE` with the reason: a name in
`CHECKS` is not run and reported "n/a" (a pytest skip whose reason starts with "n/a:");
any other name is a rule inside the checks that is replaced or dropped for that kind,
reported the same way so nothing is skipped silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from tandem.plugin_discovery import load_plugin_class
from tandem.schema.config import ConfigError
from tandem.testing.conformance.stack import StackUnderTest
from tandem.testing.conformance.workloads import VOCAB, RequestSpec, Workload
from tandem.testing.scripted_diffusion import scripted_canvas
from tandem.testing.scripted_model import scripted_next_token

Kind = Literal["autoregressive", "diffusion"]

#: Canvas length of the diffusion runs: 3 does not divide the block sizes the workloads
#: use (1..8 except 1 and 3), so canvases and commits straddle block boundaries.
DIFFUSION_CANVAS = 3

#: Per kind, what does not apply (a check of `CHECKS` or a rule inside them) and why.
NOT_APPLICABLE: Mapping[Kind, Mapping[str, str]] = {
    "autoregressive": {},
    "diffusion": {
        "seeded-parity": "seeded outputs are compared with the reference scheduler's run "
        "for AR schedulers; reference-scheduler is autoregressive and refuses a diffusion "
        "model, so seeded requests are held to expected_scripted_diffusion_output instead "
        "(the scripted diffusion model commits the same canvases whatever the draws)",
        "bounded-wait": "the waiting bound is derived for AR decodes (one token per running "
        "request per step, so decodes alone never exhaust a budget B >= S + 1, and a "
        "request runs in at most M + a steps); a diffusion request schedules a whole "
        "canvas per step, needs several steps per canvas and, under async, runs only every "
        "other step, so neither term of the derivation holds",
        "victim-starvation": "the preemption bound is measured on AR decodes (one token "
        "per running request per step); a diffusion request allocates a whole canvas per "
        "step and, under async, runs only every other step, so its preemption counts are "
        "not comparable (the diffusion scheduler's own FCFS rule preempts one short request "
        "9 times in the async starve-decode workload)",
        "min-tokens": "a diffusion model refuses min_tokens (tandem.schema.diffusion_config: the "
        "denoising sampler cannot suppress EOS inside a canvas); the workloads run with "
        "min_tokens 0",
    },
}


def scheduler_kind(plugin: str | StackUnderTest) -> Kind:
    """The kind of the plugin named `plugin`, or of a stack's scheduler (see the module
    docstring); a name that does not load counts as autoregressive (the engine start then
    reports it)."""
    if isinstance(plugin, StackUnderTest):
        scheduler = plugin.scheduler()
        return scheduler_kind(scheduler) if scheduler is not None else "autoregressive"
    try:
        cls = load_plugin_class(plugin)
    except ConfigError:
        return "autoregressive"
    if getattr(cls, "role", None) != "scheduler":
        return "autoregressive"
    if getattr(cls, "num_sampled_tokens_per_step", 1) == 0:
        return "diffusion"
    return "autoregressive"


def not_applicable(kind: Kind, check: str) -> str | None:
    """Why `check` (or a rule name) does not apply to `kind`; None when it applies."""
    return NOT_APPLICABLE[kind].get(check)


def sampler_for(kind: Kind) -> str:
    return "diffusion-sampler" if kind == "diffusion" else "default-sampler"


def model_overrides(kind: Kind) -> dict[str, Any]:
    """Config keywords (of `scripted_config`) that pick the kind's model."""
    if kind == "diffusion":
        return {"model": "scripted-diffusion", "diffusion": {"canvas_length": DIFFUSION_CANVAS}}
    return {}


def diffusion_tokens(prompt: Sequence[int], n: int) -> list[int]:
    """The scripted diffusion model's first `n` committed tokens after `prompt`, ignoring
    every stop and the model-length edge (canvases of `DIFFUSION_CANVAS`)."""
    context = list(prompt)
    while len(context) < len(prompt) + n:
        context += scripted_canvas(context, DIFFUSION_CANVAS, VOCAB)
    return context[len(prompt) : len(prompt) + n]


def _ar_tokens(prompt: Sequence[int], n: int) -> list[int]:
    history = list(prompt)
    for _ in range(n):
        history.append(scripted_next_token(history, VOCAB))
    return history[len(prompt) :]


def _adapt_request(spec: RequestSpec) -> RequestSpec:
    """No min_tokens; each stop token replaced by the diffusion token at the position
    where the AR stream had it (so the request still stops mid-stream)."""
    stops: list[int] = []
    if spec.stop_token_ids:
        ar = _ar_tokens(spec.prompt, spec.max_tokens)
        own = diffusion_tokens(spec.prompt, spec.max_tokens)
        for token in spec.stop_token_ids:
            index = ar.index(token) if token in ar else len(own) - 1
            stops.append(own[index])
    return replace(spec, min_tokens=0, stop_token_ids=tuple(stops))


def adapt_workload(workload: Workload, kind: Kind) -> Workload:
    """`workload` as the kind's model runs it (see the module docstring)."""
    if kind != "diffusion":
        return workload
    limits = dict(workload.limits)
    limits["max_num_batched_tokens"] = max(int(limits["max_num_batched_tokens"]), DIFFUSION_CANVAS)
    return replace(
        workload,
        requests=tuple(_adapt_request(s) for s in workload.requests),
        limits=limits,
    )
