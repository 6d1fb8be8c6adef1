"""A compact forward for Llama-family decoders over a transformers model's own weights.

Same math as the HF modules (RMSNorm, RoPE from the model's rotary module, GQA attention,
SwiGLU MLP; Qwen2's QKV bias, Qwen3's per-head q/k norms), but with the Q, K and V
projections fused into one matmul and gate and up into another, and no per-module Python:
121 linear calls per token for a 30-layer model instead of 211. Linear weights on CPU are
packed once: into 16-column panels for the compiled GEMM (`F32PanelLinear`), or for
oneDNN (`PackedLinear`) where that kernel does not build (`linear_choice`). The
element-wise steps between the linears (residual add + RMS norm, RoPE in place, SiLU *
up) are one compiled kernel each on CPU (`decoder_elementwise`). Where every linear is oneDNN's
bfloat16 GEMM (bfloat16 weights on a CPU with bf16 units), those kernels also write the
GEMMs' bfloat16 inputs and read their bfloat16 outputs (`_layers_bf16`), with the bits of
casting each operand on its own.

The decoder takes the layers' weights: once a layer is built, every parameter of the HF
layer (projections, their biases, the norms) is released (a meta tensor, see
`weight_release`), so the model holds one copy of each (the packed one, or the fused plain
one where oneDNN cannot pack). The HF layers cannot run afterwards; the embedding, the
rotary module and the final norm stay the HF model's own modules (read through them;
`HFStepModel` then moves them off the checkpoint's file mapping, `own_remaining_parameters`).
A rank of several reads its layers' shards from the files instead (`checkpoint_shards`):
the same layers, built by the same code from another `WeightSource`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from tandem.core.worker.parallel_state import RankInfo, tp_all_reduce
from tandem.core.worker.pipeline import PipelineLink
from tandem.models.checkpoint_shards import CheckpointShards, ModuleWeights, WeightSource
from tandem.models.decode_program import DecodeProgram
from tandem.models.decoder_elementwise import (
    Elementwise,
    FusedElementwise,
    RotaryTable,
    TorchElementwise,
    pick_elementwise,
)
from tandem.models.linear_choice import Linear, cpu_bf16_linear, cpu_f32_linear
from tandem.models.packed_linear import PackedLinear
from tandem.models.paged_attention import PagedAttentionMetadata, paged_attention
from tandem.models.quant_linear import LinearQuantization, QuantLinear
from tandem.models.quantized_weight import QuantizedWeight, common_format
from tandem.models.tensor_parallel import (
    VocabParallelEmbedding,
    check_quantized_split,
    kv_heads_per_rank,
    kv_split,
)
from tandem.models.weight_release import release_parameters, return_freed_memory

_TORCH = TorchElementwise()


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(slots=True)
class _Layer:
    layer_idx: int
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    ln_in: torch.Tensor
    ln_post: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def _owned(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of a (small) weight the layer keeps after its HF module is released (in
    `dtype`: float32 norms over bfloat16 weights on the CPU)."""
    return weight.detach().to(dtype or weight.dtype, copy=True)


class _Float32Embedding:
    """The HF embedding's lookup, widened to float32 (bfloat16 on CPU: the activations and
    the residual stream are float32; the table stays the model's, in bfloat16)."""

    def __init__(self, embedding: torch.nn.Module) -> None:
        self.embedding = embedding

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids).float()


def float32_compute(causal_lm: torch.nn.Module) -> bool:
    """bfloat16 weights on the CPU: stored in bfloat16, computed in float32 (the linears
    from `linear_choice.cpu_bf16_linear`, float32 activations, norms and logits). The device
    is the embedding's, or where it holds no memory (a rank reading its share of the
    checkpoint, `checkpoint_shards`) that of the model's buffers (the rotary module's)."""
    weight = causal_lm.get_input_embeddings().weight
    real = [t.device for t in (weight, *causal_lm.buffers()) if not t.is_meta]
    return weight.dtype == torch.bfloat16 and bool(real) and real[0].type == "cpu"


def _own_plain(linear: PackedLinear) -> PackedLinear:
    """`linear`, with its own copy of a plain weight it kept (not packed: no oneDNN) in place
    of a view of the HF parameter about to be released (which may view a file mapping)."""
    if linear.weight is not None:
        linear.weight = linear.weight.clone()
    return linear


