"""The Hugging Face model loader: HF directories, `.gguf` files (converted once), hub ids from
the local hub cache, and `default` (the embedded SmolLM2), run paged by `HFStepModel`.
Registered as the `hf` kind in the `tandem.model_loaders` entry-point group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from tandem.core.worker.model_loader import HF_KIND
from tandem.schema.config import ConfigError, EngineConfig

if TYPE_CHECKING:
    from tandem.core.worker.model_runner import StepModel


def linear_quantization(config: EngineConfig, device: Any) -> Any:
    """`model.quantization` for a model on `device`: `int8` / `int4` / `awq` / `gptq` run on
    the CPU only (`ConfigError` naming the field elsewhere); `auto` keeps GGUF and AWQ /
    GPTQ weights quantized on the CPU and means `none` on other devices."""
    from tandem.models.quant_linear import LinearQuantization

    mode = config.model.quantization
    if mode in ("int8", "int4", "awq", "gptq") and device.type != "cpu":
        raise ConfigError(
            f"model.quantization: {mode} runs on the CPU; the model runs on {device.type} "
            "(use quantization: none there)"
        )
    group = config.model.quantization_group_size
    if mode == "int4" and group == 0:
        raise ConfigError(
            "model.quantization_group_size: int4 needs groups of 32, 64 or 128 inputs "
            "(0, one scale per output channel, is for int8)"
        )
    mode = mode if device.type == "cpu" else "none"
    return LinearQuantization(mode, group)


class HFModelLoader:
    """Hugging Face directories, `.gguf` files (converted once), hub ids from the local hub
    cache, and `default` (the embedded SmolLM2): real transformers run paged."""

    model_kinds: ClassVar[tuple[str, ...]] = (HF_KIND,)
    has_tokenizer: ClassVar[bool] = True
    #: Layers split by heads and columns across `parallel.tensor_parallel_size` ranks.
    supports_tensor_parallel: ClassVar[bool] = True
    #: Layers run as consecutive pipeline stages (`pipeline.stage_layers`).
    supports_pipeline_parallel: ClassVar[bool] = True
    simulatable: ClassVar[bool] = False

    @classmethod
    def resolve_limits(cls, config: EngineConfig) -> None:
        """Vocabulary, EOS, max_model_len and the KV pool size from the model's files; the
        model path becomes its resolved directory."""

        from tandem.core.worker.pipeline import stage_layers
        from tandem.models.awq_gptq_weights import check_quantization_mode
        from tandem.models.model_dtype import (
            kv_bytes_per_token,
            resolve_device,
            resolve_dtype,
        )
        from tandem.models.model_files import load_hf_config, resolve_model_dir
        from tandem.models.tensor_parallel import check_divisible, kv_heads_per_rank

        model = config.model
        model_dir = resolve_model_dir(model.model, allow_download=model.allow_download)
        model.model = str(model_dir)
        hf = load_hf_config(model_dir)
        check_quantization_mode(hf, model.quantization)  # AWQ / GPTQ: ConfigError naming both
        check_divisible(hf, config.parallel.tensor_parallel_size)
        parallel = config.parallel
        try:
            stages = [
                stage_layers(
                    hf.num_hidden_layers,
                    parallel.pipeline_parallel_size,
                    s,
                    parallel.pp_layer_partition,
                )
                for s in range(parallel.pipeline_parallel_size)
            ]
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        model.vocab_size = hf.vocab_size
        if model.eos_token_id is None:
            eos = getattr(hf, "eos_token_id", None)
            model.eos_token_id = eos[0] if isinstance(eos, list) else eos
        if model.max_model_len is None:
            model.max_model_len = int(getattr(hf, "max_position_embeddings", 2048))
        if config.cache.num_kv_blocks is None:
            device = resolve_device(model.device)
            # The budget is per rank (as vLLM-CPU's VLLM_CPU_KVCACHE_SPACE): each rank holds
            # its KV heads of its stage's layers; the largest stage sets the pool.
            per_token = kv_bytes_per_token(
                hf,
                resolve_dtype(model.dtype, device),
                kv_heads=kv_heads_per_rank(hf, parallel.tensor_parallel_size),
                layers=max(len(stage) for stage in stages),
            )
            budget = int(config.cache.kv_cache_memory_gib * (1 << 30))
            config.cache.num_kv_blocks = max(1, budget // (per_token * config.cache.block_size))
            capacity = config.cache.num_kv_blocks * config.cache.block_size
            model.max_model_len = min(model.max_model_len, capacity)

    @classmethod
    def load(cls, config: EngineConfig) -> StepModel:
        import torch

        from tandem.models import linear_choice
        from tandem.models.cpu_kernels import paged_decode_kernel
        from tandem.models.hf_model import HFStepModel
        from tandem.models.model_dtype import resolve_device, resolve_dtype
        from tandem.models.model_files import WEIGHT_SUFFIXES, resolve_model_dir

        device = resolve_device(config.model.device)
        dtype = resolve_dtype(config.model.dtype, device)
        model_dir = resolve_model_dir(config.model.model)
        checkpoint_bytes = sum(
            f.stat().st_size for f in model_dir.iterdir() if f.name.endswith(WEIGHT_SUFFIXES)
        )
        linear_choice.configure(config.model.f32_linear, checkpoint_bytes)
        # The decode kernel reads float32 and bfloat16 pools (issue 16 item 3).
        use_kernel = (
            config.model.attention == "auto"
            and device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
        )
        assert config.cache.num_kv_blocks is not None
        return HFStepModel(
            model_dir=model_dir,
            dtype=dtype,
            num_blocks=config.cache.num_kv_blocks,
            block_size=config.cache.block_size,
            device=device,
            decode_kernel=paged_decode_kernel() if use_kernel else None,
            layer_partition=config.parallel.pp_layer_partition,
            quantization=linear_quantization(config, device),
        )
