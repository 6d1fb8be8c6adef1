"""A transformers causal LM as a `StepModel`: HF modules, tandem's paged attention.

The model's own attention modules compute projections and RoPE; the registered
`tandem_paged` function writes K/V into the paged pools and attends. Logits are computed
only at the positions that sample (`FlatBatch.logits_indices`).

A rank of several (tensor- or pipeline-parallel) over safetensors weights reads only its
share of the checkpoint (`checkpoint_shards`): the HF model is then a skeleton built without
weights, whose modules get real parameters only where the rank keeps them as they are.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tandem.core.worker import parallel_state
from tandem.core.worker.draft_context import DraftTarget
from tandem.core.worker.flat_batch import FlatBatch
from tandem.core.worker.parallel_state import RankInfo, tp_all_gather
from tandem.core.worker.pipeline import PipelineLink, stage_layers
from tandem.models.awq_gptq_weights import PrequantizedShards, prequantized_shards
from tandem.models.checkpoint_shards import CheckpointShards, checkpoint_bytes, safetensors_files
from tandem.models.cpu_kernels import KERNEL_POOL_DTYPES, PagedDecodeKernel
from tandem.models.fused_decoder import FusedDecoder, float32_compute, fused_linear
from tandem.models.gguf_weights import GGUFFloats, GGUFShards, gguf_source
from tandem.models.linear_choice import Linear, cpu_bf16_linear, cpu_f32_linear
from tandem.models.model_dtype import (  # noqa: F401 - re-exported
    DTYPES,
    kv_bytes_per_token,
    resolve_dtype,
)
from tandem.models.packed_linear import PackedLinear
from tandem.models.paged_attention import build_metadata, hf_attention_name
from tandem.models.quant_linear import LinearQuantization, QuantEmbedding, QuantLinear
from tandem.models.tensor_parallel import check_divisible, kv_heads_per_rank, vocab_shard
from tandem.models.weight_release import (
    own_remaining_parameters,
    release_parameters,
    return_freed_memory,
)

logger = logging.getLogger("tandem.model")


def _plain_lm_head(causal_lm: torch.nn.Module) -> PackedLinear:
    """The LM head over the HF module's own weight (the same storage, no copy)."""
    head = causal_lm.lm_head
    return PackedLinear(head.weight, head.bias, pack=False)


def _take_bf16_lm_head(causal_lm: torch.nn.Module) -> Linear:
    """bfloat16 on CPU: the head as a float32-in/out linear over its own bfloat16 copy
    (`cpu_bf16_linear`); an untied head's parameter is released, a tied one stays the
    embedding's table (the same two copies as the float32 path keeps)."""
    head = causal_lm.lm_head
    tied = head.weight is causal_lm.get_input_embeddings().weight
    linear = cpu_bf16_linear(head.weight, head.bias)
    if not tied:
        release_parameters([head])
    own_remaining_parameters(causal_lm)
    return linear


def _take_lm_head(causal_lm: torch.nn.Module) -> PackedLinear | Linear:
    """The LM head, packed for the panel GEMM (`cpu_f32_linear`) or else for oneDNN where
    it can be, after the fused decoder took the layers; what the model still holds then becomes its own memory (`weight_release`).

    An untied head keeps one copy: the packed one (the HF parameter is released; a drafter
    that needs rows of it unpacks them, `PackedLinear.dense_weight`), or the HF parameter
    itself where oneDNN cannot pack. A head tied to the embedding is packed too and the
    embedding keeps the plain table for its lookups, as vLLM-CPU does (its LM head keeps
    the weight beside a oneDNN handle): the packed LM-head GEMM took 0.74-0.88x the time of
    `split_linear` on the plain weight at 1 and at 64 rows (medians, one and two threads).
    """
    if float32_compute(causal_lm):
        return _take_bf16_lm_head(causal_lm)
    head = causal_lm.lm_head
    tied = head.weight is causal_lm.get_input_embeddings().weight
    panel = cpu_f32_linear(head.weight, head.bias, prefill_copy=False)  # its own copy
    if panel is not None:
        if not tied:
            release_parameters([head])
        own_remaining_parameters(causal_lm)
        return panel
    packed = PackedLinear(head.weight, head.bias, pack=True)
    if packed.packed is not None:
        if packed.bias is not None:
            packed.bias = packed.bias.clone()  # not a view of the checkpoint's mapping
        if not tied:
            release_parameters([head])
    own_remaining_parameters(causal_lm)
    return packed if packed.packed is not None else _plain_lm_head(causal_lm)


