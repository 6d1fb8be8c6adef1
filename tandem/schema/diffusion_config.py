"""The `diffusion` config section (vLLM's `diffusion_config`) and which request fields apply.

Every field left `None` takes the model's default: its loader fills them in
`resolve_limits` (DiffusionGemma: its generation config; the scripted diffusion model: its
own). A `diffusion` section on a model that is not a diffusion model is an error
(`tandem.config_resolution`).

Sampling parameters of a diffusion request (`diffusion_request_problems`):

- apply: `seed` (the per-request generator is keyed by (seed, canvas index, step)),
  `max_tokens`, `stop_token_ids`, `stop` (strings, on the detokenised committed text),
  `ignore_eos` (the runner then keeps tokens after an EOS), `include_stop_str_in_output`,
  the detokenisation and output-kind fields: all on *committed* tokens;
- ignored: `temperature` (the linear schedule `t_min`..`t_max` rules every step);
- `n > 1` applies too: the front door runs n requests with seeds seed + j;
- refused, naming the field: `top_p`, `top_k`, `min_p`, `min_tokens`, the three
  penalties, `logprobs`, `prompt_logprobs`, `logit_bias`, `allowed_token_ids`, `bad_words`,
  `structured_outputs` (the denoising sampler implements none of them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from tandem.schema.sampling_params import SamplingParams

Acceptance = Literal["entropy", "confidence", "top_k"]


class DiffusionConfig(BaseModel):
    """Block-diffusion generation: canvas length, denoising schedule, acceptance, stopping."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    canvas_length: int | None = None
    max_denoising_steps: int | None = None
    t_min: float | None = None
    t_max: float | None = None
    entropy_bound: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
    acceptance: Acceptance | None = None
    top_k: int | None = None

    @field_validator("canvas_length", "max_denoising_steps", "top_k")
    @classmethod
    def _positive(cls, value: int | None, info: object) -> int | None:
        if value is not None and value <= 0:
            name = getattr(info, "field_name", "value")
            raise ValueError(f"diffusion.{name}: must be >= 1, got {value}")
        return value

    @field_validator("t_min", "t_max", "entropy_bound", "confidence_threshold")
    @classmethod
    def _non_negative(cls, value: float | None, info: object) -> float | None:
        if value is not None and value < 0:
            name = getattr(info, "field_name", "value")
            raise ValueError(f"diffusion.{name}: must be >= 0, got {value}")
        return value

    def fill_defaults(self, defaults: DiffusionConfig) -> None:
        """Set every field left None to `defaults`' value (the model's)."""
        for name in type(self).model_fields:
            if getattr(self, name) is None:
                setattr(self, name, getattr(defaults, name))

    def check_resolved(self) -> None:
        """Raise ValueError naming the field when a resolved section is inconsistent."""
        missing = [n for n in type(self).model_fields if n != "top_k" and getattr(self, n) is None]
        if missing:
            raise ValueError(f"diffusion.{missing[0]}: not set and the model gives no default")
        assert self.t_min is not None and self.t_max is not None
        if self.t_max <= self.t_min:
            raise ValueError(f"diffusion.t_max: must exceed t_min ({self.t_min}), got {self.t_max}")
        if self.acceptance == "top_k" and self.top_k is None:
            raise ValueError("diffusion.top_k: required with acceptance 'top_k'")


_DEFAULTS = SamplingParams()

#: (field, "does not apply" test) for every refused SamplingParams field.
_REFUSED = (
    ("top_p", lambda p: p.top_p != _DEFAULTS.top_p),
    ("top_k", lambda p: p.top_k not in (-1, 0)),
    ("min_p", lambda p: p.min_p != _DEFAULTS.min_p),
    ("min_tokens", lambda p: p.min_tokens > 0),
    ("presence_penalty", lambda p: p.presence_penalty != 0.0),
    ("frequency_penalty", lambda p: p.frequency_penalty != 0.0),
    ("repetition_penalty", lambda p: p.repetition_penalty != 1.0),
    ("logprobs", lambda p: p.logprobs is not None),
    ("prompt_logprobs", lambda p: p.prompt_logprobs is not None),
    ("logit_bias", lambda p: bool(p.logit_bias)),
    ("allowed_token_ids", lambda p: p.allowed_token_ids is not None),
    ("bad_words", lambda p: bool(p.bad_words) or bool(p.bad_words_token_ids)),
    ("structured_outputs", lambda p: p.structured_outputs is not None),
)


def diffusion_request_problems(params: SamplingParams) -> list[str]:
    """One message per sampling field a diffusion model cannot honour (see the module
    docstring), each naming the field."""
    return [
        f"{name}: does not apply to a diffusion model (the denoising sampler does not "
        f"implement it); got {getattr(params, name)!r}"
        for name, refused in _REFUSED
        if refused(params)
    ]
