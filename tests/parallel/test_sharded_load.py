"""Each tensor- or pipeline-parallel rank reads only its share of the checkpoint
(`models.checkpoint_shards`): the reader slices exactly and counts what it read; the layers,
embedding rows and LM head a rank builds from the files equal those cut from a whole load,
bit for bit (biases, Qwen3's q/k norms, bfloat16, a tied head, replicated KV heads, a padded
vocabulary shard); on the `mp` executor two ranks or two stages give one rank's tokens while
each TP rank reads about half of the checkpoint and each stage exactly its own layers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tandem import LLM, SamplingParams
from tandem.core.worker import parallel_state
from tandem.core.worker.parallel_state import RankInfo
from tandem.models import hf_model
from tandem.models.checkpoint_shards import (
    SAFETENSORS_INDEX,
    CheckpointShards,
    checkpoint_bytes,
)
from tandem.models.hf_model import HFStepModel

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 61))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def test_reader_slices_equal_slicing_the_full_tensor(tmp_path: Path) -> None:
    weight = torch.randn(6, 8)
    bias = torch.randn(6).to(torch.bfloat16)
    save_file({"w": weight, "b": bias}, str(tmp_path / "model.safetensors"))
    reader = CheckpointShards(tmp_path)
    assert reader.bytes_read == 0 and reader.shape("w") == [6, 8]
    cases = [
        (lambda: reader.rows("w", 1, 3), weight[2:4]),
        (lambda: reader.cols("w", 1, 2), weight[:, 4:8]),
        (lambda: reader.read("w", slice(1, 5), slice(3, 6)), weight[1:5, 3:6]),
        (lambda: reader.rows("b", 2, 3), bias[4:6]),
        (lambda: reader.read("w"), weight),
    ]
    for read, expected in cases:
        before = reader.bytes_read
        got = read()
        assert torch.equal(got, expected) and got.dtype == expected.dtype
        assert reader.bytes_read - before == _nbytes(expected)
        # New memory of exactly its shape: nothing views the file.
        assert got.is_contiguous() and got.untyped_storage().nbytes() == _nbytes(got)
    with pytest.raises(KeyError, match="no tensor 'missing'"):
        reader.rows("missing")


def test_vocab_rows_pad_past_the_vocabulary_and_convert(tmp_path: Path) -> None:
    table = torch.randn(7, 4)
    save_file({"embed": table}, str(tmp_path / "model.safetensors"))
    reader = CheckpointShards(tmp_path, dtype=torch.bfloat16)
    shards = [reader.vocab_rows("embed", r, 3) for r in range(3)]  # ceil(7 / 3) = 3 rows
    assert [s.shape for s in shards] == [torch.Size([3, 4])] * 3
    assert torch.equal(torch.cat(shards)[:7], table.to(torch.bfloat16))
    assert not torch.cat(shards)[7:].any()  # the padding rows are zero
    assert reader.bytes_read == _nbytes(table)  # counted in the file's dtype, once each row
    assert reader.vocab_rows("embed", 1, 3) is shards[1]  # a tied head's rows: not read again
    assert reader.bytes_read == _nbytes(table)
    assert CheckpointShards(tmp_path).vocab_rows("embed", 3, 4).shape == (2, 4)


def test_an_index_spreads_tensors_over_files(tmp_path: Path) -> None:
    parts = {"a.safetensors": {"x": torch.randn(4, 2)}, "b.safetensors": {"y": torch.randn(3)}}
    for name, tensors in parts.items():
        save_file(tensors, str(tmp_path / name))
    index = {"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps(index))
    reader = CheckpointShards(tmp_path)
    assert torch.equal(reader.rows("x", 1, 2), parts["a.safetensors"]["x"][2:4])
    assert torch.equal(reader.rows("y"), parts["b.safetensors"]["y"])
    assert reader.bytes_read == 2 * 2 * 4 + 3 * 4  # half of x, all of y
    assert checkpoint_bytes(tmp_path) == 4 * 2 * 4 + 3 * 4


def _step_model(model_dir: Path, dtype: torch.dtype, whole: bool = False) -> HFStepModel:
    """This (patched) rank's model; `whole`: loaded whole and cut in memory, as before."""
    with pytest.MonkeyPatch.context() as patch:
        if whole:
            patch.setattr(hf_model, "safetensors_files", lambda _dir: [])
        return HFStepModel(model_dir, dtype, 8, 4, torch.device("cpu"))