def _take_quantized_lm_head(causal_lm: torch.nn.Module, quant: LinearQuantization) -> Linear:
    """`model.quantization` int8 / int4: the LM head quantized (`quant.quantize_head`); an
    untied head's parameter is released, a tied one stays the embedding's float table."""
    head = causal_lm.lm_head
    tied = head.weight is causal_lm.get_input_embeddings().weight
    linear = QuantLinear(quant.quantize_head(head.weight), head.bias)
    if not tied:
        release_parameters([head])
    own_remaining_parameters(causal_lm)
    return linear


def _lm_head_rows(
    causal_lm: torch.nn.Module, rank: RankInfo, checkpoint: CheckpointShards | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's vocabulary rows of the LM head's weight and bias: cut from the HF head
    (`tensor_parallel.vocab_shard`), or read from the checkpoint (the embedding's tensor
    for a head tied to it: such a checkpoint has no `lm_head.weight`)."""
    head, r, n = causal_lm.lm_head, rank.tp_rank, rank.tp_size
    if checkpoint is not None:
        names = {id(p): name for name, p in causal_lm.named_parameters()}  # tied: embedding's
        weight = checkpoint.vocab_rows(names[id(head.weight)], r, n)
        bias = checkpoint.vocab_rows(names[id(head.bias)], r, n) if head.bias is not None else None
        return weight, bias
    with torch.no_grad():
        weight = vocab_shard(head.weight, r, n)
        bias = vocab_shard(head.bias[:, None], r, n)[:, 0] if head.bias is not None else None
    return weight, bias


def _take_lm_head_shard(
    causal_lm: torch.nn.Module,
    rank: RankInfo,
    checkpoint: CheckpointShards | None = None,
    quant: LinearQuantization | None = None,
) -> Linear:
    """This rank's vocabulary rows of the LM head (`_lm_head_rows`), as the decoder's own
    linears are built (quantized as one rank's head is under `quant.at_load`: by rows, so
    each rank holds exactly its rows of it); the HF head and embedding are released (the
    fused decoder holds its own rows of the embedding: `VocabParallelEmbedding`)."""
    head = causal_lm.lm_head
    weight, bias = _lm_head_rows(causal_lm, rank, checkpoint)
    if quant is not None and quant.at_load and weight.device.type == "cpu":
        linear: Linear = QuantLinear(quant.quantize_head(weight), bias)
    else:
        linear = fused_linear(weight, bias, float32_compute(causal_lm))
    release_parameters([head, causal_lm.get_input_embeddings()])  # the decoder has its rows
    own_remaining_parameters(causal_lm)
    return linear


def _skeleton(model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model built from its config without weights: every parameter a meta tensor
    (tied as transformers ties them), the buffers (the rotary module's) real, on `device`.
    The Llama family gets `light_skeleton.SkeletonCausalLM` (no transformers model classes
    imported: about 98 MB less resident memory), any other model type transformers' class."""
    from tandem.models.light_skeleton import SKELETON_MODEL_TYPES, SkeletonCausalLM
    from tandem.models.model_files import load_hf_config

    config = load_hf_config(model_dir)
    if config.model_type in SKELETON_MODEL_TYPES:
        model: torch.nn.Module = SkeletonCausalLM(config, dtype)
    else:
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=hf_attention_name()
            )
        model.tie_weights()
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            setattr(module, name, buf.to(device))
    return model.eval()


def _read_kept_modules(
    causal_lm: torch.nn.Module,
    checkpoint: CheckpointShards | GGUFFloats,
    rank: RankInfo,
    skip: tuple[torch.nn.Module, ...] = (),
) -> None:
    """Real parameters, read whole, for the skeleton's modules this rank keeps as they are:
    the final norm on the last stage; with one tensor-parallel rank, the embedding on the
    first stage and the LM head on the last (the embedding itself when tied). With more,
    the fused decoder and the LM head read their own vocabulary rows; the layers are read
    by the fused decoder. Modules in `skip` are left as they are (a GGUF's quantized
    embedding and head, `_read_quantized_table`)."""
    first, last = rank.pp_rank == 0, rank.pp_rank == rank.pp_size - 1
    embedding, head = causal_lm.get_input_embeddings(), causal_lm.lm_head
    tied = head.weight is embedding.weight
    keep = [causal_lm.model.norm] if last else []
    if rank.tp_size == 1 and (first or (last and tied)):
        keep.append(embedding)
    if rank.tp_size == 1 and last and not tied:
        keep.append(head)
    names = {module: name for name, module in causal_lm.named_modules()}
    for module in (m for m in keep if m not in skip):
        for attr, _ in list(module.named_parameters(recurse=False)):
            tensor = checkpoint.rows(f"{names[module]}.{attr}")
            setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))
    if tied:
        head.weight = embedding.weight


