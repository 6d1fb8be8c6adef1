"""A Llama GGUF's one-dimensional F32 tensors (norms) read from the GGUF itself
(`GGUFShards.plain_rows`) hold exactly the converted copy's values, in float32 and bf16, so
a model whose matrices are all kept never opens the copy's safetensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.models.checkpoint_shards import CheckpointShards
from tandem.models.gguf_weights import GGUFShards
from tandem.models.model_files import load_hf_config, resolve_model_dir
from tandem.models.quantized_weight import QuantizedWeight
from tandem.testing.tiny_gguf import write_tiny_gguf

ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private $TANDEM_CACHE, so a GGUF test never writes into the user's cache."""
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    yield tmp_path / "cache"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_tensors_read_from_the_gguf_equal_the_converted_copy(
    tmp_path: Path, isolated_cache: Path, dtype: torch.dtype
) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", dict.fromkeys(ROLES, "Q8_0"))
    model_dir = resolve_model_dir(str(path))
    config = load_hf_config(model_dir)
    floats = CheckpointShards(model_dir, dtype)
    shards = GGUFShards(path, floats, config, list(floats.files))
    plain = [name for name in floats.files if shards.is_plain(name)]
    norms = [name for name in floats.files if name.endswith("norm.weight")]
    assert sorted(plain) == sorted(norms) and len(norms) == 2 * config.num_hidden_layers + 1
    for name in plain:
        got = shards.rows(name)
        assert got.dtype == dtype and torch.equal(got, floats.rows(name)), name
        halves = torch.cat([shards.rows(name, part, 2) for part in (0, 1)])
        assert torch.equal(halves, got), name
    reader = shards.float_reader()
    for name in floats.files:  # kept tensors too: always float, the copy's values
        got = reader.rows(name)
        assert not isinstance(got, QuantizedWeight) and torch.equal(got, floats.rows(name)), name
    assert isinstance(shards.rows("model.layers.0.self_attn.q_proj.weight"), QuantizedWeight)


def test_a_float_matrix_is_never_plain(tmp_path: Path, isolated_cache: Path) -> None:
    """A 2-D F32 tensor (here every matrix) stays with the converted copy: Llama's Q/K rows
    are permuted in the file, and the copy is where they are in HF order."""
    path = write_tiny_gguf(tmp_path / "float.gguf", {"attn_v": "Q8_0"})
    model_dir = resolve_model_dir(str(path))
    floats = CheckpointShards(model_dir)
    shards = GGUFShards(path, floats, load_hf_config(model_dir), list(floats.files))
    assert not any(shards.is_plain(n) for n in floats.files if len(floats.shape(n)) == 2)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(shards.rows(q), floats.rows(q))
