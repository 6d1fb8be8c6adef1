"""Bad input for diffusion models: errors that name the key."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore
from tandem.core.plugin_manager import PluginConfigError
from tandem.schema.config import ConfigError, EngineConfig
from tandem.schema.sampling_params import SamplingParamsError
from tandem.stack_file import load_config
from tandem.testing.engine import make_request

BASE: dict[str, Any] = {"max_model_len": 32, "block_size": 4, "vocab_size": 16}


def resolve(diffusion: dict[str, Any] | None, **overrides: Any) -> EngineConfig:
    data: dict[str, Any] = {} if diffusion is None else {"diffusion_config": diffusion}
    base = EngineConfig.model_validate(data)
    return resolve_config(load_config(base, **{**BASE, **overrides}))


def test_a_diffusion_section_on_an_autoregressive_model() -> None:
    with pytest.raises(ConfigError, match=r"^diffusion: model 'scripted' is not a diffusion"):
        resolve({"canvas_length": 4}, model="scripted")


@pytest.mark.parametrize("length", [0, -3])
def test_canvas_length_must_be_positive(length: int) -> None:
    with pytest.raises(ValueError, match=r"diffusion\.canvas_length: must be >= 1"):
        resolve({"canvas_length": length}, model="scripted-diffusion")


def test_t_max_must_exceed_t_min() -> None:
    with pytest.raises(ConfigError, match=r"diffusion\.t_max"):
        resolve({"t_min": 0.9, "t_max": 0.5}, model="scripted-diffusion")


def test_drafts_with_a_diffusion_model() -> None:
    base = EngineConfig.model_validate(
        {"speculative": {"method": "ngram", "num_speculative_tokens": 2}}
    )
    with pytest.raises(ConfigError, match=r"^speculative: drafts do not apply"):
        resolve_config(load_config(base, model="scripted-diffusion", **BASE))


def test_a_budget_below_one_canvas() -> None:
    with pytest.raises(ConfigError, match=r"^scheduler\.max_num_batched_tokens"):
        resolve({"canvas_length": 8}, model="scripted-diffusion", max_num_batched_tokens=4)


def test_an_autoregressive_scheduler_on_a_diffusion_model() -> None:
    with pytest.raises(PluginConfigError, match="reference-scheduler is an autoregressive"):
        resolve(
            None,
            model="scripted-diffusion",
            plugins=[{"name": "reference-scheduler"}, {"name": "diffusion-sampler"}],
        )


def test_the_diffusion_scheduler_on_an_autoregressive_model() -> None:
    config = resolve(
        None,
        model="scripted",
        plugins=[{"name": "diffusion-scheduler"}, {"name": "default-sampler"}],
    )
    with pytest.raises(PluginConfigError, match="diffusion-scheduler: needs a diffusion model"):
        EngineCore(config)


def test_the_diffusion_model_resolves_its_stack_and_defaults() -> None:
    config = resolve(None, model="scripted-diffusion", async_scheduling=True)
    names = [e.name for e in config._stack.entries]
    assert names[:3] == ["diffusion-scheduler", "async-scheduler", "diffusion-sampler"]
    assert config.diffusion is not None and config.diffusion.canvas_length == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", 0.5),
        ("repetition_penalty", 1.2),
        ("logprobs", 2),
        ("prompt_logprobs", 1),
        ("top_p", 0.5),
        ("top_k", 3),
        ("min_p", 0.1),
        ("min_tokens", 2),
        ("logit_bias", {3: 1.0}),
        ("allowed_token_ids", [3, 4]),
    ],
)
def test_sampling_fields_that_do_not_apply(field: str, value: Any) -> None:
    engine = EngineCore(resolve(None, model="scripted-diffusion"))
    with pytest.raises(SamplingParamsError, match=rf"request a: {field}: does not apply"):
        engine.add_request(make_request("a", [2, 3], **{field: value}))
    engine.add_request(make_request("b", [2, 3], temperature=0.7, seed=3))  # ignored / applies
