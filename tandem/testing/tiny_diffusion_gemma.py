"""Tiny random DiffusionGemma checkpoints and the two sides of a forward-parity check.

Built from configs, never downloaded. `DIFFUSION_GEMMA_CONFIGS`: `tf_test`, transformers'
own test shape (2 layers, a sliding window of 512 larger than every test context,
`per_layer_config`, `use_bidirectional_attention="vision"`, 4 experts top-2, vision hidden
16 x 2 layers, L = 16), and `window` (4 layers alternating sliding/full, sliding window 5,
`global_head_dim` 16 with one global KV head, L = 4). `tiny_diffusion_gemma(text, L)`
builds one at 5x transformers' init scale with every all-ones tensor perturbed (norm
weights, router scales, the encoder's and decoder's separate `layer_scalar`s), so a wrong
branch, mask or scalar moves the O(1) logits far above float noise.

`PagedContexts` drives tandem's side (`DiffusionGemmaModel` with a trivial block allocator,
contexts by request id); `reference_logits` the reference's own calls, as `generate()` makes
them (G:`_prepare_encoder_inputs` + `model.encoder(...)` for the prompt and each committed
canvas; the decoder mask of G:`_prepare_denoiser_inputs` and the call of
G:`_denoising_step`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache

from tandem.core.worker.block_diffusion import DenoiseContext
from tandem.core.worker.flat_batch import FlatBatch
from tandem.models.diffusion_gemma import DiffusionGemmaModel

VISION = {
    "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 1, "intermediate_size": 37, "patch_size": 5, "image_size": 20,
}  # fmt: skip
MOE = {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8}
DIFFUSION_GEMMA_CONFIGS = {
    "tf_test": (
        {
            "vocab_size": 99, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "per_layer_config": {1: {"head_dim": 16, "num_key_value_heads": 2}},
            "use_bidirectional_attention": "vision", "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, **MOE,
        },
        16,
    ),
    "window": (
        {
            "vocab_size": 64, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "global_head_dim": 16, "num_global_key_value_heads": 1, "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention"] * 2, **MOE,
        },
        4,
    ),
}  # fmt: skip
#: Tokens per KV block in the harness.
BLOCK = 4


def perturb_ones(model: DiffusionGemmaForBlockDiffusion) -> None:
    """Move every all-ones parameter and buffer (norm weights, router scales, layer
    scalars: encoder's and decoder's differ) off 1, so the test sees each of them."""
    with torch.no_grad():
        for _, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and tensor.numel() and bool((tensor == 1).all()):
                tensor.add_(0.3 * torch.randn_like(tensor))


def tiny_diffusion_gemma(text: dict, canvas: int) -> DiffusionGemmaForBlockDiffusion:
    """A random model with weights 5x transformers' default scale (logits of order 1-10,
    so a wrong mask or branch shows far above the tolerance), ones perturbed."""
    torch.manual_seed(0)
    config = DiffusionGemmaConfig(
        text_config=text, vision_config=VISION, canvas_length=canvas, initializer_range=0.1
    )
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    perturb_ones(model)
    return model


class PagedContexts:
    """tandem's side: the model, a trivial block allocator and each request's table."""

    def __init__(
        self, path: Path, num_blocks: int = 96, dtype: torch.dtype = torch.float32
    ) -> None:
        cpu = torch.device("cpu")
        self.model = DiffusionGemmaModel(path, dtype, num_blocks, BLOCK, cpu)
        for k, v in self.model.kv.per_layer:  # unwritten slots must never reach a logit
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def grow(self, req: str, new_len: int) -> None:
        table = self.tables.setdefault(req, [])
        while len(table) * BLOCK < new_len:
            table.append(self.free.pop())

    def encode(self, chunks: list[tuple[str, list[int]]]) -> None:
        """One `encode` call: each request's next tokens, appended to its context."""
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for req, tokens in chunks:
            start = self.lens.get(req, 0)
            self.grow(req, start + len(tokens))
            table = self.tables[req]
            for p in range(start, start + len(tokens)):
                slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
            ids += tokens
            pos += range(start, start + len(tokens))
            qsl.append(len(ids))
            seq_lens.append(start + len(tokens))
            self.lens[req] = start + len(tokens)
        i64 = torch.int64
        self.model.encode(
            FlatBatch(
                req_ids=[r for r, _ in chunks], input_ids=torch.tensor(ids, dtype=i64),
                positions=torch.tensor(pos, dtype=i64), slot_mapping=torch.tensor(slots, dtype=i64),
                query_start_loc=torch.tensor(qsl, dtype=i64),
                seq_lens=torch.tensor(seq_lens, dtype=i64),
                block_tables=self.block_tables([r for r, _ in chunks]),
                logits_indices=torch.zeros(0, dtype=i64), sample_req_indices=[],
                num_draft_tokens=[], draft_token_ids=[], block_size=BLOCK,
            )
        )  # fmt: skip

    def block_tables(self, reqs: list[str]) -> torch.Tensor:
        width = max(len(self.tables.get(r, [])) for r in reqs) or 1
        rows = [self.tables.get(r, []) + [0] * (width - len(self.tables.get(r, []))) for r in reqs]
        return torch.tensor(rows, dtype=torch.int64)

    def denoise(
        self, reqs: list[str], canvas: torch.Tensor, sc: torch.Tensor | None, has: list[bool]
    ) -> torch.Tensor:
        context = DenoiseContext(
            req_ids=reqs,
            block_tables=self.block_tables(reqs),
            context_lens=torch.tensor([self.lens.get(r, 0) for r in reqs], dtype=torch.int64),
            has_self_cond=torch.tensor(has),
            block_size=BLOCK,
        )
        return self.model.denoise(canvas, sc, context)

    def release(self, req: str) -> None:
        self.free.extend(self.tables.pop(req))
        self.lens.pop(req)


