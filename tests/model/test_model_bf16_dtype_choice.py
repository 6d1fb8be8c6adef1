"""Device and dtype resolution: auto never picks bfloat16 on CPU; an explicit bfloat16
without bf16 units is kept (the user asked) but logged once as emulated; `model.device`
picks where the model runs and refuses cuda without a GPU."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tandem import LLM
from tandem.core.worker.device import resolve_device
from tandem.models import cpu_features
from tandem.models.hf_model import resolve_dtype
from tandem.schema.config import ConfigError

CPU = torch.device("cpu")


def test_flags_parse_the_first_processor() -> None:
    info = "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpu_features.cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_features.has_bf16_units(frozenset({"avx2", "avx512_bf16"}))
    assert not cpu_features.has_bf16_units(frozenset({"avx2", "avx512f"}))
    assert cpu_features.cpu_flags("no flags here") == frozenset()


def test_auto_is_float32_on_cpu_and_bf16_on_cuda() -> None:
    assert resolve_dtype("auto", CPU) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16


@pytest.mark.parametrize("units", [False, True])
def test_explicit_bf16_logs_once_when_emulated(
    units: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_features, "has_bf16_units", lambda flags=None: units)
    cpu_features.warn_if_bf16_emulated.cache_clear()
    with caplog.at_level(logging.WARNING, logger="tandem.worker"):
        assert resolve_dtype("bfloat16", CPU) is torch.bfloat16
        assert resolve_dtype("bfloat16", CPU) is torch.bfloat16
    emulated = [r for r in caplog.records if "emulated" in r.getMessage()]
    assert len(emulated) == (0 if units else 1)
    if not units:
        assert "model.dtype" in emulated[0].getMessage()
    cpu_features.warn_if_bf16_emulated.cache_clear()


def test_device_auto_follows_torch_and_cpu_is_always_there() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu").type == "cpu"


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a GPU is present here, so device=cuda is valid and there is no refusal to check",
)
def test_cuda_without_a_gpu_is_refused_naming_the_setting(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"model\.device: cuda"):
        LLM(model=str(tiny_models["llama"]), device="cuda", max_model_len=32)


def test_device_cpu_keeps_the_model_on_the_cpu(tiny_models: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_models["llama"]), device="cpu", max_model_len=32, num_kv_blocks=8)
    try:
        model = llm.engine.executor.worker.model
        assert model.device.type == "cpu"
        assert all(k.device.type == "cpu" and k.dtype is torch.float32 for k, _ in model.kv_caches)
    finally:
        llm.engine.shutdown()
