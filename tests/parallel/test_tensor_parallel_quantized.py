"""Tensor parallelism over quantized weights: two ranks (the `mp` executor) give one rank's
greedy tokens for a GGUF kept quantized (Q4_1, and a Q4_K / Q6_K mix whose fused Q/K/V
mixes formats) and for weights quantized at load on the architectures with biases; a split
that would cut a quantization group is refused naming the layer and the group size."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM
from tandem.models.quant_linear import LinearQuantization
from tandem.models.tensor_parallel import check_quantized_split
from tandem.schema.config import ConfigError
from tandem.testing.tiny_gguf import tiny_gguf_config, write_tiny_gguf
from tandem.testing.tiny_model import tiny_config
from tests.parallel.tight_workload import GREEDY, TIGHT

#: Prompts of 3..41 tokens; the last two share a 24-token prefix (prefix caching).
SHARED = list(range(100, 124))
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 61)), SHARED + [7, 7, 7], SHARED + [9]]
ROLES = ["token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate"]
ROLES += ["ffn_up", "ffn_down"]
ALL_Q4_1 = dict.fromkeys(ROLES, "Q4_1")
#: Q4_K_M-like: the V rows (Q6_K) fuse with Q4_K Q and K in 8-bit codes, groups of 16.
K_MIX = {role: "Q6_K" if role in ("output", "attn_v", "ffn_down") else "Q4_K" for role in ROLES}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private $TANDEM_CACHE for this module's GGUF conversions, and where the files go."""
    root = tmp_path_factory.mktemp("tp-gguf")
    previous = os.environ.get("TANDEM_CACHE")
    os.environ["TANDEM_CACHE"] = str(root / "cache")
    yield root
    if previous is None:
        del os.environ["TANDEM_CACHE"]
    else:
        os.environ["TANDEM_CACHE"] = previous


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _quantization(llm: LLM) -> list[str]:
    return [d["quantization"] for d in llm.engine.executor.collective_rpc("describe")]


def _pair(model: Path, closing: list[LLM], **kw: Any) -> tuple[LLM, LLM]:
    one = LLM(model=str(model), worker_num_threads=1, **kw, **TIGHT)
    two = LLM(model=str(model), tensor_parallel_size=2, **kw, **TIGHT)
    closing += [one, two]
    return one, two


@pytest.mark.parametrize(
    ("types", "kept"), [(ALL_Q4_1, "gguf:Q4_1"), (K_MIX, "gguf:Q4_K,Q6_K")], ids=["Q4_1", "K"]
)
def test_a_kept_gguf_on_two_ranks_gives_one_ranks_tokens(
    types: dict[str, str], kept: str, gguf_dir: Path, closing: list[LLM]
) -> None:
    """Each rank unpacks its rows of Q/K/V, gate and up and whole groups of O's and down's
    columns from the GGUF's blocks (the embedding and LM head by vocabulary rows, float)."""
    name = kept.split(":")[1].replace(",", "-")
    path = write_tiny_gguf(gguf_dir / f"tiny-{name}.gguf", types)
    one, two = _pair(path, closing)
    assert _quantization(one) == [kept] and _quantization(two) == [kept, kept]
    assert _tokens(two) == _tokens(one)


@pytest.mark.parametrize(("arch", "mode"), [("qwen2", "int8"), ("qwen3", "int4")])
def test_quantized_at_load_on_two_ranks_gives_one_ranks_tokens(
    arch: str, mode: str, tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    """Each rank quantizes its shard (groups of 32: O's and down's 32 and 64 inputs a rank
    are whole groups); Qwen2's Q/K/V biases split by rows, Qwen3's q/k norms per head."""
    one, two = _pair(tiny_dirs[arch], closing, quantization=mode)
    assert _quantization(two) == [mode, mode]
    assert _tokens(two) == _tokens(one)


def test_at_load_groups_that_a_split_would_cut_are_refused_naming_the_layer() -> None:
    """The tiny models' O projection has 64 inputs: 32 a rank on two ranks."""
    config = tiny_config("llama")
    check_quantized_split(config, 2, LinearQuantization("int4", 32))
    check_quantized_split(config, 1, LinearQuantization("int4", 128))  # one rank: no split
    check_quantized_split(config, 2, LinearQuantization("none", 0))  # nothing quantized
    with pytest.raises(ConfigError, match=r"groups of 64 cannot split self_attn\.o_proj"):
        check_quantized_split(config, 2, LinearQuantization("int4", 64))
    with pytest.raises(ConfigError, match=r"one scale per output channel \(0\) cannot split"):
        check_quantized_split(config, 2, LinearQuantization("int8", 0))
    wide = tiny_gguf_config(intermediate_size=96)  # 256 inputs of O, 48 of down a rank
    with pytest.raises(ConfigError, match=r"mlp\.down_proj \(96 inputs\) .* 2 \(48 inputs"):
        check_quantized_split(wide, 2, LinearQuantization("int8", 32))


def test_a_split_cutting_groups_fails_the_start_naming_layer_and_group(
    tiny_dirs: dict[str, Path], gguf_dir: Path
) -> None:
    """At load, int4 in groups of 128 over O's 32 inputs a rank; kept, a Q4_1 down
    projection of 96 inputs (48 a rank: not whole groups of 32)."""
    with pytest.raises(Exception, match=r"groups of 128 cannot split self_attn\.o_proj"):  # noqa: PT011 - a rank's error, by message
        LLM(
            model=str(tiny_dirs["llama"]),
            tensor_parallel_size=2,
            quantization="int4",
            quantization_group_size=128,
        )
    path = write_tiny_gguf(gguf_dir / "tiny-q4_1-i96.gguf", ALL_Q4_1, intermediate_size=96)
    down = r"model\.layers\.0\.mlp\.down_proj\.weight \(GGUF Q4_1, groups of 32 inputs\)"
    with pytest.raises(Exception, match=down):  # noqa: PT011 - a rank's error, by message
        LLM(model=str(path), tensor_parallel_size=2, **TIGHT)
