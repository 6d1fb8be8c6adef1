"""Issue 15 parity (c) through the whole engine: DiffusionGemma under the diffusion scheduler,
the runner's diffusion path and the denoising sampler equals transformers' `generate()`.

The engine draws with one generator per (request seed, canvas index, step)
(`step_generator_seed`), so the reference is fed the same noise: during its batch-1
`generate()`, `torch.randint` / `torch.multinomial` are replaced by the same calls on those
keyed generators, following the reference's draw order (docs/diffusion-reference.md section
5: a canvas's initial `randint`, then per step `multinomial` and `randint`). Batched engine
runs (requests of different prompt lengths and seeds, sync and async scheduling, a KV pool
small enough to preempt) must equal each request's own reference run, trimmed to max_tokens.

The checkpoints are plain directories: `model_loader_for` hands them to `DiffusionGemmaLoader`
because it claims them (`config.json` `model_type`), so `LLM(model=dir)` builds the
diffusion stack by itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore
from tandem.core.worker.model_loader import model_loader_for
from tandem.models.diffusion_gemma_loader import DiffusionGemmaLoader
from tandem.plugins.diffusion_denoise import step_generator_seed
from tandem.schema.config import ConfigError, EngineConfig
from tandem.stack_file import load_config
from tandem.testing.engine import collect_outputs, make_request
from tandem.testing.tiny_diffusion_gemma import DIFFUSION_GEMMA_CONFIGS, tiny_diffusion_gemma
from tests.diffusion.gemma_workload import PROMPTS, SEEDS, run

SCHEDULE = {"max_denoising_steps": 3, "t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1}


@pytest.fixture(scope="module", params=sorted(DIFFUSION_GEMMA_CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    text, canvas = DIFFUSION_GEMMA_CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    tiny_diffusion_gemma(text, canvas).save_pretrained(path)
    return path


def engine(path: Path, **overrides: Any) -> EngineCore:
    base = EngineConfig.model_validate(
        {"diffusion": {**SCHEDULE, **overrides.pop("diffusion", {})}}
    )
    # On the CPU everywhere: the reference replays the engine's keyed draws on CPU generators,
    # and a CUDA generator draws a different stream from the same seed.
    settings = {"model": str(path), "device": "cpu", "block_size": 4, "max_model_len": 64}
    return EngineCore(resolve_config(load_config(base, **{**settings, **overrides})))


class KeyedDraws:
    """Replaces `torch.randint` / `torch.multinomial` during one batch-1 `generate()` with
    the same draws on the engine's keyed generators (canvas c: step -1, then 0, 1, ...)."""

    def __init__(self, seed: int) -> None:
        self.seed, self.canvas, self.step = seed, -1, 0
        self.after_step = True  # the next randint starts a canvas
        self.gen = torch.Generator()
        self.real_randint, self.real_multinomial = torch.randint, torch.multinomial

    def _key(self, step: int) -> None:
        self.gen.manual_seed(step_generator_seed(self.seed, self.canvas, step))

    def randint(self, low: int, high: int, size: tuple[int, ...], **kw: Any) -> torch.Tensor:
        if self.after_step:  # a canvas's initial tokens
            self.canvas, self.step = self.canvas + 1, 0
            self._key(-1)
        else:  # the renoising draw of the current step, on the step's generator
            self.after_step, self.step = True, self.step + 1
            return self.real_randint(low, high, size, generator=self.gen, **kw)
        self.after_step = True
        return self.real_randint(low, high, size, generator=self.gen, **kw)

    def multinomial(self, probs: torch.Tensor, num_samples: int, **kw: Any) -> torch.Tensor:
        self._key(self.step)
        self.after_step = False
        return self.real_multinomial(probs, num_samples, generator=self.gen, **kw)

    def __enter__(self) -> KeyedDraws:
        torch.randint, torch.multinomial = self.randint, self.multinomial  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.randint, torch.multinomial = self.real_randint, self.real_multinomial  # type: ignore[assignment]