def _read_quantized_table(
    causal_lm: torch.nn.Module, shards: GGUFShards, rank: RankInfo
) -> QuantLinear | None:
    """One rank over a GGUF: the embedding and the LM head, where their tensors are of kept
    types, quantized (the embedding a `QuantEmbedding` over the head's table when tied;
    the rest is read as float by `_read_kept_modules`). Returns the quantized LM head, or
    None (the head stays float)."""
    embedding, head = causal_lm.get_input_embeddings(), causal_lm.lm_head
    tied = head.weight is embedding.weight
    names = {module: name for name, module in causal_lm.named_modules()}
    table_name, head_name = f"{names[embedding]}.weight", f"{names[head]}.weight"
    one_rank = rank.tp_size == 1 and rank.pp_size == 1
    quantized_table = one_rank and shards.is_quantized(table_name)
    quantized_head = one_rank and (quantized_table if tied else shards.is_quantized(head_name))
    skip = ((embedding,) if quantized_table else ()) + ((head,) if quantized_head else ())
    _read_kept_modules(causal_lm, shards.float_reader(), rank, skip)
    table = QuantLinear(shards.quantized(table_name)) if quantized_table else None
    if table is not None:
        causal_lm.set_input_embeddings(QuantEmbedding(table, embedding.weight.dtype))
    if not quantized_head:
        return None
    if tied:
        return table
    bias = shards.floats.rows(f"{names[head]}.bias") if head.bias is not None else None
    return QuantLinear(shards.quantized(head_name), bias)


def _load_gguf_kept(
    model_dir: Path, dtype: torch.dtype, device: torch.device, rank: RankInfo
) -> tuple[torch.nn.Module, GGUFShards, QuantLinear | None] | None:
    """A GGUF-converted directory on the CPU: a skeleton whose layers (and, on one rank, the
    embedding and LM head) come quantized from the GGUF (`gguf_weights`), the rest as float
    from the converted copy. None when the directory records no GGUF or nothing in it is
    of a kept type."""
    source = gguf_source(model_dir)
    if source is None or device.type != "cpu" or not safetensors_files(model_dir):
        return None
    skeleton = _skeleton(model_dir, dtype, device)
    names = list(skeleton.state_dict(keep_vars=True))
    shards = GGUFShards(source, CheckpointShards(model_dir, dtype, device), skeleton.config, names)
    if not shards.kept_types:
        return None
    head = _read_quantized_table(skeleton, shards, rank)
    return_freed_memory()  # the table's unpacked temporaries (the largest tensor)
    return skeleton, shards, head


def _load_prequantized(
    model_dir: Path, dtype: torch.dtype, device: torch.device, rank: RankInfo, mode: str
) -> tuple[torch.nn.Module, PrequantizedShards] | None:
    """An AWQ / GPTQ checkpoint (`awq_gptq_weights`): a skeleton whose layers the fused
    decoder reads from the packed tensors (kept quantized, or dequantized under `mode`
    `none` or off the CPU), the rest as float. None for any other checkpoint."""
    from tandem.models.model_files import load_hf_config

    shards = prequantized_shards(model_dir, load_hf_config(model_dir), mode, dtype, device)
    if shards is None:
        return None
    skeleton = _skeleton(model_dir, dtype, device)
    _read_kept_modules(skeleton, shards, rank)  # type: ignore[arg-type]
    return skeleton, shards