def _assert_same_weights(read: HFStepModel, cut: HFStepModel, tp: int) -> None:
    """The two models' linears give bit-equal outputs; norms, embedding rows are equal."""
    assert read.fused is not None and cut.fused is not None
    x, inner = torch.randn(3, 64), torch.randn(3, 128 // tp)
    for a, b in zip(read.fused.layers, cut.fused.layers, strict=True):
        assert torch.equal(a.qkv(x), b.qkv(x)) and torch.equal(a.gate_up(x), b.gate_up(x))
        assert torch.equal(a.o(x[:, : 64 // tp]), b.o(x[:, : 64 // tp]))
        assert torch.equal(a.down(inner), b.down(inner))
        for name in ("ln_in", "ln_post", "q_norm", "k_norm"):
            mine, theirs = getattr(a, name), getattr(b, name)
            assert (mine is None and theirs is None) or torch.equal(mine, theirs), name
    assert (read.lm_head is None) == (cut.lm_head is None)
    if read.lm_head is not None and cut.lm_head is not None:
        assert torch.equal(read.lm_head(x), cut.lm_head(x))
    if tp > 1 and read.fused.embed is not None:
        assert torch.equal(read.fused.embed.shard, cut.fused.embed.shard)
        assert read.fused.embed.start == cut.fused.embed.start


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with its head tied to the embedding (no `lm_head.weight` in the file),
    Llama's attention and MLP biases, and a vocabulary of 383 (no rank count divides it)."""
    from transformers import AutoModelForCausalLM

    from tandem.testing.tiny_model import tiny_config

    config = tiny_config("llama")
    config.tie_word_embeddings, config.vocab_size = True, 383
    config.attention_bias = config.mlp_bias = True
    directory = tmp_path_factory.mktemp("tied") / "llama"
    with torch.random.fork_rng():
        torch.manual_seed(3)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


PLACES = [(2, 1, r) for r in range(2)] + [(1, 2, r) for r in range(2)] + [(2, 2, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "tied"])
def test_a_ranks_share_read_from_the_files_equals_its_cut_of_a_whole_load(
    arch: str,
    dtype: torch.dtype,
    tiny_dirs: dict[str, Path],
    tied_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir = tied_dir if arch == "tied" else tiny_dirs[arch]
    if arch == "tied":
        assert "lm_head.weight" not in CheckpointShards(model_dir).files
    places = PLACES + ([(4, 1, 3)] if arch == "tied" else [])  # 2 KV heads on 4 ranks
    for tp, pp, rank in places:
        info = RankInfo(rank=rank, world_size=tp * pp, tp_size=tp, pp_size=pp)
        monkeypatch.setattr(parallel_state, "current", lambda info=info: info)
        read, cut = _step_model(model_dir, dtype), _step_model(model_dir, dtype, whole=True)
        assert read.bytes_read < cut.bytes_read == checkpoint_bytes(model_dir)
        _assert_same_weights(read, cut, tp)


def _describe(llm: LLM) -> list[dict[str, Any]]:
    return llm.engine.executor.collective_rpc("describe")


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ranks_reading_their_share_give_one_ranks_tokens(
    arch: str, tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    model = str(tiny_dirs[arch])
    one = LLM(model=model, worker_num_threads=1)
    two = LLM(model=model, tensor_parallel_size=2)
    staged = LLM(model=model, pipeline_parallel_size=2)
    closing += [one, two, staged]
    expected = _tokens(one)
    assert _tokens(two) == expected and _tokens(staged) == expected

    sizes = CheckpointShards(tiny_dirs[arch]).nbytes
    total = sum(sizes.values())
    assert [r["bytes_read"] for r in _describe(one)] == [total]
    halves = [r["bytes_read"] for r in _describe(two)]
    assert all(0 < b < 0.6 * total for b in halves), (halves, total)

    def layer(i: int) -> int:
        return sum(n for name, n in sizes.items() if name.startswith(f"model.layers.{i}."))

    first, last = (r["bytes_read"] for r in _describe(staged))
    assert first < total and last < total
    # Stage 0: layer 0 and the embedding; stage 1: layer 1, the final norm and the head.
    assert first == layer(0) + sizes["model.embed_tokens.weight"]
    assert last == layer(1) + sizes["model.norm.weight"] + sizes["lm_head.weight"]
    assert layer(0) + layer(1) == sum(n for k, n in sizes.items() if k.startswith("model.layers."))