def fused_linear(weight: torch.Tensor, bias: torch.Tensor | None, bf16_cpu: bool) -> Linear:
    """A linear over a weight made for it (not the checkpoint's): as the layers' own."""
    return _linear(weight, bias, True, bf16_cpu)


def _linear(
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None,
    fresh: bool,
    bf16_cpu: bool,
    quant: LinearQuantization | None = None,
) -> Linear:
    """The layer's linear over `weight` (`fresh`: a new tensor, not a view of the HF
    parameter): a quantized weight (a GGUF's, kept) or a CPU weight under `quant.at_load`
    -> `QuantLinear`; bfloat16 on CPU -> `cpu_bf16_linear` (float32 in and out); float32
    on CPU -> the panel kernel (`cpu_f32_linear`) where it builds; else a `PackedLinear`
    owning its weight."""
    if isinstance(weight, QuantizedWeight):
        linear = QuantLinear(weight, bias)
        # Packing leaves a few MB of freed temporaries per linear in glibc's heap; handed
        # back here, they do not pile up over a layer's seven weights into the load's peak.
        return_freed_memory()
        return linear
    if quant is not None and quant.at_load and weight.device.type == "cpu":
        return QuantLinear(quant.quantize(weight), bias)
    if bf16_cpu:
        return cpu_bf16_linear(weight, bias)
    panel = cpu_f32_linear(weight, bias)
    if panel is not None:
        return panel
    linear = PackedLinear(weight, bias)
    return linear if fresh else _own_plain(linear)


#: A linear's name in the layer and which of how many row blocks this rank keeps.
_Part = tuple[str, tuple[int, int]]


def _fuse_rows(parts: list[Any]) -> torch.Tensor | QuantizedWeight:
    """Weights stacked by rows: quantized ones stay quantized (of several formats, a GGUF's
    Q4_K Q and K with a Q6_K V, in their exact `common_format`); any other mix is
    dequantized to float32."""
    quantized = all(isinstance(p, QuantizedWeight) for p in parts)
    if quantized and common_format(parts) is not None:
        return QuantizedWeight.cat(parts)
    if any(isinstance(p, QuantizedWeight) for p in parts):
        parts = [p.dequantize() if isinstance(p, QuantizedWeight) else p.float() for p in parts]
    return torch.cat(parts)


