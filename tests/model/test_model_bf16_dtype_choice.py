"""dtype resolution on CPU: auto never picks bfloat16; an explicit bfloat16 without bf16
units is kept (the user asked) but logged once as emulated."""

from __future__ import annotations

import logging

import pytest
import torch

from tandem.core.worker import cpu_features
from tandem.core.worker.hf_model import resolve_dtype

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
