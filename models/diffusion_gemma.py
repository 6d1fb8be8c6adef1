"""DiffusionGemma on tandem's paged KV: a `BlockDiffusionModel` (see `block_diffusion`).

Loaded from a local transformers directory (`DiffusionGemmaForBlockDiffusion.from_pretrained`,
never a download): the transformers modules hold the weights and tandem runs their
submodules in its own data flow (`diffusion_gemma_layers`, `diffusion_gemma_attention`):

- `encode(batch)`: the causal encoder over a `FlatBatch` of prompt chunks and committed
  canvases, written layer by layer into per-layer-group pools (`kv_layer_groups`: sliding
  layers `[.., kv_heads, head_dim]`, full layers `[.., global_kv_heads, global_head_dim]`,
  one block table). The last layer only projects and writes its K/V: encoder hidden
  states are never read (the decoder gets only the cache), so its attention output, MLP
  and MoE are skipped.
- `denoise(canvas_ids, self_cond, context)`: the bidirectional decoder over one L-token
  canvas per request, batched across requests with different context lengths, attending
  to each request's cached window through its block table; writes nothing. The windows
  are gathered once per canvas, not per step (`diffusion_gemma_context.ContextCache`;
  `release_context(req_id)` drops a finished or preempted request's). Returns the
  reference's `DiffusionGemmaForBlockDiffusion.forward` logits: `lm_head` in float32 and
  `tanh(x / cap) * cap`.

Encoder and decoder layers share every weight but not the `layer_scalar` buffers, so each
pass uses its own transformers layer objects. The vision tower is built by the
architecture and loaded with the checkpoint, but unused: tandem serves text only (the
encoder's image-embedding path is never entered). `use_bidirectional_attention == "all"`
(a bidirectional encoder) is refused: tandem's encoder is causal, so committed tokens keep
their KV. Positions are sequence indices (position of token i is i), as in `generate()`.

dtype: bfloat16 on CUDA, float32 on the CPU ("auto"); the CPU path has no CUDA-only code.

Tensor parallelism: with more than one tensor-parallel rank (`parallel_state.current()`)
every layer holds this rank's heads, MLP columns and experts, and the pools only its KV
heads (`diffusion_gemma_parallel`, which says what is split and what is replicated).

Quantization (`model.quantization` int8 / int4, CPU only): after any sharding, the layers'
linears and every expert are quantized in place (`diffusion_gemma_quant`); the router, the
norms and the tied embedding / LM head stay float. The data flow above is unchanged: the
quantized modules are called where the float ones were (`moe_grouped` hands quantized
experts to `moe_quantized`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from tandem.core.worker import parallel_state
from tandem.core.worker.block_diffusion import DenoiseContext
from tandem.core.worker.flat_batch import FlatBatch
from tandem.models.diffusion_gemma_attention import (
    KeyWindow,
    decoder_attention,
    decoder_window,
    encoder_attention,
    encoder_windows,
    grouped_decoder_attention,
    project_qkv,
)
from tandem.models.diffusion_gemma_context import ContextCache, ContextGroup, row_windows
from tandem.models.diffusion_gemma_layers import Attend, attention_block, feed_forward
from tandem.models.diffusion_gemma_parallel import (
    LayerHeads,
    check_divisible,
    first_expert,
    shard_layers,
)
from tandem.models.diffusion_gemma_quant import quantize_model
from tandem.models.kv_layer_groups import KVLayerGroup, KVPools, LayerKVShape, group_layers
from tandem.models.quant_linear import LinearQuantization
from tandem.models.tensor_parallel import kv_heads_per_rank
from tandem.models.weight_release import own_remaining_parameters, return_freed_memory


def kv_layer_groups(text_config, tp_size: int = 1) -> list[KVLayerGroup]:  # noqa: ANN001
    """The KV layer groups of a `DiffusionGemmaTextConfig` (sliding and full layers), as one
    of `tp_size` tensor-parallel ranks holds them: its KV heads only (`kv_heads_per_rank`:
    `Hkv / tp`, or 1 replicated head when `Hkv < tp`)."""
    shapes = []
    for i, layer_type in enumerate(text_config.layer_types):
        heads = kv_heads_per_rank(LayerHeads(text_config, i), tp_size)
        head_dim = text_config.per_layer_config[i].head_dim
        sliding = text_config.sliding_window if layer_type == "sliding_attention" else None
        shapes.append(LayerKVShape(heads, head_dim, False, sliding))
    return group_layers(shapes)


def load_diffusion_gemma(model_dir: Path, dtype: torch.dtype, device: torch.device):  # noqa: ANN201
    """The transformers model, eval mode, on `device` (local files only)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from tandem.models.model_files import quiet_loading

    with quiet_loading():
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(
            str(model_dir), dtype=dtype, local_files_only=True
        )
    return model.to(device).eval()


