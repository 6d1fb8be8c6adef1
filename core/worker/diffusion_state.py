"""Per-request runner state of a block-diffusion request, kept between denoising steps.

One `CanvasState` per request: the current canvas `[L]`, the previous step's processed
logits `[L, V]` (self-conditioning input, None at a canvas's first step), the stopping
state (`prev_argmax [L]`, `stable_run`), the step index inside the canvas and the canvas
index (commits so far). A canvas that has not started yet has `canvas is None`: its first
denoising step draws the initial random tokens with the generator keyed by
(seed, canvas index, -1) (`step_generator_seed`). A preempted or finished request's state
is dropped; after a preemption the request restarts the same canvas index with the same
keyed draws, so it repeats what it would have done.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class CanvasState:
    """One request's denoising state (see the module docstring)."""

    seed: int
    eos_token_ids: tuple[int, ...]
    canvas_index: int = 0
    step_index: int = 0
    canvas: torch.Tensor | None = None
    self_cond: torch.Tensor | None = None
    prev_argmax: torch.Tensor | None = None
    stable_run: int = 0

    def start_canvas(self, canvas: torch.Tensor) -> None:
        """A fresh canvas: no self-conditioning, stopping state reset, step 0."""
        self.canvas = canvas
        self.self_cond = None
        self.prev_argmax = torch.full_like(canvas, -1)
        self.stable_run = 0
        self.step_index = 0

    def advance(
        self, canvas: torch.Tensor, self_cond: torch.Tensor, argmax: torch.Tensor, run: int
    ) -> None:
        """After a step that did not commit."""
        self.canvas, self.self_cond = canvas, self_cond
        self.prev_argmax, self.stable_run = argmax, run
        self.step_index += 1

    def committed(self) -> None:
        """After a commit: the next canvas starts at its next step."""
        self.canvas_index += 1
        self.canvas = self.self_cond = self.prev_argmax = None
        self.step_index = 0
        self.stable_run = 0


class DiffusionStates:
    """The runner's `CanvasState`s by request id."""

    def __init__(self) -> None:
        self.by_req: dict[str, CanvasState] = {}

    def admit(
        self,
        req_id: str,
        seed: int | None,
        eos_token_ids: tuple[int, ...],
        num_output_tokens: int,
        canvas_length: int,
    ) -> None:
        """A request (re)joins: its canvas index is the commits it already has (every
        commit but a request's last is a full canvas). Unseeded requests draw a seed."""
        self.by_req[req_id] = CanvasState(
            seed=seed if seed is not None else random.getrandbits(63),
            eos_token_ids=eos_token_ids,
            canvas_index=-(-num_output_tokens // canvas_length),
        )

    def forget(self, req_id: str) -> None:
        self.by_req.pop(req_id, None)

    def __getitem__(self, req_id: str) -> CanvasState:
        return self.by_req[req_id]

    def __len__(self) -> int:
        return len(self.by_req)


@dataclass(slots=True)
class DenoiseMetadata:
    """The `sample` hook's `metadata` for a denoising step of `R` requests (row order of
    the logits `[R, L, V]`): canvas `[R, L]`, step index `[R]`, stopping state, and per
    request its seed, canvas index and EOS ids (empty under `ignore_eos`)."""

    req_ids: list[str]
    canvas: torch.Tensor
    step_index: torch.Tensor
    prev_argmax: torch.Tensor
    stable_run: torch.Tensor
    seeds: list[int]
    canvas_indices: list[int]
    eos_token_ids: list[tuple[int, ...]]


@dataclass(slots=True)
class DenoiseSamplerOutput:
    """What a denoising sampler returns from `sample`, all `[R, ...]`: the next canvas, the
    processed logits (next self-conditioning input), the argmax canvas, the stopping run,
    the commit flags, and `committed[r]`: the committed tokens (argmax canvas trimmed after
    its first EOS) or `[]` when row r's canvas goes on."""

    canvas: torch.Tensor
    processed_logits: torch.Tensor
    argmax_canvas: torch.Tensor
    stable_run: torch.Tensor
    commit: torch.Tensor
    committed: list[list[int]]


@dataclass(slots=True)
class InitialCanvasMetadata:
    """The `sample` hook's `metadata` asking the denoising sampler for the initial random
    canvases `[R, L]` of requests starting a canvas (it owns every draw: keyed by (seed,
    canvas index, step -1)); `logits` is then an empty tensor on the model's device."""

    seeds: list[int]
    canvas_indices: list[int]
    canvas_length: int
    vocab_size: int
