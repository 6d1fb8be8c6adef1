"""`gguf_weights.gguf_name_map`: the Llama family's table gives every parameter of the
skeleton the GGUF name gguf's own `get_tensor_name_map` gives it; other architectures use
gguf's map."""

from __future__ import annotations

import gguf
import pytest

from tandem.models.gguf_weights import LLAMA_FAMILY_ARCHS, gguf_name_map
from tandem.models.light_skeleton import SkeletonCausalLM
from tandem.testing.tiny_model import tiny_config


def _ggufs(arch: str, layers: int):  # noqa: ANN202 - gguf's TensorNameMap.get_name
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    return gguf.get_tensor_name_map(arch_id, layers).get_name


@pytest.mark.parametrize("arch", LLAMA_FAMILY_ARCHS)
def test_every_skeleton_parameter_gets_ggufs_name(arch: str) -> None:
    import torch

    config = tiny_config(arch)
    layers = config.num_hidden_layers
    names = list(SkeletonCausalLM(config, torch.float32).state_dict(keep_vars=True))
    bases = {name.rpartition(".")[0] for name in names}
    ours, theirs = gguf_name_map(arch, layers), _ggufs(arch, layers)
    assert {b: ours(b) for b in bases} == {b: theirs(b) for b in bases}
    assert sum(ours(b) is not None for b in bases) >= 9 * layers + 3
    if arch == "qwen3":
        assert ours("model.layers.0.self_attn.q_norm") == "blk.0.attn_q_norm"


@pytest.mark.parametrize(
    "base",
    [
        "model.layers.01.self_attn.q_proj",  # not a layer index as gguf writes it
        "model.layers.x.self_attn.q_proj",
        "model.layers.2.self_attn.q_proj",  # past the last layer
        "model.layers.1.self_attn.rotary_emb",
        "model.embed_tokens.weight",
    ],
)
def test_names_without_a_tensor_map_to_none_as_in_gguf(base: str) -> None:
    assert gguf_name_map("llama", 2)(base) is None
    assert _ggufs("llama", 2)(base) is None


def test_other_architectures_use_ggufs_map_and_unknown_ones_map_nothing() -> None:
    assert gguf_name_map("phi3", 2)("model.layers.1.mlp.down_proj") == "blk.1.ffn_down"
    assert gguf_name_map("no-such-arch", 2)("model.norm") is None