class DiffusionGemmaModel:
    """DiffusionGemma as a `BlockDiffusionModel` over `KVPools` (`num_blocks` x `block_size`).
    `quantization`: `model.quantization` as resolved (`hf_loader.linear_quantization`);
    int8 / int4 quantize the layers at load on the CPU, `none` / `auto` keep `dtype`."""

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        quantization: LinearQuantization | None = None,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.hf = load_diffusion_gemma(model_dir, dtype, device)
        config = self.hf.config
        text = config.text_config
        if text.use_bidirectional_attention == "all":
            raise ValueError(
                "DiffusionGemma with use_bidirectional_attention='all' (a bidirectional "
                "encoder) is not supported: tandem encodes causally"
            )
        self.text_config = text
        self.canvas_length: int = int(config.canvas_length)
        self.vocab_size: int = int(text.vocab_size)
        self.encoder = self.hf.model.encoder.language_model
        self.decoder = self.hf.model.decoder
        #: This rank's place; with several tensor-parallel ranks the layers hold its part.
        self.rank = parallel_state.current()
        check_divisible(text, self.rank.tp_size)
        if self.rank.tp_size > 1:
            shard_layers(text, [self.encoder.layers, self.decoder.layers], self.rank)
        quant = quantization or LinearQuantization()
        #: Which weights are quantized (`model.quantization` as resolved for this model).
        self.quantization: str = quant.mode if quant.at_load else "none"
        if quant.at_load:
            if device.type != "cpu":
                raise ValueError(f"quantization {quant.mode} runs on the CPU, not {device}")
            quantize_model(self.hf, [self.encoder.layers, self.decoder.layers], quant)
        if self.rank.tp_size > 1 or quant.at_load:
            own_remaining_parameters(self.hf)  # the float rest leaves the file mapping
            return_freed_memory()
        #: Global index of this rank's first expert (None: one rank holds them all).
        self.first_expert = first_expert(text, self.rank)
        self.kv_groups = kv_layer_groups(text, self.rank.tp_size)
        self.kv = KVPools(self.kv_groups, num_blocks, block_size, dtype, device)
        self.context_cache = ContextCache(block_size)

    def release_context(self, req_id: str) -> None:
        """Drop the decoder's gathered context of `req_id` (finished or preempted)."""
        self.context_cache.release(req_id)

    def _window(self, layer: int) -> int | None:
        return self.kv.group_of(layer).sliding_window

    def _rope(
        self, rotary: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin `[T, D]` per layer type for flat `positions [T]`."""
        return {
            kind: tuple(t[0] for t in rotary(hidden[None], positions[None], kind))
            for kind in set(self.text_config.layer_types)
        }

    @torch.inference_mode()
    def encode(self, batch: FlatBatch) -> None:
        """Causal encoder over `batch`'s tokens; writes every layer's K/V at
        `batch.slot_mapping`. Request r's tokens are flat `query_start_loc[r] ..
        query_start_loc[r + 1]` at positions `seq_lens[r] - n .. seq_lens[r] - 1`."""
        qsl = batch.query_start_loc.tolist()
        seq_lens = batch.seq_lens.tolist()
        counts = [qsl[r + 1] - qsl[r] for r in range(len(seq_lens))]
        starts = [seq - n for seq, n in zip(seq_lens, counts, strict=True)]
        hidden = self.encoder.embed_tokens(batch.input_ids)
        rope = self._rope(self.encoder.rotary_emb, hidden, batch.positions)
        windows = {
            w: encoder_windows(batch.block_tables, starts, counts, w, self.block_size)
            for w in {g.sliding_window for g in self.kv_groups}
        }
        last = len(self.encoder.layers) - 1
        for i, layer in enumerate(self.encoder.layers):
            cos, sin = rope[self.text_config.layer_types[i]]
            if i == last:  # only its K/V matter: nothing reads the encoder's output
                _, k, v = project_qkv(layer.self_attn, layer.input_layernorm(hidden), cos, sin)
                self.kv.write(i, k, v, batch.slot_mapping)
                break
            window = self._window(i)
            attend = partial(
                self._encoder_attend, i, batch.slot_mapping, windows[window], qsl, starts, window
            )
            hidden = attention_block(layer, hidden, cos, sin, attend)
            hidden = feed_forward(layer, hidden, self.first_expert)

    def _encoder_attend(
        self,
        layer: int,
        slot_mapping: torch.Tensor,
        keys: KeyWindow,
        token_starts: list[int],
        query_start: list[int],
        window: int | None,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        """Write this layer's K/V of the step's tokens, then attend causally over the pools."""
        self.kv.write(layer, key, value, slot_mapping)
        k_pool, v_pool = self.kv.per_layer[layer]
        return encoder_attention(query, k_pool, v_pool, keys, token_starts, query_start, window)

    def _decoder_inputs(
        self, canvas_ids: torch.Tensor, self_cond: torch.Tensor | None, has: torch.Tensor
    ) -> torch.Tensor:
        """Embedded canvas plus self-conditioning, `[R, L, hidden]`
        (M:`DiffusionGemmaDecoderModel.forward`; rows with `has` False get zero soft
        embeddings, as with `self_conditioning_logits=None`)."""
        embed = self.decoder.embed_tokens
        inputs = embed(canvas_ids)
        if self_cond is None:
            soft = torch.zeros_like(inputs)
        else:
            probs = self_cond.softmax(dim=-1, dtype=torch.float32).to(embed.weight.dtype)
            soft = torch.matmul(probs, embed.weight) * embed.embed_scale.to(inputs.dtype)
            soft = torch.where(has[:, None, None], soft, torch.zeros_like(soft))
        return self.decoder.self_conditioning(inputs, soft)

    @torch.inference_mode()
    def denoise(
        self,
        canvas_ids: torch.Tensor,
        self_cond: torch.Tensor | None,
        context: DenoiseContext,
    ) -> torch.Tensor:
        """Float32 logits `[R, L, V]` of the decoder over `canvas_ids [R, L]` (see the
        module docstring); reads the pools, writes nothing."""
        rows, length = canvas_ids.shape
        hidden = self._decoder_inputs(canvas_ids, self_cond, context.has_self_cond)
        hidden = hidden.reshape(rows * length, -1)
        positions = context.canvas_positions(length).reshape(-1)
        rope = self._rope(self.decoder.rotary_emb, hidden, positions)
        attends = self._decoder_attends(context, length)
        for i, layer in enumerate(self.decoder.layers):
            cos, sin = rope[self.text_config.layer_types[i]]
            hidden = attention_block(layer, hidden, cos, sin, attends[i])
            hidden = feed_forward(layer, hidden, self.first_expert)
        hidden = self.decoder.norm(hidden)
        logits = self.hf.lm_head(hidden).to(torch.float32)
        cap = self.hf.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.view(rows, length, -1)

    def _decoder_attends(self, context: DenoiseContext, length: int) -> list[Attend]:
        """Each decoder layer's attention callback: over the context gathered once per
        canvas (`ContextCache`), or gathered per step where a group is over budget."""
        context_lens = context.context_lens.tolist()
        rows = len(context_lens)
        attends: dict[int, Attend] = {}
        for w in {g.sliding_window for g in self.kv_groups}:
            layers = [i for i in range(len(self.decoder.layers)) if self._window(i) == w]
            pools = {i: self.kv.per_layer[i] for i in layers}
            windows = row_windows(context.block_tables, context_lens, w, self.block_size)
            group = self.context_cache.prepare(context.req_ids, windows, length, w, pools)
            if group is not None:
                attends.update({i: partial(self._grouped_attend, group, i, rows) for i in layers})
                continue
            keys = decoder_window(context.block_tables, context_lens, w, self.block_size)
            attends.update({i: partial(self._decoder_attend, i, keys, rows) for i in layers})
        return [attends[i] for i in range(len(self.decoder.layers))]

    @staticmethod
    def _grouped_attend(
        group: ContextGroup,
        layer: int,
        rows: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        """Canvas attention of flat `[R * L, H, D]` tensors over the gathered context."""
        k_buf, v_buf = group.keys[layer]

        def canvas(x: torch.Tensor) -> torch.Tensor:
            return x.view(rows, -1, *x.shape[1:])

        out = grouped_decoder_attention(
            canvas(query), canvas(key), canvas(value), k_buf, v_buf, group.valid
        )
        return out.reshape(query.shape)

    def _decoder_attend(
        self,
        layer: int,
        keys: KeyWindow,
        rows: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        """Canvas attention of flat `[R * L, H, D]` tensors over this layer's pools."""
        k_pool, v_pool = self.kv.per_layer[layer]

        def canvas(x: torch.Tensor) -> torch.Tensor:
            return x.view(rows, -1, *x.shape[1:])

        out = decoder_attention(canvas(query), canvas(key), canvas(value), k_pool, v_pool, keys)
        return out.reshape(query.shape)


def kv_bytes_per_token(hf_config, dtype: torch.dtype, tp_size: int = 1) -> int:  # noqa: ANN001
    """KV bytes one token takes in every layer of a `DiffusionGemmaConfig` on one of
    `tp_size` tensor-parallel ranks (sum over the layer groups of its KV heads): what a
    per-rank KV memory budget divides, instead of `hf_model.kv_bytes_per_token` (which
    assumes one shape for all layers)."""
    groups = kv_layer_groups(hf_config.text_config, tp_size)
    return sum(group.bytes_per_token(dtype) for group in groups)
