"""bfloat16 on the CPU (issue 16 item 3): weights and KV cache in bfloat16, float32 compute.

The decode kernel on bfloat16 pools against its float32 twin and against SDPA over the same
widened values; a tiny Llama in bfloat16 end to end through the engine (the kernel reads
the bfloat16 pools, the linears are weight-only bfloat16, norms and activations float32);
teacher-forced top-1 agreement with transformers' bfloat16 forward; `auto` stays float32
and the emulated-bf16 warning is logged once.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tandem.llm import LLM
from tandem.models import cpu_features
from tandem.models.cpu_kernels import PagedDecodeKernel, paged_decode_kernel
from tandem.models.hf_model import HFStepModel
from tandem.models.linear_choice import RowDispatchLinear, cpu_bf16_linear
from tandem.models.packed_linear import PackedLinear
from tandem.models.panel_linear import Bf16Linear, F32PanelLinear
from tandem.schema.sampling_params import SamplingParams
from tandem.testing.teacher_forcing import teacher_forced_top1
from tandem.testing.tiny_model import TINY_ARCHS, TINY_SEEDS, TINY_VOCAB, tiny_config

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="needs a C++ compiler"
)
CPU = torch.device("cpu")
BLOCK = 16


def reference(q, k_pool_t, v_pool, tables, lens, scale):  # noqa: ANN001, ANN201
    """Per request: gather the context (widened to float32), SDPA with GQA."""
    _, kv_heads, dim, block_size = k_pool_t.shape
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        length = int(lens[r])
        blocks = tables[r, : -(-length // block_size)]
        k = k_pool_t[blocks].float().permute(1, 0, 3, 2).reshape(kv_heads, -1, dim)[:, :length]
        v = v_pool[blocks].float().reshape(-1, kv_heads, dim)[:length].transpose(0, 1)
        out[r] = F.scaled_dot_product_attention(
            q[r][None, :, None], k[None], v[None], scale=scale, enable_gqa=True
        )[0, :, 0]
    return out


def _kernel() -> PagedDecodeKernel:
    kernel = paged_decode_kernel()
    assert kernel is not None, "a compiler is present, so the kernel must build"
    return kernel


@pytest.mark.parametrize(
    ("head_dim", "q_heads", "kv_heads", "block_size"),
    [(64, 9, 3, 16), (128, 8, 1, 16), (16, 4, 2, 16), (64, 6, 2, 8), (32, 12, 1, 4)],
)
def test_bf16_kernel_equals_f32_kernel_on_rounded_pools(
    head_dim: int, q_heads: int, kv_heads: int, block_size: int
) -> None:
    kernel = _kernel()
    gen = torch.Generator().manual_seed(head_dim + 7 * q_heads)
    lens = torch.tensor([1, block_size, block_size + 1, 77, 200, 5])
    max_blocks = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    k = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=gen).bfloat16()
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks]
    tables = tables.view(len(lens), max_blocks).contiguous()
    q = torch.randn(len(lens), q_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    got = kernel(q, k, v, tables, lens, scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(
        got, kernel(q, k.float(), v.float(), tables, lens, scale), atol=1e-6, rtol=1e-6
    )
    torch.testing.assert_close(got, reference(q, k, v, tables, lens, scale), atol=2e-5, rtol=1e-4)


def test_kernel_rejects_mixed_pool_dtypes() -> None:
    pool = torch.zeros(2, 1, 64, 16)
    with pytest.raises(TypeError):
        _kernel()(
            torch.zeros(1, 2, 64),
            pool,
            torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16),
            torch.zeros(1, 1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            0.125,
        )


class CheckingKernel:
    """The decode kernel, each call compared with `reference` over the same pools."""

    def __init__(self, kernel: PagedDecodeKernel) -> None:
        self.kernel = kernel
        self.calls = 0
        self.worst = 0.0
        self.worst_beyond_a_bf16_step = 0.0

    def __call__(self, q, k_pool, v_pool, tables, lens, scale):  # noqa: ANN001, ANN204
        out = self.kernel(q, k_pool, v_pool, tables, lens, scale)
        want = reference(q.float(), k_pool, v_pool, tables, lens, scale).to(out.dtype)
        diff = (out.float() - want.float()).abs()
        self.worst = max(self.worst, float(diff.max()))
        # beyond one bf16 step of the value (2**-7 relative): a rounding that lands on the
        # other side of a bf16 boundary differs by exactly one step, on any CPU
        self.worst_beyond_a_bf16_step = max(
            self.worst_beyond_a_bf16_step, float((diff - 2**-7 * want.float().abs()).max())
        )
        self.calls += 1
        return out


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(length + i)] for i in range(count)]


#: The tiny models' init scale here. At the shared tiny models' INIT_RANGE (1.0) every
#: rounding is amplified: transformers' own float32-compute and bf16-compute forwards (same
#: bf16 weights) agree on only ~92% of teacher-forced top-1s, so no bf16 path could be held
#: to 95% there. At 0.3 the model is still far from uniform (about 100 distinct greedy
#: tokens over the prompts) and tandem agreed on 284/288 positions when written.
CALM_INIT_RANGE = 0.3


@pytest.fixture(scope="module")
def calm_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> a tiny model like `tiny_models`' but with `CALM_INIT_RANGE`."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("calm-tiny-models")
    dirs = {}
    state = torch.random.get_rng_state()
    try:
        for arch in TINY_ARCHS:
            config = tiny_config(arch)
            config.initializer_range = CALM_INIT_RANGE
            torch.manual_seed(TINY_SEEDS[arch])
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.save_pretrained(root / arch)
            dirs[arch] = root / arch
    finally:
        torch.random.set_rng_state(state)
    return dirs


def _hf_bf16_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """transformers bf16 greedy `n` tokens (the reference sequence)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        seq = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return seq[0, len(prompt) :].tolist()