def _load_causal_lm(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    rank: RankInfo,
    layer_by_layer: bool = False,
) -> tuple[torch.nn.Module, CheckpointShards | None]:
    """The HF model on `device` and, where this rank reads only its share, the reader the
    fused decoder and the LM head read the rest of it from. A rank of several over
    safetensors weights that name every parameter gets a skeleton (`_skeleton`) with the
    modules it keeps as they are read (`_read_kept_modules`); so does one rank with
    `layer_by_layer` (weights quantized at load: each layer is read, quantized and dropped,
    so the float model is never whole in memory); else the whole model loads."""
    from transformers import AutoModelForCausalLM

    several = rank.tp_size > 1 or rank.pp_size > 1
    if (several or layer_by_layer) and safetensors_files(model_dir):
        checkpoint = CheckpointShards(model_dir, dtype, device)
        skeleton = _skeleton(model_dir, dtype, device)
        missing = [n for n, _ in skeleton.named_parameters() if not checkpoint.has(n)]
        if not missing:
            _read_kept_modules(skeleton, checkpoint, rank)
            return skeleton, checkpoint
        logger.warning(
            "%s: the checkpoint does not name %s (of %d parameters): every rank loads the "
            "whole model and keeps its share",
            model_dir,
            missing[0],
            len(missing),
        )
    loaded = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation=hf_attention_name()
    )
    return loaded.to(device).eval(), None


