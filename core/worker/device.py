"""The torch device a config's `model.device` names."""

from __future__ import annotations

import torch

from tandem.schema.config import ConfigError


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when torch sees a GPU, else the CPU; `cuda` without a GPU is refused
    naming the setting."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device: cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)