def _agreement(model_dir: Path, fused: bool, checking: CheckingKernel) -> tuple[int, int]:
    """(positions where tandem bf16's teacher-forced top-1 equals transformers' bf16 greedy
    token, positions) over 4 prompts x 24 tokens."""
    model = HFStepModel(
        model_dir,
        torch.bfloat16,
        16,
        BLOCK,
        CPU,
        fused=fused,
        decode_kernel=checking,  # type: ignore[arg-type]  # the kernel, wrapped
    )
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in model.kv_caches)
    agree = total = 0
    for prompt in _prompts(4, 9, seed=5):
        ref = _hf_bf16_greedy(model_dir, prompt, 24)
        got = teacher_forced_top1(model, prompt, ref)
        agree += sum(a == b for a, b in zip(got, ref, strict=True))
        total += len(ref)
    return agree, total


def test_teacher_forced_top1_agrees_with_transformers_bf16(calm_models: dict[str, Path]) -> None:
    """The fused bf16 path (bf16 weights and pools, float32 compute, the decode kernel
    checked at each call) given transformers' bf16 greedy prefix predicts its next token at
    >= 95% of positions, pooled over the three tiny architectures."""
    checking = CheckingKernel(_kernel())
    results = [_agreement(calm_models[arch], True, checking) for arch in TINY_ARCHS]
    agree, total = sum(a for a, _ in results), sum(t for _, t in results)
    assert agree / total >= 0.95, f"{results}"
    assert checking.calls > 0 and checking.worst < 1e-4


def test_hf_modules_bf16_with_the_decode_kernel(calm_models: dict[str, Path]) -> None:
    """`fused=False` (transformers' modules in bf16, bf16 queries) also runs the kernel on
    bf16 pools; its output comes back in the query dtype."""
    checking = CheckingKernel(_kernel())
    agree, total = _agreement(calm_models["llama"], False, checking)
    assert agree / total >= 0.95, f"{agree}/{total}"
    assert checking.calls > 0 and checking.worst < 1e-2  # compared after bf16 rounding


def _tiny_bf16_engine(model_dir: Path, **settings: object) -> LLM:
    """A tiny model's engine in bfloat16 on the CPU (`settings` add to or override these)."""
    defaults: dict[str, object] = {"max_model_len": 128, "block_size": BLOCK}
    return LLM(model=str(model_dir), dtype="bfloat16", device="cpu", **(defaults | settings))


