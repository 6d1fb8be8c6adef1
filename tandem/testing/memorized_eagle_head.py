"""An EAGLE head that has memorised a target's greedy continuations of a few prompts, so
that drafting tests see long accepted runs on those prompts (a random head's drafts are
almost always rejected)."""

from __future__ import annotations

from pathlib import Path

import torch


def train_memorized_head(
    target_dir: Path, prompts: list[list[int]], new_tokens: int, out_dir: Path
) -> Path:
    """Train a head (60 AdamW steps, ~2 s on a tiny target) on the target's greedy
    continuations of `prompts` (equal lengths): soft cross-entropy to the target's
    next-token distribution through the shared LM head plus feature regression, with a
    second pass on its own features; saved to `out_dir`, which is returned. Seeded: the
    same head every time."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from tandem.spec_decode.eagle_head import (
        EagleHead,
        EagleHeadConfig,
        causal_attend,
        save_eagle_head,
    )

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        sequences = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        hidden = target.model(input_ids=sequences).last_hidden_state
    sequences, hidden = sequences.clone(), hidden.clone()  # out of inference mode, for autograd
    weight = target.lm_head.weight.detach()
    with torch.no_grad():
        embeds = target.model.embed_tokens(sequences[:, 1:])
        positions = torch.arange(embeds.shape[1])[None].expand(embeds.shape[0], -1)
        cos, sin = target.model.rotary_emb(embeds, positions)
        cos, sin = cos[:, :, None], sin[:, :, None]
        teacher = (hidden[:, 1:] @ weight.T).softmax(-1)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    head = EagleHead(EagleHeadConfig.for_target(target.config))
    torch.random.set_rng_state(state)
    optim = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(60):
        inputs, loss = hidden[:, :-1], torch.zeros(())
        for _unroll in range(2):
            features = head(embeds, inputs, cos, sin, causal_attend)
            student = (features @ weight.T).log_softmax(-1)
            loss = loss - (teacher * student).sum(-1).mean()
            loss = loss + F.smooth_l1_loss(features, hidden[:, 1:])
            inputs = torch.cat((hidden[:, :1], features[:, :-1]), dim=1)
        optim.zero_grad()
        loss.backward()
        optim.step()
    return save_eagle_head(head, out_dir)
