"""The model loader for DiffusionGemma directories (a block-diffusion model, `is_diffusion`).

Declares what `core/worker/model_loader.py` asks of a loader, plus `is_diffusion` (the
config resolution then builds the diffusion stack) and `claims(model_dir)`: whether a
directory holds a DiffusionGemma checkpoint (`config.json` `model_type` `diffusion_gemma`).
`model_loader_for` asks `claims` before falling back to the HF loader, so
`LLM(model=<DiffusionGemma dir>)` reaches this loader (entry point `diffusion-gemma`).

- `resolve_limits`: vocabulary, EOS and max_model_len from the *text* config (the top-level
  `DiffusionGemmaConfig` has none of them); `num_kv_blocks` from the KV budget divided by
  the per-token bytes summed over the layer groups (`diffusion_gemma.kv_bytes_per_token`);
  the `diffusion` section's unset fields from the model: `canvas_length` from its config,
  the schedule and thresholds from its `generation_config.json` over transformers'
  defaults (`DiffusionGemmaGenerationConfig._get_default_generation_params`).
- `load`: `DiffusionGemmaModel` on CUDA in bfloat16 when there is a GPU, else float32 on
  the CPU (`model.dtype: auto`); `model.quantization` int8 / int4 quantize the layers and
  experts at load on the CPU (`diffusion_gemma_quant`; refused elsewhere by
  `hf_loader.linear_quantization`), `auto` means `none` (no GGUF form of this model), and
  `awq` / `gptq` are refused (no such checkpoints of it are read).

Tensor parallelism is supported (`diffusion_gemma_parallel`): `resolve_limits` refuses
sizes that do not split over `parallel.tensor_parallel_size` and sizes the pool from one
rank's KV heads (the KV budget is per rank, as for the autoregressive loader). Pipeline
parallelism is not (no `supports_pipeline_parallel`: the config resolution refuses it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from tandem.schema.config import ConfigError, EngineConfig
from tandem.schema.diffusion_config import DiffusionConfig

MODEL_TYPE = "diffusion_gemma"


def generation_defaults(model_dir: Path, canvas_length: int) -> DiffusionConfig:
    """The model's `diffusion` defaults: transformers' generation defaults, overridden by
    the checkpoint's `generation_config.json` where it sets them."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
    )

    params: dict[str, Any] = DiffusionGemmaGenerationConfig._get_default_generation_params()
    bound = params.pop("sampler_config").entropy_bound
    path = model_dir / "generation_config.json"
    saved: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    sampler = saved.get("sampler_config") or {}
    if sampler.get("entropy_bound") is not None:
        bound = sampler["entropy_bound"]
    fields = (
        "max_denoising_steps",
        "t_min",
        "t_max",
        "stability_threshold",
        "confidence_threshold",
    )
    values = {k: saved[k] if saved.get(k) is not None else params[k] for k in fields}
    return DiffusionConfig(
        canvas_length=canvas_length, entropy_bound=bound, acceptance="entropy", **values
    )


def _device_and_dtype(model: Any) -> tuple[Any, Any]:
    from tandem.models.model_dtype import resolve_device, resolve_dtype

    device = resolve_device(model.device)
    return device, resolve_dtype(model.dtype, device)


def _quantization(config: EngineConfig) -> Any:
    """`model.quantization` for this model (a `LinearQuantization`); ConfigError naming the
    field for `awq` / `gptq`, and (`linear_quantization`) for int8 / int4 off the CPU or
    int4 per channel."""
    from tandem.models.hf_loader import linear_quantization

    mode = config.model.quantization
    if mode in ("awq", "gptq"):
        raise ConfigError(
            f"model.quantization: {mode} reads AWQ / GPTQ checkpoints, which DiffusionGemma "
            "does not have; use auto, none, int8 or int4"
        )
    device, _ = _device_and_dtype(config.model)
    return linear_quantization(config, device)


class DiffusionGemmaLoader:
    """DiffusionGemma from a local transformers directory (module docstring)."""

    model_kinds: ClassVar[tuple[str, ...]] = ("diffusion-gemma",)
    has_tokenizer: ClassVar[bool] = True
    simulatable: ClassVar[bool] = False
    is_diffusion: ClassVar[bool] = True
    #: Heads, MLP columns and experts split across `parallel.tensor_parallel_size` ranks.
    supports_tensor_parallel: ClassVar[bool] = True

    @staticmethod
    def claims(model_dir: Path) -> bool:
        """Whether `model_dir` holds a DiffusionGemma checkpoint."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            return False
        try:
            return json.loads(path.read_text()).get("model_type") == MODEL_TYPE
        except (OSError, ValueError, AttributeError):
            return False

    @classmethod
    def resolve_limits(cls, config: EngineConfig) -> None:
        from transformers import AutoConfig

        from tandem.models.diffusion_gemma import kv_bytes_per_token
        from tandem.models.diffusion_gemma_parallel import check_divisible

        model = config.model
        model_dir = Path(model.model)
        if not cls.claims(model_dir):
            raise ConfigError(f"model.model: {model_dir} is not a DiffusionGemma directory")
        _quantization(config)  # a bad mode for this model fails before anything loads
        hf = AutoConfig.from_pretrained(str(model_dir))
        text = hf.text_config
        tp = config.parallel.tensor_parallel_size
        check_divisible(text, tp)
        model.vocab_size = int(text.vocab_size)
        if model.eos_token_id is None:
            eos = text.eos_token_id
            model.eos_token_id = eos[0] if isinstance(eos, list) else eos
        if model.max_model_len is None:
            model.max_model_len = int(text.max_position_embeddings)
        if config.cache.num_kv_blocks is None:
            _, dtype = _device_and_dtype(model)
            per_block = kv_bytes_per_token(hf, dtype, tp) * config.cache.block_size
            budget = int(config.cache.kv_cache_memory_gib * (1 << 30))
            config.cache.num_kv_blocks = max(1, budget // per_block)
            capacity = config.cache.num_kv_blocks * config.cache.block_size
            model.max_model_len = min(model.max_model_len, capacity)
        if config.diffusion is None:
            config.diffusion = DiffusionConfig()
        config.diffusion.fill_defaults(generation_defaults(model_dir, int(hf.canvas_length)))

    @classmethod
    def load(cls, config: EngineConfig):  # noqa: ANN206 - a DiffusionGemmaModel
        from tandem.models.diffusion_gemma import DiffusionGemmaModel

        assert config.cache.num_kv_blocks is not None
        device, dtype = _device_and_dtype(config.model)
        return DiffusionGemmaModel(
            model_dir=Path(config.model.model),
            dtype=dtype,
            num_blocks=config.cache.num_kv_blocks,
            block_size=config.cache.block_size,
            device=device,
            quantization=_quantization(config),
        )