def _zeros_like_rows(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """A zero bias for `weight`'s rows (float32 for a quantized weight)."""
    if isinstance(weight, QuantizedWeight):
        return torch.zeros(weight.shape[0])
    return weight.new_zeros(weight.shape[0])


def _column_linear(
    weights: WeightSource,
    parts: list[_Part],
    bf16_cpu: bool,
    quant: LinearQuantization | None = None,
) -> Linear:
    """Column-parallel linears fused into one: this rank's rows of each weight, concatenated,
    and of each bias (zeros for a linear without one; None when none has a bias)."""
    weight_parts = [weights.rows(f"{name}.weight", *block) for name, block in parts]
    bias = None
    if any(weights.has(f"{name}.bias") for name, _ in parts):
        bias = torch.cat(
            [
                weights.rows(f"{name}.bias", *block)
                if weights.has(f"{name}.bias")
                else _zeros_like_rows(weight)
                for (name, block), weight in zip(parts, weight_parts, strict=True)
            ]
        )
    return _linear(_fuse_rows(weight_parts), bias, True, bf16_cpu, quant)


def _row_linear(
    weights: WeightSource,
    name: str,
    rank: int,
    size: int,
    bf16_cpu: bool,
    quant: LinearQuantization | None = None,
) -> Linear:
    """Row-parallel: this rank's columns of the weight; the bias (a copy: Llama's
    `attention_bias` / `mlp_bias`) on rank 0 only, as the ranks' partial sums are summed."""
    bias = None
    if rank == 0 and weights.has(f"{name}.bias"):
        bias = _owned(weights.rows(f"{name}.bias"))
    fresh = size > 1 or not weights.views
    return _linear(weights.cols(f"{name}.weight", rank, size), bias, fresh, bf16_cpu, quant)


def _norm(weights: WeightSource, name: str, dtype: torch.dtype | None) -> torch.Tensor | None:
    """An owned copy of a norm's weight (None where the layer has none: Qwen3's q/k norms)."""
    return _owned(weights.rows(name), dtype) if weights.has(name) else None


def _take_layer(
    layer_idx: int,
    weights: WeightSource,
    bf16_cpu: bool = False,
    tp: RankInfo | None = None,
    hf_config: Any = None,
    quant: LinearQuantization | None = None,
) -> _Layer:
    """The fused layer built from `weights`: the HF layer's own (`ModuleWeights`; the caller
    then releases them, see the module doc) or the checkpoint's (`CheckpointLayer`).
    `bf16_cpu`: bfloat16 weights computed in float32 (`float32_compute`). With `tp` of more
    than one rank, this rank's shard (`tensor_parallel`): Q, K, V, gate and up by rows (K
    and V by `kv_split`), O and down by columns."""
    r, n = (tp.tp_rank, tp.tp_size) if tp is not None else (0, 1)
    check_quantized_split(hf_config, n, quant)
    kv = kv_split(hf_config, r, n) if n > 1 else (0, 1)
    qkv: list[_Part] = [("self_attn.q_proj", (r, n))]
    qkv += [("self_attn.k_proj", kv), ("self_attn.v_proj", kv)]
    gate_up: list[_Part] = [("mlp.gate_proj", (r, n)), ("mlp.up_proj", (r, n))]
    norm_dtype = torch.float32 if bf16_cpu else None
    with torch.no_grad():
        return _Layer(
            layer_idx=layer_idx,
            qkv=_column_linear(weights, qkv, bf16_cpu, quant),
            o=_row_linear(weights, "self_attn.o_proj", r, n, bf16_cpu, quant),
            gate_up=_column_linear(weights, gate_up, bf16_cpu, quant),
            down=_row_linear(weights, "mlp.down_proj", r, n, bf16_cpu, quant),
            ln_in=_owned(weights.rows("input_layernorm.weight"), norm_dtype),
            ln_post=_owned(weights.rows("post_attention_layernorm.weight"), norm_dtype),
            q_norm=_norm(weights, "self_attn.q_norm.weight", norm_dtype),
            k_norm=_norm(weights, "self_attn.k_norm.weight", norm_dtype),
        )


def _vocab_embedding(
    weight: torch.Tensor,
    tp: RankInfo,
    dtype: torch.dtype,
    checkpoint: CheckpointShards | None,
    name: str,
) -> VocabParallelEmbedding:
    """This rank's rows of the embedding: cut from the HF table `weight`, or read as they
    are from the checkpoint's tensor `name` (a one-rank table placed at this rank's start)."""
    if checkpoint is None:
        return VocabParallelEmbedding(weight, tp.tp_rank, tp.tp_size, dtype)
    rows = checkpoint.vocab_rows(name, tp.tp_rank, tp.tp_size)
    return VocabParallelEmbedding.from_rows(rows, tp.tp_rank, dtype)


class FusedDecoder:
    """Runs `model.model` (a LlamaModel-like module) for one flattened step."""

    def __init__(
        self,
        causal_lm: torch.nn.Module,
        tp: RankInfo | None = None,
        stage: range | None = None,
        link: PipelineLink | None = None,
        checkpoint: CheckpointShards | None = None,
        quant: LinearQuantization | None = None,
    ) -> None:
        """`tp`: this rank's place when the layers are split (`tensor_parallel`); its
        heads are `num_attention_heads / tp_size` and `num_key_value_heads / tp_size`.
        `stage`: the layers this pipeline stage runs (all by default), with `link` to the
        neighbouring stages (`pipeline`): a stage after the first receives the residual
        stream instead of embedding, a stage before the last sends it on and returns None.
        Layers outside the stage are released, and local layer i attends with KV pool i.
        `checkpoint`: the layers and the embedding's vocabulary rows are read from the files
        (`checkpoint_shards`), not taken from the HF modules (then a skeleton: meta
        parameters but for the modules the rank keeps, see `hf_model`); a GGUF's reader
        (`gguf_weights.GGUFShards`) gives quantized weights. `quant`: `model.quantization`
        (`int8` / `int4` quantize float weights as each layer is built)."""
        model = causal_lm.model
        names = {module: name for name, module in causal_lm.named_modules()}
        cfg = causal_lm.config
        tp_size = tp.tp_size if tp is not None else 1
        #: Sum the row-parallel outputs over the ranks (identity on one rank).
        self.reduce = tp_all_reduce if tp_size > 1 else _identity
        self.tp_size = tp_size
        #: bfloat16 weights on CPU, float32 activations (see `float32_compute`).
        self.bf16_cpu = float32_compute(causal_lm)
        self.embed: Any
        if tp_size > 1 and link is not None and not link.is_first:
            self.embed = None  # a later stage receives the residual stream instead
        elif tp_size > 1:  # this rank's vocabulary rows; the caller releases the HF table
            self.embed = _vocab_embedding(
                model.embed_tokens.weight,
                tp,
                torch.float32 if self.bf16_cpu else model.embed_tokens.weight.dtype,
                checkpoint,
                f"{names[model.embed_tokens]}.weight",
            )
        elif self.bf16_cpu:
            self.embed = _Float32Embedding(model.embed_tokens)
        else:
            self.embed = model.embed_tokens
        self.rotary_table = RotaryTable(model.rotary_emb)
        self.norm_weight = (
            _owned(model.norm.weight, torch.float32) if self.bf16_cpu else model.norm.weight
        )
        self.eps = cfg.rms_norm_eps
        self.num_heads = cfg.num_attention_heads // tp_size
        self.num_kv_heads = kv_heads_per_rank(cfg, tp_size)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim**-0.5
        stage = stage if stage is not None else range(len(model.layers))
        self.link = link
        self.layers = []
        for i, j in enumerate(stage):
            hf_layer = model.layers[j]
            weights: WeightSource = (
                checkpoint.layer(f"{names[hf_layer]}.")
                if checkpoint is not None
                else ModuleWeights(hf_layer)
            )
            self.layers.append(_take_layer(i, weights, self.bf16_cpu, tp, cfg, quant))
            release_parameters(hf_layer.modules())
            if checkpoint is not None:  # each layer's read and converted temporaries
                return_freed_memory()
        release_parameters(
            m for j, layer in enumerate(model.layers) if j not in stage for m in layer.modules()
        )
        #: The residual stream's dtype (what crosses between stages) and width.
        self.hidden_dtype = torch.float32 if self.bf16_cpu else model.embed_tokens.weight.dtype
        self.hidden_size = cfg.hidden_size
        #: A stage before the last ends without the final norm (its output is not used;
        #: such a stage may not hold the final norm: shaped as a layer's norm instead).
        like = self.layers[0].ln_in if self.layers else self.norm_weight
        self._stage_end_norm = torch.ones(cfg.hidden_size, dtype=like.dtype, device=like.device)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self._elementwise_key: tuple[torch.device, torch.dtype] | None = None
        self._elementwise: Elementwise = TorchElementwise()
        #: All-decode steps in one compiled call, where the layers allow (`decode_program`).
        self.decode_program = DecodeProgram.build(self)
        #: Every linear a oneDNN bfloat16 GEMM on one rank: the layers then keep the GEMMs'
        #: operands in bfloat16 between them (`_layers_bf16`; `TANDEM_BF16_OPERANDS=0` off).
        self.bf16_operands = (
            tp_size == 1
            and bool(self.layers)
            and os.environ.get("TANDEM_BF16_OPERANDS", "1") != "0"
            and all(
                isinstance(linear, PackedLinear) and linear.takes_bf16
                for layer in self.layers
                for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
            )
        )

    def _elementwise_for(self, h: torch.Tensor) -> Elementwise:
        key = (h.device, h.dtype)
        if self._elementwise_key != key:
            self._elementwise_key = key
            self._elementwise = pick_elementwise(h.device, h.dtype)
        return self._elementwise

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata
    ) -> torch.Tensor | None:
        """Hidden states `[T, hidden]` after the final norm (None on a pipeline stage
        before the last, which sends its residual stream on instead).

        Per layer: QKV projection, RoPE in place on its output, paged attention, O
        projection added to the residual stream together with the next RMS norm, gate/up
        projection, SiLU * up, down projection added likewise (the last one with the
        final norm)."""
        link = self.link
        if link is None or link.is_first:
            h = self.embed(input_ids)
        else:
            h = link.recv_hidden(
                torch.empty((input_ids.shape[0], self.hidden_size), dtype=self.hidden_dtype)
            )
        ew = self._elementwise_for(h)
        rope_rows = self.rotary_table.rows_for(positions)
        if self.decode_program is not None:
            hidden = self.decode_program.run(h, rope_rows, meta)
            if hidden is not None:
                return hidden
        last = link is None or link.is_last
        final_norm = self.norm_weight if last else self._stage_end_norm
        norm_weights = [layer.ln_in for layer in self.layers[1:]] + [final_norm]
        if self.bf16_operands and isinstance(ew, FusedElementwise):
            x = self._layers_bf16(h, ew, rope_rows, meta, norm_weights)
        else:
            x = ew.rms_norm(h, self.layers[0].ln_in, self.eps) if self.layers else h
            for layer, next_norm in zip(self.layers, norm_weights, strict=True):
                qkv = self._rotate_(layer, layer.qkv(x).contiguous(), ew, rope_rows)
                attn = self._attention(layer, qkv, meta)
                o = self.reduce(layer.o(attn))
                x = ew.add_rms_norm_(h, o, layer.ln_post, self.eps)
                down = self.reduce(layer.down(ew.silu_mul(layer.gate_up(x))))
                x = ew.add_rms_norm_(h, down, next_norm, self.eps)
        if not last:
            assert link is not None
            link.send_hidden(h)
            return None
        return x if self.layers else ew.rms_norm(h, self.norm_weight, self.eps)

    def _rotate_(
        self,
        layer: _Layer,
        qkv: torch.Tensor,
        ew: Elementwise,
        rope_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """`qkv` (a layer's QKV projection output) with the per-head norms and RoPE applied
        in place; returns it."""
        if layer.q_norm is not None:
            self._norm_heads_(qkv, layer, qkv.shape[0])
        ew.rope_(qkv, rope_rows, self.num_heads, self.num_kv_heads)
        return qkv

    def _attention(
        self, layer: _Layer, qkv: torch.Tensor, meta: PagedAttentionMetadata
    ) -> torch.Tensor:
        """The attention output `[T, q_size]` of one layer from its rotated QKV (`_rotate_`)."""
        tokens = qkv.shape[0]
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            tokens, self.num_kv_heads, self.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        attn, _ = paged_attention(
            layer,  # exposes layer_idx, as an HF attention module does
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            None,
            scaling=self.scaling,
            paged=meta,
        )
        return attn.reshape(tokens, self.q_size)

    def _layers_bf16(
        self,
        h: torch.Tensor,
        ew: FusedElementwise,
        rope_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        meta: PagedAttentionMetadata,
        norm_weights: list[torch.Tensor],
    ) -> torch.Tensor:
        """The layers when every linear is a oneDNN bfloat16 GEMM (`bf16_operands`): the
        norms and SiLU * up write the GEMMs' bfloat16 inputs and the residual adds read
        their bfloat16 outputs, instead of casting each operand on its own. The same bits
        as the float32-operand loop (which casts to bfloat16 for each GEMM and widens its
        output); the residual stream, the attention and the returned norm stay float32."""
        x = ew.rms_norm_bf16(h, self.layers[0].ln_in, self.eps)
        last = len(self.layers) - 1
        for i, (layer, next_norm) in enumerate(zip(self.layers, norm_weights, strict=True)):
            qkv_bf16 = layer.qkv.call_bf16(x)  # type: ignore[attr-defined]
            if layer.q_norm is None:  # widened and rotated in one pass
                qkv = ew.rope_bf16(qkv_bf16, rope_rows, self.num_heads, self.num_kv_heads)
            else:
                qkv = self._rotate_(layer, qkv_bf16.float(), ew, rope_rows)
            attn = self._attention(layer, qkv, meta)
            o = layer.o.call_bf16(attn.to(torch.bfloat16))  # type: ignore[attr-defined]
            x = ew.add_rms_norm_bf16_(h, o, layer.ln_post, self.eps, torch.bfloat16)
            act = ew.silu_mul_bf16(layer.gate_up.call_bf16(x))  # type: ignore[attr-defined]
            down = layer.down.call_bf16(act)  # type: ignore[attr-defined]
            out_dtype = torch.float32 if i == last else torch.bfloat16
            x = ew.add_rms_norm_bf16_(h, down, next_norm, self.eps, out_dtype)
        return x

    def _norm_heads_(self, qkv: torch.Tensor, layer: _Layer, tokens: int) -> None:
        """Qwen3's per-head RMS norms of the query and key heads, written back into `qkv`."""
        assert layer.q_norm is not None and layer.k_norm is not None
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            tokens, self.num_kv_heads, self.head_dim
        )
        q.copy_(_TORCH.rms_norm(q, layer.q_norm, self.eps))
        k.copy_(_TORCH.rms_norm(k, layer.k_norm, self.eps))