class HFStepModel:
    """With `keep_hidden_states` set (by a runner whose drafter reads them), `forward` also
    leaves the last hidden states after the final norm, `[T, hidden]` for every flattened
    token, in `last_hidden_states` (the runner takes them right after the call).

    With `fused` (the default) the model holds one copy of each weight: the fused decoder
    and the LM head take the HF layers' and the untied head's parameters (released, meta
    tensors), so `self.model`'s decoder layers cannot run; the embedding, rotary module and
    final norm stay usable (drafters read them). `fused=False` keeps the HF modules whole."""

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        fused: bool = True,
        decode_kernel: PagedDecodeKernel | None = None,
        layer_partition: list[int] | None = None,
        quantization: LinearQuantization | None = None,
    ) -> None:
        """`decode_kernel` (CPU, float32 or bfloat16) attends decodes in place; the key pools
        are then laid out for it, transposed per block. bfloat16 on CPU keeps weights and
        the KV pools in bfloat16 and computes in float32 (`fused_decoder.float32_compute`)."""
        from tandem.models.model_files import quiet_loading

        self.device = device
        self.block_size = block_size
        #: This rank's place; with more than one tensor-parallel rank every layer, the KV
        #: pool and the LM head hold this rank's shard (`tensor_parallel`).
        self.rank = parallel_state.current()
        quant = quantization or LinearQuantization()
        #: The LM head kept quantized from a GGUF (None: built from the HF head).
        self._gguf_head: QuantLinear | None = None
        with quiet_loading():
            kept = (
                _load_gguf_kept(model_dir, dtype, device, self.rank) if quant.keeps_gguf else None
            )
            prequantized = (
                _load_prequantized(model_dir, dtype, device, self.rank, quant.mode)
                if kept is None
                else None
            )
            if kept is not None:
                self.model, checkpoint, self._gguf_head = kept
            elif prequantized is not None:
                if not fused:
                    raise ValueError(
                        "an AWQ / GPTQ checkpoint needs the fused decoder (fused=True)"
                    )
                self.model, checkpoint = prequantized
            else:
                self.model, checkpoint = _load_causal_lm(
                    model_dir, dtype, device, self.rank, quant.at_load and fused
                )
        #: Which weights are quantized, as `model.quantization` resolved for this model.
        self.quantization = (
            "gguf:" + ",".join(sorted(checkpoint.kept_types))
            if isinstance(checkpoint, GGUFShards)
            else checkpoint.label
            if isinstance(checkpoint, PrequantizedShards)
            else quant.mode
            if quant.at_load
            else "none"
        )
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        tp_size = self.rank.tp_size
        if tp_size > 1 and not fused:
            raise ValueError("tensor parallelism needs the fused decoder (fused=True)")
        check_divisible(cfg, tp_size)
        #: Pipeline stages: this stage's layers and its link to the neighbouring stages.
        self.link = PipelineLink(self.rank) if self.rank.pp_size > 1 else None
        stage = stage_layers(
            cfg.num_hidden_layers, self.rank.pp_size, self.rank.pp_rank, layer_partition
        )
        if self.link is not None and not fused:
            raise ValueError("pipeline parallelism needs the fused decoder (fused=True)")
        self.fused = (
            FusedDecoder(self.model, self.rank, stage, self.link, checkpoint, quant)
            if fused
            else None
        )
        #: Whether this rank computes logits (the last pipeline stage; every rank without).
        self.has_logits = self.link is None or self.link.is_last
        self.lm_head = self._take_head(fused, checkpoint, quant)
        #: Bytes of checkpoint tensors this rank read (the files' dtype): its share, or the
        #: whole checkpoint where it loaded the whole model (`Worker.describe` shows it).
        self.bytes_read = (
            checkpoint.close() if checkpoint is not None else checkpoint_bytes(model_dir)
        )
        if quant.at_load or isinstance(checkpoint, (GGUFShards, PrequantizedShards)):
            return_freed_memory()  # the float / unpacked temporaries of quantizing
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if decode_kernel is not None and (dtype not in KERNEL_POOL_DTYPES or device.type != "cpu"):
            raise ValueError("the CPU decode kernel needs float32 or bfloat16 on the CPU")
        self.decode_kernel = decode_kernel
        self.keep_hidden_states = False
        self.last_hidden_states: torch.Tensor | None = None
        kv_heads = kv_heads_per_rank(cfg, tp_size)
        value_shape = (num_blocks, block_size, kv_heads, head_dim)
        key_shape = (
            (num_blocks, kv_heads, head_dim, block_size)
            if decode_kernel is not None
            else value_shape
        )
        # Allocated, not filled: zero-filling a 4 GiB pool costs seconds at every start (and
        # commits every page). Attention reads only slots its request wrote, or masks the
        # rest before the softmax (see paged_attention), so the garbage never reaches a token.
        self.kv_caches = [
            (
                torch.empty(key_shape, dtype=dtype, device=device),
                torch.empty(value_shape, dtype=dtype, device=device),
            )
            for _ in stage
        ]

    def _take_head(
        self,
        fused: bool,
        checkpoint: CheckpointShards | None,
        quant: LinearQuantization,
    ) -> PackedLinear | Linear | None:
        """The LM head this rank computes logits with, after the fused decoder took the
        layers: None on a stage before the last (its HF head is released, and the embedding
        too under tensor parallelism: the fused decoder holds its own rows)."""
        model, tp_size = self.model, self.rank.tp_size
        if not self.has_logits:
            embedding = model.get_input_embeddings()
            if tp_size > 1:
                release_parameters([model.lm_head, embedding])
            elif model.lm_head.weight is not embedding.weight:
                release_parameters([model.lm_head])
            own_remaining_parameters(model)
            return None
        if tp_size > 1:
            return _take_lm_head_shard(model, self.rank, checkpoint, quant)
        if self._gguf_head is not None:
            return self._gguf_head
        if fused and quant.at_load and model.lm_head.weight.device.type == "cpu":
            return _take_quantized_lm_head(model, quant)
        return _take_lm_head(model) if fused else _plain_lm_head(model)

    @torch.inference_mode()
    def forward(self, batch: FlatBatch) -> torch.Tensor | None:
        """The logits at `batch.logits_indices`, float32 `[S, V]`; None on a pipeline stage
        before the last (it sends its residual stream to the next stage)."""
        qsl = batch.query_start_loc.tolist()
        seq_lens = batch.seq_lens.tolist()
        starts = [seq_lens[r] - (qsl[r + 1] - qsl[r]) for r in range(len(seq_lens))]
        meta = build_metadata(
            self.kv_caches,
            batch.slot_mapping,
            qsl,
            starts,
            seq_lens,
            batch.block_tables,
            self.block_size,
            self.decode_kernel,
        )
        if self.fused is not None:
            hidden = self.fused.forward(batch.input_ids, batch.positions, meta)
        else:
            hidden = self.model.model(
                input_ids=batch.input_ids[None],
                position_ids=batch.positions[None],
                use_cache=False,
                paged=meta,
            ).last_hidden_state[0]
        if hidden is None or self.lm_head is None:
            return None
        if self.keep_hidden_states:
            self.last_hidden_states = hidden
        sampled = hidden.index_select(0, batch.logits_indices)
        logits = self.lm_head(sampled).float()
        if self.rank.tp_size > 1:  # every rank gets the whole vocabulary's logits
            logits = tp_all_gather(logits)[:, : self.vocab_size]
        return logits.contiguous()

    def draft_target(self) -> DraftTarget:
        """What a model-based drafter reads of this model (`models/draft_target.py`)."""
        from tandem.models.draft_target import hf_draft_target

        return hf_draft_target(self)
