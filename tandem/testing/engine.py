"""Building engines on the scripted model and computing what they must produce."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore
from tandem.core.executor import Executor
from tandem.core.outputs import EngineCoreOutput
from tandem.core.request import Request
from tandem.schema.config import EngineConfig
from tandem.schema.sampling_params import SamplingParams
from tandem.stack_file import load_config
from tandem.testing.scripted_model import scripted_next_token

if TYPE_CHECKING:
    from tandem.llm import LLM


#: The scripted engines' defaults: small, synchronous, invariants checked every step.
SCRIPTED_DEFAULTS: dict[str, Any] = {
    "model": "scripted",
    "max_model_len": 256,
    "block_size": 4,
    "check_invariants": True,
    "async_scheduling": False,
}


def scripted_config(**overrides: Any) -> EngineConfig:
    """A resolved config for the scripted model with invariant checks on.

    Defaults are small (vocab 128, max_model_len 256, block_size 4); keywords override any
    field by name, e.g. `num_kv_blocks=16, async_scheduling=True`.
    """
    return resolve_config(load_config(None, **{**SCRIPTED_DEFAULTS, **overrides}))


def make_scripted_llm(**overrides: Any) -> LLM:
    """An `LLM` on the scripted model, with `scripted_config`'s defaults and overrides."""
    from tandem.llm import LLM

    return LLM(**{**SCRIPTED_DEFAULTS, **overrides})


def make_scripted_engine(executor: Executor | None = None, **overrides: Any) -> EngineCore:
    """An `EngineCore` on the scripted model (see `scripted_config` for the defaults)."""
    return EngineCore(scripted_config(**overrides), executor=executor)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    eos_token_id: int | None = 1,
    priority: int = 0,
    arrival_time: float | None = None,
    **params: Any,
) -> Request:
    """A request with greedy `SamplingParams(**params)` unless `temperature` is given."""
    params.setdefault("temperature", 0.0)
    kwargs: dict[str, Any] = {}
    if arrival_time is not None:
        kwargs["arrival_time"] = arrival_time
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(**params),
        eos_token_id=eos_token_id,
        priority=priority,
        **kwargs,
    )


def expected_scripted_output(
    prompt: list[int],
    params: SamplingParams,
    vocab_size: int,
    eos_token_id: int | None,
    max_model_len: int,
) -> tuple[list[int], str]:
    """The greedy tokens and finish reason the scripted model must give, computed without
    the engine: the same stop rules as `check_stop`, one token at a time."""
    history = list(prompt)
    out: list[int] = []
    while True:
        token = scripted_next_token(history, vocab_size)
        if len(out) < params.min_tokens:
            blocked = set(params.stop_token_ids)
            if not params.ignore_eos and eos_token_id is not None:
                blocked.add(eos_token_id)
            if token in blocked:  # the sampler masks them: the next best scripted logit wins
                ripple = [(token * 131 + v * 71) % 193 for v in range(vocab_size)]
                token = max(
                    (v for v in range(vocab_size) if v not in blocked),
                    key=lambda v: (ripple[v], -v),
                )
        history.append(token)
        out.append(token)
        if len(out) < params.min_tokens:
            if len(history) >= max_model_len:
                return out, "length"
            continue
        if not params.ignore_eos and token == eos_token_id:
            return out, "stop"
        if token in params.stop_token_ids:
            return out, "stop"
        if len(history) >= max_model_len or len(out) >= params.max_tokens:
            return out, "length"


def collect_outputs(
    engine: EngineCore, max_steps: int = 100_000
) -> dict[str, tuple[list[int], str | None]]:
    """Step until idle; per request, the concatenated tokens and the finish reason.

    Fails if a request gets output after it finished (a duplicated or late token).
    """
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    outputs: list[EngineCoreOutput] = engine.run_until_idle(max_steps)
    for out in outputs:
        if reasons.get(out.request_id) is not None:
            raise AssertionError(f"{out.request_id}: output after it finished: {out}")
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        reasons[out.request_id] = out.finish_reason
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}
