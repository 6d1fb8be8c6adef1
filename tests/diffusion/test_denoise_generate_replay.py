"""The draw order of docs/diffusion-reference.md, checked against the real `generate()`.

A tiny randomly initialised DiffusionGemma (no weights: 2 text layers, one sliding and one
full-attention with its own `global_head_dim`, 4 experts top-2, a 2-layer vision tower)
generates two canvases at batch 1 after `torch.manual_seed(seed)`. A spy on `forward`
records what the decoder saw and returned; tandem's denoising functions, fed those raw
logits and one `torch.Generator` seeded `seed` (consumed in the documented order), must
reproduce every decoder input canvas, every self-conditioning input and the committed tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

from tandem.plugins.diffusion_denoise import (
    DenoiseSchedule,
    StabilityState,
    denoise_step,
    draw_initial_canvas,
)

V, L, STEPS = 64, 4, 5


def tiny_model() -> DiffusionGemmaForBlockDiffusion:
    text = {
        "vocab_size": V, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
        "global_head_dim": 8, "num_global_key_value_heads": 1,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
        "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    vision = {
        "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 1, "intermediate_size": 37, "patch_size": 5,
    }  # fmt: skip
    torch.manual_seed(0)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=L)
    return DiffusionGemmaForBlockDiffusion(config).eval()


@pytest.mark.parametrize(
    ("confidence", "stability", "expected_calls"),
    [(0.005, 1, 2 * STEPS), (5.0, 0, 2)],  # runs out of steps / stops at each first step
)
def test_generate_at_batch_one_replays_on_a_per_request_generator(
    confidence: float, stability: int, expected_calls: int
) -> None:
    model = tiny_model()
    calls: list[dict[str, torch.Tensor | None]] = []
    forward = model.forward

    def spy(**kwargs: object) -> object:
        out = forward(**kwargs)
        sc = kwargs["self_conditioning_logits"]
        calls.append(
            {
                "canvas": kwargs["decoder_input_ids"].clone(),
                "positions": kwargs["decoder_position_ids"].clone(),
                "self_conditioning": None if sc is None else sc.clone(),
                "logits": out.logits.clone(),
            }
        )
        return out

    model.forward = spy
    prompt = torch.tensor([[1, 7, 8, 9, 10, 11]])  # longer than the sliding window
    seed = 1234
    torch.manual_seed(seed)
    out = model.generate(
        prompt, max_new_tokens=2 * L, max_denoising_steps=STEPS, t_min=0.4, t_max=0.8,
        stability_threshold=stability, confidence_threshold=confidence,
    )  # fmt: skip

    schedule = DenoiseSchedule.build(
        max_denoising_steps=[STEPS], t_min=[0.4], t_max=[0.8], stability_threshold=[stability],
        confidence_threshold=[confidence], acceptance_param=[0.1],
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    k, committed = 0, []
    for canvas_index in range(2):
        canvas = draw_initial_canvas([gen], L, V, "cpu")
        state, self_cond = StabilityState.fresh(1, L, "cpu"), None
        start = prompt.shape[1] + canvas_index * L
        for step in range(STEPS):
            call = calls[k]
            k += 1
            assert torch.equal(call["canvas"], canvas), (canvas_index, step)
            assert torch.equal(
                call["positions"][0], torch.arange(start, start + L, dtype=torch.int32)
            )
            if self_cond is None:
                assert call["self_conditioning"] is None
            else:
                assert torch.equal(call["self_conditioning"], self_cond)
            res = denoise_step(call["logits"], canvas, torch.tensor([step]), schedule, state, [gen])
            canvas, state, self_cond = res.canvas, res.stability, res.processed_logits
            if bool(res.commit):
                committed.append(res.argmax_canvas)
                break
    assert k == len(calls)  # no decoder call left unexplained
    assert k == expected_calls
    assert torch.equal(out.sequences, torch.cat([prompt, *committed], dim=-1))


def test_an_empty_batch_is_a_no_op() -> None:
    schedule = DenoiseSchedule.build(
        max_denoising_steps=[], t_min=[], t_max=[], stability_threshold=[],
        confidence_threshold=[], acceptance_param=[],
    )  # fmt: skip
    canvas = draw_initial_canvas([], L, V, "cpu")
    empty_step = torch.zeros(0, dtype=torch.long)
    state = StabilityState.fresh(0, L, "cpu")
    res = denoise_step(torch.zeros(0, L, V), canvas, empty_step, schedule, state, [])
    assert res.canvas.shape == (0, L) and res.commit.shape == (0,)