def test_bf16_engine_end_to_end(tiny_models: dict[str, Path]) -> None:
    llm = _tiny_bf16_engine(tiny_models["llama"], num_kv_blocks=48, worker_num_threads=1)
    try:
        model = llm.engine.executor.worker.model
        assert model.decode_kernel is not None, "the decode kernel reads bf16 pools"
        assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in model.kv_caches)
        layer = model.fused.layers[0]
        # oneDNN's bf16 GEMM where the CPU has bf16 units, else the weight-only kernel
        linear = PackedLinear if cpu_features.has_bf16_units() else Bf16Linear
        assert isinstance(layer.qkv, linear) and isinstance(model.lm_head, linear)
        assert layer.ln_in.dtype == model.fused.norm_weight.dtype == torch.float32
        checking = CheckingKernel(model.decode_kernel)
        model.decode_kernel = checking
        prompts = _prompts(4, 5, seed=8)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 4
        assert checking.calls > 0 and checking.worst_beyond_a_bf16_step < 1e-5
    finally:
        llm.engine.shutdown()


def test_auto_on_cpu_stays_float32(tiny_models: dict[str, Path]) -> None:
    llm = LLM(
        model=str(tiny_models["llama"]),
        device="cpu",
        max_model_len=64,
        num_kv_blocks=16,
        block_size=4,
    )
    try:
        model = llm.engine.executor.worker.model
        assert all(k.dtype == torch.float32 for k, _ in model.kv_caches)
        float32_linears = (PackedLinear, F32PanelLinear, RowDispatchLinear)
        assert isinstance(model.fused.layers[0].qkv, float32_linears)
        assert not isinstance(model.fused.layers[0].qkv, Bf16Linear)
        assert not model.fused.bf16_cpu
    finally:
        llm.engine.shutdown()


def test_bf16_units_try_onednn_then_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """With bf16 units reported, oneDNN's bf16 reorder is tried; where it refuses (this CPU's
    oneDNN, or a stub), the weight-only `Bf16Linear` serves, float32 in and out."""
    monkeypatch.setattr("tandem.models.linear_choice.has_bf16_units", lambda: True)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    linear = cpu_bf16_linear(weight.bfloat16(), bias)
    x = torch.randn(3, 24)
    y = linear(x)
    assert y.dtype == torch.float32
    want = x @ weight.bfloat16().float().T + bias
    atol = 2e-2 if isinstance(linear, PackedLinear) else 1e-4  # bf16 GEMM rounds its inputs
    torch.testing.assert_close(y, want, atol=atol, rtol=1e-2)


def test_emulated_warning_once_and_recommends_float32(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_features, "has_bf16_units", lambda flags=None: False)
    cpu_features.warn_if_bf16_emulated.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.worker"):
            for _ in range(3):
                cpu_features.warn_if_bf16_emulated()
        messages = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
        assert len(messages) == 1
        assert "float32 compute" in messages[0] or "computed in float32" in messages[0]
        assert "float32 is recommended" in messages[0]
    finally:
        cpu_features.warn_if_bf16_emulated.cache_clear()


@pytest.mark.skipif(not cpu_features.has_bf16_units(), reason="oneDNN's bf16 GEMM needs bf16 units")
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_bf16_operands_give_the_bits_of_the_cast_per_linear_path(
    tiny_models: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every linear a oneDNN bf16 GEMM the decoder keeps the GEMMs' operands in
    bfloat16 between them (`FusedDecoder._layers_bf16`): tokens and logprobs are those of
    the path that casts each operand (`TANDEM_BF16_OPERANDS=0`), over staggered requests
    (prefill chunks beside decodes) and with Qwen2's biases and Qwen3's q/k norms."""
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("TANDEM_BF16_OPERANDS", flag)
        llm = _tiny_bf16_engine(
            tiny_models[arch], num_kv_blocks=64, max_num_batched_tokens=24, worker_num_threads=2
        )
        try:
            fused = llm.engine.executor.worker.model.fused
            assert fused.bf16_operands is (flag == "1")
            params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)
            outs = llm.generate(_prompts(5, 7, seed=11), params, use_tqdm=False)
            runs[flag] = [
                (o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs])
                for o in outs
            ]
        finally:
            llm.engine.shutdown()
    assert runs["1"] == runs["0"]
