"""`light_skeleton.SkeletonCausalLM` against transformers' own classes.

The same parameter names, shapes, dtypes and tying as transformers' model built from the
same config (every Llama-family variant: biases, Qwen3's q/k norms, tied and untied heads);
the rotary module's cos/sin bit-equal to transformers' for static and dynamic rotary types;
Llama's RMSNorm forward; and a GGUF kept quantized loads and runs without importing
transformers' model classes (the point of the skeleton).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.models.light_skeleton import RMSNorm, RotaryEmbedding, SkeletonCausalLM
from tandem.testing.tiny_model import tiny_config


def _variants() -> list[tuple[str, Any]]:
    from transformers import MistralConfig

    out = []
    for arch in ("llama", "qwen2", "qwen3"):
        out.append((arch, tiny_config(arch)))
    biased = tiny_config("llama")
    biased.attention_bias, biased.mlp_bias, biased.tie_word_embeddings = True, True, True
    out.append(("llama-biased-tied", biased))
    qwen3 = tiny_config("qwen3")
    qwen3.attention_bias = True
    out.append(("qwen3-biased", qwen3))
    shape = tiny_config("llama")  # the same tiny shape, as a Mistral
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    fields += ("num_attention_heads", "num_key_value_heads", "head_dim")
    mistral = MistralConfig(**{f: getattr(shape, f) for f in fields}, tie_word_embeddings=False)
    out.append(("mistral", mistral))
    return out


VARIANTS = _variants()


def _hf(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model


@pytest.mark.parametrize(("name", "config"), VARIANTS, ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tree_is_transformers_parameter_for_parameter(
    name: str, config: Any, dtype: torch.dtype
) -> None:
    want, got = _hf(config, dtype), SkeletonCausalLM(config, dtype)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in want.state_dict(keep_vars=True).items()}
    assert {k: (tuple(v.shape), v.dtype) for k, v in got.state_dict(keep_vars=True).items()} == (
        shapes
    )
    assert all(p.is_meta for p in got.parameters())
    tied = want.lm_head.weight is want.get_input_embeddings().weight
    assert (got.lm_head.weight is got.get_input_embeddings().weight) is tied
    assert got.dtype == want.dtype == dtype
    assert [n for n, _ in got.named_buffers()] == [n for n, _ in want.named_buffers()]
    layer = got.model.layers[1]
    assert layer.self_attn.layer_idx == 1


def _rope_config(rope: dict[str, Any]) -> Any:
    config = tiny_config("llama")
    config.rope_parameters = {"rope_theta": 10000.0, **rope}
    return config


ROPES = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
]


@pytest.mark.parametrize("rope", ROPES, ids=[r["rope_type"] for r in ROPES])
def test_rotary_cos_sin_are_transformers_bit_for_bit(rope: dict[str, Any]) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _rope_config(rope)
    want, got = LlamaRotaryEmbedding(config), RotaryEmbedding(config)
    assert got.rope_type == want.rope_type == rope["rope_type"]
    # beyond max_position_embeddings (512) the dynamic type rescales: both must follow
    for positions in (torch.arange(300)[None], torch.tensor([[0, 5, 511, 900, 1500]])):
        probe = torch.empty(1, dtype=torch.float32)
        for a, b in zip(got(probe, positions), want(probe, positions), strict=True):
            assert torch.equal(a, b)


def test_rms_norm_forward_is_llamas() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    weight = torch.randn(64, generator=torch.Generator().manual_seed(1))
    ours, theirs = RMSNorm(64, 1e-5, torch.float32), LlamaRMSNorm(64, eps=1e-5)
    ours.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    theirs.weight = torch.nn.Parameter(weight.clone())
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ours(x), theirs(x).detach())
    assert torch.equal(ours(x.bfloat16()), theirs(x.bfloat16()).detach())


def test_other_model_types_are_refused_by_name() -> None:
    config = tiny_config("llama")
    config.model_type = "gemma"
    with pytest.raises(ValueError, match="model_type 'gemma'"):
        SkeletonCausalLM(config, torch.float32)


#: Modules a GGUF kept quantized loads and runs without (see the test below).
UNWANTED_MODULES = (
    "transformers.modeling_utils",
    "torch._dynamo",
    "gguf",
    "zmq",
    "tandem.testing.conformance",
    "transformers.models.auto.tokenization_auto",
    "tandem.core.worker.virtual_device",
    "safetensors",
)


def test_a_gguf_kept_quantized_runs_without_transformers_model_classes(tmp_path: Path) -> None:
    """The GGUF path builds the skeleton: after loading and generating, neither
    `transformers.modeling_utils` nor `torch._dynamo` was imported (they cost ~98 MB), nor
    gguf (its names and types are tandem's tables), pyzmq (the KV transfer plugin imports it
    only to connect), the conformance kits, `AutoTokenizer`'s module, the simulated device,
    or safetensors (every matrix is kept and the norms are read from the GGUF)."""
    from tandem.models.model_files import resolve_model_dir
    from tandem.testing.tiny_gguf import write_tiny_gguf

    roles = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    roles += ("token_embd", "output")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", dict.fromkeys(roles, "Q8_0"))
    resolve_model_dir(str(path))  # converted here (conversion uses transformers' loader)
    code = (
        "import json, sys\n"
        "from tandem import LLM, SamplingParams\n"
        f"llm = LLM(model={str(path)!r}, worker_num_threads=1, max_model_len=64)\n"
        "out = llm.generate([[5, 17, 99, 3]], SamplingParams(temperature=0, max_tokens=4,"
        " ignore_eos=True), use_tqdm=False)\n"
        "print(json.dumps({'tokens': out[0].outputs[0].token_ids,"
        " 'quantization': llm.engine.executor.worker.model.quantization,"
        f" 'imported': [m for m in {UNWANTED_MODULES!r} if m in sys.modules]}}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) == 4
    assert result["quantization"].startswith("gguf:")
    assert result["imported"] == []