def reference_logits(
    hf: DiffusionGemmaForBlockDiffusion,
    prompt: list[int],
    canvases: list[list[int]],
    canvas: torch.Tensor,
    sc: torch.Tensor | None,
) -> torch.Tensor:
    """transformers: encode `prompt`, then each committed canvas, as `generate()` does; then
    the decoder step on `canvas [L]` with self-conditioning `sc [L, V]` or None."""
    length = hf.config.canvas_length
    cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
    input_ids = torch.tensor([prompt])
    positions = torch.arange(0, len(prompt), dtype=torch.int32)[None]
    for k in range(len(canvases) + 1):
        if k > 0:
            input_ids = torch.cat([input_ids, torch.tensor([canvases[k - 1]])], dim=1)
            start = input_ids.shape[1] - length
            positions = torch.arange(start, start + length, dtype=torch.int32)[None]
        mask = torch.ones(input_ids.shape, dtype=torch.bool)
        new_ids, mask_map = hf._prepare_encoder_inputs(
            input_ids=input_ids, attention_mask=mask, encoder_position_ids=positions,
            cache=cache, is_prefill=k == 0, canvas_length=length, batch_size=1,
        )  # fmt: skip
        cache = hf.model.encoder(
            input_ids=new_ids, attention_mask=mask_map, cache=cache, position_ids=positions
        ).cache
    cur = input_ids.shape[1]
    decoder_mask = torch.ones((1, cur + length), dtype=torch.bool)
    mask_mapping = hf.model.decoder.create_diffusion_decoder_attention_mask(
        config=hf.config, inputs_embeds=canvas[None, :, None], cache=cache,
        decoder_attention_mask=decoder_mask,
    )  # fmt: skip
    out = hf(
        decoder_input_ids=canvas[None], self_conditioning_logits=None if sc is None else sc[None],
        decoder_attention_mask=mask_mapping, cache=cache,
        decoder_position_ids=torch.arange(cur, cur + length, dtype=torch.int32)[None],
    )  # fmt: skip
    return out.logits[0]
