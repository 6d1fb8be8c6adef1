"""Choosing the `StepModel` a config asks for."""

from __future__ import annotations

from tandem.core.config import ConfigError, EngineConfig
from tandem.core.worker.model_runner import StepModel
from tandem.core.worker.scripted_model import ScriptedModel

SCRIPTED = "scripted"


def load_step_model(config: EngineConfig) -> StepModel:
    """Build the model for `config.model.model` with a paged cache of `cache.num_kv_blocks`."""
    num_blocks = config.cache.num_kv_blocks
    if num_blocks is None:
        raise ConfigError("cache.num_kv_blocks must be resolved before the model is loaded")
    if config.model.model == SCRIPTED:
        assert config.model.vocab_size is not None
        return ScriptedModel(
            vocab_size=config.model.vocab_size,
            num_blocks=num_blocks,
            block_size=config.cache.block_size,
        )
    import torch

    from tandem.core.worker.cpu_kernels import paged_decode_kernel
    from tandem.core.worker.hf_model import HFStepModel, resolve_dtype
    from tandem.core.worker.model_files import resolve_model_dir

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(config.model.dtype, device)
    use_kernel = (
        config.model.attention == "auto" and device.type == "cpu" and dtype == torch.float32
    )
    return HFStepModel(
        model_dir=resolve_model_dir(config.model.model),
        dtype=dtype,
        num_blocks=num_blocks,
        block_size=config.cache.block_size,
        device=device,
        decode_kernel=paged_decode_kernel() if use_kernel else None,
    )