def reference(hf: Any, prompt: list[int], seed: int, max_tokens: int) -> list[int]:
    length = hf.config.canvas_length
    with KeyedDraws(seed), torch.inference_mode():
        seq = hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens,
            max_denoising_steps=SCHEDULE["max_denoising_steps"], t_min=SCHEDULE["t_min"],
            t_max=SCHEDULE["t_max"], stability_threshold=1, confidence_threshold=0.005,
            eos_token_id=None,
        ).sequences[0, len(prompt) :]  # fmt: skip
    assert seq.numel() == -(-max_tokens // length) * length
    return seq[:max_tokens].tolist()


@pytest.fixture
def hf_model(checkpoint: Path) -> Iterator[Any]:
    from transformers import DiffusionGemmaForBlockDiffusion

    yield DiffusionGemmaForBlockDiffusion.from_pretrained(str(checkpoint)).eval()


@pytest.mark.parametrize(
    ("async_scheduling", "tight_kv"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_engine_tokens_equal_generate_with_the_same_noise(
    checkpoint: Path, hf_model: Any, async_scheduling: bool, tight_kv: bool
) -> None:
    length = hf_model.config.canvas_length
    max_tokens = length + length // 2  # two canvases, the second trimmed
    # tight_kv: room for about one request's context and canvases at a time (preemptions)
    blocks = (len(PROMPTS[0]) + 2 * length) // 4 + 2 if tight_kv else 64
    core = engine(
        checkpoint,
        async_scheduling=async_scheduling,
        num_kv_blocks=blocks,
        max_model_len=4 * blocks,
    )
    got = run(core, max_tokens)
    if tight_kv:
        assert core.stats()["num_preemptions"] > 0  # canvases restarted after a recompute
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"] == reference(hf_model, prompt, SEEDS[i], max_tokens), i


def test_loader_fills_limits_and_the_diffusion_defaults(checkpoint: Path) -> None:
    from tandem.models.diffusion_gemma import kv_bytes_per_token

    config = resolve_config(load_config(EngineConfig(), model=str(checkpoint), block_size=4))
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(checkpoint))
    text = hf_config.text_config
    assert config.model.vocab_size == text.vocab_size
    per_block = 4 * kv_bytes_per_token(hf_config, torch.float32)
    assert (
        config.cache.num_kv_blocks == int(config.cache.kv_cache_memory_gib * (1 << 30)) // per_block
    )
    d = config.diffusion
    assert d is not None and d.canvas_length == hf_config.canvas_length
    assert (d.max_denoising_steps, d.t_min, d.t_max, d.entropy_bound) == (48, 0.4, 0.8, 0.1)
    assert (d.stability_threshold, d.confidence_threshold, d.acceptance) == (1, 0.005, "entropy")
    assert not DiffusionGemmaLoader.claims(checkpoint.parent)


def test_prefix_cache_hits_on_committed_canvases_keep_parity(
    checkpoint: Path, hf_model: Any
) -> None:
    """Second wave: each prompt extended by its first-wave output, on the same engine. Its
    blocks are prefix-cache hits as far as the first wave encoded them (prompt, committed
    canvases but the last, which finished unencoded and must not be hashed)."""
    length = hf_model.config.canvas_length
    core = engine(checkpoint)
    first = run(core, 2 * length)
    hits_before = core.stats()["prefix_cache_hits"]
    extended = [PROMPTS[i] + first[f"r{i}"] for i in range(len(PROMPTS))]
    for i, prompt in enumerate(extended):
        request = make_request(f"s{i}", prompt, eos_token_id=None, max_tokens=length, seed=i)
        core.add_request(request)
    second = {rid: toks for rid, (toks, _) in collect_outputs(core, max_steps=500).items()}
    assert core.stats()["prefix_cache_hits"] > hits_before
    for i, prompt in enumerate(extended):
        assert second[f"s{i}"] == reference(hf_model, prompt, i, length), i


def test_llm_on_a_directory_picks_the_diffusion_stack_by_itself(
    checkpoint: Path, hf_model: Any
) -> None:
    assert model_loader_for(str(checkpoint)) is DiffusionGemmaLoader
    llm = LLM(
        model=str(checkpoint), device="cpu", block_size=4, max_model_len=64, diffusion=SCHEDULE
    )
    try:
        names = [spec.name for spec in llm.config.resolved_stack or []]
        assert "diffusion-scheduler" in names and "diffusion-sampler" in names
        max_tokens = hf_model.config.canvas_length + 1
        params = SamplingParams(max_tokens=max_tokens, seed=SEEDS[0], ignore_eos=True)
        out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length"
        assert list(out.token_ids) == reference(hf_model, PROMPTS[0], SEEDS[0], max_tokens)
    finally:
        llm.shutdown()


def test_an_autoregressive_option_on_the_directory_names_the_key(checkpoint: Path) -> None:
    speculative = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match=r"^speculative: drafts do not apply"):
        LLM(model=str(checkpoint), block_size=4, max_model_len=64, speculative=speculative)
