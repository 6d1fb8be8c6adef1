"""Tiny random Llama models written as GGUF files, their tensors in chosen GGUF types.

`write_tiny_gguf(path, types)` builds a 2-layer Llama (hidden 256, intermediate 512, 4
query / 2 KV heads of 64, vocab `TINY_GGUF_VOCAB`; rows of 256 inputs, whole K-quant
super-blocks) from a fixed seed, permutes the Q/K rows as llama.cpp's converter does, and
writes every 2-D weight in `types[role]` (a role: `token_embd`, `output`, `attn_q`, `attn_k`,
`attn_v`, `attn_output`, `ffn_gate`, `ffn_up`, `ffn_down`; default `F32`) with a byte-level
tokenizer over the vocabulary, so `LLM(model=str(path))` converts and runs it offline.

Types gguf quantizes itself (Q4_0, Q4_1, Q8_0, ...) go through `gguf.quants.quantize`; gguf
0.19 cannot quantize the K-quants, so `quantize_q4_k` / `quantize_q6_k` here lay a plain
min/max grid over each sub-block and pack it in ggml's block layout (valid blocks, not
llama.cpp's error-minimising search; gguf's `dequantize` reads them back).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TINY_GGUF_VOCAB = 320
_SEED = 5
_ROPE_THETA = 10000.0
#: Llama's weights, by GGUF role: (HF name pattern, per layer).
_ROLES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def tiny_gguf_config(intermediate_size: int = 512):  # noqa: ANN201 - a LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=TINY_GGUF_VOCAB,
        hidden_size=256,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": _ROPE_THETA},
        tie_word_embeddings=False,
        initializer_range=0.5,
    )


def _fp16(values: np.ndarray) -> np.ndarray:
    """float16 values as float32 (the precision a block stores them in)."""
    return values.astype(np.float16).astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """`[rows, cols]` float -> Q4_K blocks `[rows, cols / 256 * 144]` uint8 (cols a multiple
    of 256): per sub-block of 32 a 15-step grid from min(min, 0) to max."""
    rows, cols = weight.shape
    sub = weight.astype(np.float32).reshape(rows, cols // 256, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)
    step, offset = (sub.max(axis=-1) - low) / 15, -low
    d, dmin = _fp16(step.max(axis=-1) / 63), _fp16(offset.max(axis=-1) / 63)
    sc = np.clip(np.rint(_safe_div(step, d[..., None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(offset, dmin[..., None])), 0, 63).astype(np.uint8)
    scale, minimum = d[..., None] * sc, dmin[..., None] * m
    q = np.rint(_safe_div(sub + minimum[..., None], np.broadcast_to(scale[..., None], sub.shape)))
    q = np.clip(q, 0, 15).astype(np.uint8)
    packed = np.concatenate(
        [
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4),
        ],
        axis=-1,
    )
    pairs = q.reshape(rows, cols // 256, 4, 2, 32)
    nibbles = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, cols // 256, 128)
    halves = np.stack([d, dmin], axis=-1).astype(np.float16).view(np.uint8)
    return np.concatenate([halves, packed, nibbles], axis=-1).reshape(rows, -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """`[rows, cols]` float -> Q6_K blocks `[rows, cols / 256 * 210]` uint8: per sub-block
    of 16 a symmetric grid of 64 steps (q - 32 in -32..31)."""
    rows, cols = weight.shape
    sub = weight.astype(np.float32).reshape(rows, cols // 256, 16, 16)
    step = np.abs(sub).max(axis=-1) / 31
    d = _fp16(step.max(axis=-1) / 127)
    sc = np.clip(np.rint(_safe_div(step, d[..., None])), -128, 127).astype(np.int8)
    scale = np.broadcast_to((d[..., None] * sc)[..., None], sub.shape)
    q = (np.clip(np.rint(_safe_div(sub, scale)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, cols // 256, 2, 128)  # element 128h + r
    low = q & 15
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(rows, cols // 256, 128)
    high = (q >> 4).reshape(rows, cols // 256, 2, 4, 32)
    qh = high[..., 0, :] | high[..., 1, :] << 2 | high[..., 2, :] << 4 | high[..., 3, :] << 6
    qh = qh.reshape(rows, cols // 256, 64)
    tail = np.concatenate(
        [sc.view(np.uint8), d[..., None].astype(np.float16).view(np.uint8)], axis=-1
    )
    return np.concatenate([ql, qh, tail], axis=-1).reshape(rows, -1)


def gguf_blocks(kind: str, weight: np.ndarray) -> np.ndarray:
    """`weight` `[rows, cols]` as GGUF blocks of type `kind` (uint8 `[rows, bytes]`)."""
    if kind == "Q4_K":
        return quantize_q4_k(weight)
    if kind == "Q6_K":
        return quantize_q6_k(weight)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(weight.astype(np.float32), GGMLQuantizationType[kind])


def _permute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order for Q or K (what `gguf_weights` undoes)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _add_tokenizer(writer) -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    """A byte-level vocabulary: the 256 bytes (GPT-2's spelling), then merged pairs."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelled = list(bytes_to_unicode().values())
    pairs = [(a, b) for a in "etaoinsr" for b in "etaoinsrhl"][: TINY_GGUF_VOCAB - 258]
    tokens = [*spelled, *(a + b for a, b in pairs), "<s>", "</s>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)


def write_tiny_gguf(path: Path, types: dict[str, str], intermediate_size: int = 512) -> Path:
    """Write the tiny Llama to `path` with each role's weights in `types[role]` (see the
    module docstring); norms are F32. Returns `path`."""
    import gguf
    from transformers import AutoModelForCausalLM

    config = tiny_gguf_config(intermediate_size)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    params = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(_ROPE_THETA)
    _add_tokenizer(writer)

    def add(name: str, role: str, weight: np.ndarray) -> None:
        kind = types.get(role, "F32")
        if kind == "F32":
            writer.add_tensor(name, weight.astype(np.float32))
            return
        blocks = gguf_blocks(kind, weight)
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])

    add("token_embd.weight", "token_embd", params["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", params["model.norm.weight"])
    add("output.weight", "output", params["lm_head.weight"])
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", params[prefix + "input_layernorm.weight"])
        norm = params[prefix + "post_attention_layernorm.weight"]
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm)
        for role, hf_name in _ROLES.items():
            weight = params[f"{prefix}{hf_name}.weight"]
            if role in heads:
                weight = _permute_qk(weight, heads[role])
            add(f"blk.{i}.{role}.weight", role, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
