"""The EAGLE draft head: one Llama decoder layer over (token embedding, target hidden state).

At position p the head reads the target's last hidden state at p (after the target's final
norm) and the embedding of token p+1 (through the target's own embedding), and produces a
feature that stands for the target's hidden state at p+1: the target's LM head turns it
into a prediction of token p+2. Drafting feeds that feature back in with the drafted token,
so one head forward per draft position.

    x = fc([rms(embed(token p+1)) ; rms(hidden p)])      fc: 2H -> H (with bias)
    x = x + o(attn(rope(q(rms(x))), rope(k(rms(x))), v(rms(x))))
    x = x + down(silu(gate(rms(x))) * up(rms(x)))
    feature = rms(x)                                      -> target LM head

The layer's shape follows the target (hidden size, heads, head_dim) so the target's rotary
module applies; its KV has one layer. A checkpoint directory holds `config.json` (the
`EagleHeadConfig` fields, `"architecture": "tandem-eagle-llama"`) and `model.safetensors`
(this module's `state_dict`). The math is written once (`EagleHead.layer`) with the
attention passed in, so training (causal SDPA over padded sequences) and serving (paged
attention over a flattened batch) run the same code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "tandem-eagle-llama"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

#: attend(q [..., T, Hq, D], k [..., T, Hkv, D], v [..., T, Hkv, D]) -> [..., T, Hq, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class EagleHeadConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    #: The target's vocabulary and hidden size: a head only serves a matching target.
    target_vocab_size: int
    target_hidden_size: int
    #: Drafts come from this many target token ids (`EagleHead.draft_vocab`, e.g. the
    #: tokens of the training data): the LM head is applied to those rows only, which is
    #: most of the drafting cost on a 49k vocabulary. 0: the whole target vocabulary.
    draft_vocab_size: int = 0

    @classmethod
    def for_target(cls, hf_config, intermediate_size: int | None = None) -> EagleHeadConfig:  # noqa: ANN001
        """A head shaped like one layer of the target described by `hf_config`."""
        head_dim = (
            getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads
        )
        return cls(
            hidden_size=hf_config.hidden_size,
            num_attention_heads=hf_config.num_attention_heads,
            num_key_value_heads=hf_config.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size or hf_config.intermediate_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            target_vocab_size=hf_config.vocab_size,
            target_hidden_size=hf_config.hidden_size,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [..., T, H, D]` with `cos`/`sin` `[..., T, 1, D]` (HF's half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class EagleHead(nn.Module):
    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        if config.hidden_size != config.target_hidden_size:
            raise ValueError("the head's hidden size must equal the target's")
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.embed_norm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.post_attention_norm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.draft_vocab: torch.Tensor | None
        if config.draft_vocab_size:
            self.register_buffer(
                "draft_vocab", torch.arange(config.draft_vocab_size, dtype=torch.int64)
            )
        else:
            self.draft_vocab = None

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        """Features `[..., T, H]` from token embeddings and target (or head) hidden states
        `[..., T, H]`; `cos`/`sin` `[..., T, 1, D]` are the rotary terms of each position."""
        eps = self.config.rms_norm_eps
        x = self.fc(
            torch.cat(
                (rms_norm(embeds, self.embed_norm, eps), rms_norm(hidden, self.hidden_norm, eps)),
                dim=-1,
            )
        )
        shape = x.shape[:-1]
        d = self.config.head_dim
        y = rms_norm(x, self.input_norm, eps)
        q = apply_rope(self.q_proj(y).view(*shape, -1, d), cos, sin)
        k = apply_rope(self.k_proj(y).view(*shape, -1, d), cos, sin)
        v = self.v_proj(y).view(*shape, -1, d)
        x = x + self.o_proj(attend(q, k, v).reshape(*shape, -1))
        y = rms_norm(x, self.post_attention_norm, eps)
        x = x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return rms_norm(x, self.norm, eps)


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Training attention: `[B, T, H, D]` causal within each sequence."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


def save_eagle_head(head: EagleHead, directory: Path | str) -> Path:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architecture": ARCHITECTURE, **asdict(head.config)}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    state = {
        k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous()
        for k, v in head.state_dict().items()
    }
    save_file(state, str(directory / WEIGHTS_FILE))
    return directory


def load_eagle_head(
    directory: Path | str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> EagleHead:
    """Load a head written by `save_eagle_head`; errors name the directory and the problem."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"EAGLE head: {config_path} not found")
    raw = json.loads(config_path.read_text())
    if raw.pop("architecture", None) != ARCHITECTURE:
        raise ValueError(f"EAGLE head: {config_path} is not a {ARCHITECTURE!r} checkpoint")
    head = EagleHead(EagleHeadConfig(**raw))
    head.load_state_dict(load_file(str(directory / WEIGHTS_FILE)))
    vocab = head.draft_vocab
    if vocab is not None and int(vocab.max()) >= head.config.target_vocab_size:
        raise ValueError(f"EAGLE head: {directory} drafts ids outside the target vocabulary")
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def save_random_eagle_head(
    target_dir: Path | str,
    out_dir: Path | str,
    seed: int = 0,
    intermediate_size: int | None = None,
    draft_vocab: list[int] | None = None,
) -> Path:
    """A randomly initialised head for the target in `target_dir` (tests: drafts are
    arbitrary, so only acceptance changes, never the outputs), drafting from `draft_vocab`
    (target token ids) when given."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(target_dir))
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        config = EagleHeadConfig.for_target(hf_config, intermediate_size)
        if draft_vocab is not None:
            config = replace(config, draft_vocab_size=len(draft_vocab))
        head = EagleHead(config)
        if draft_vocab is not None:
            head.draft_vocab.copy_(torch.tensor(draft_vocab, dtype=torch.int64))
    finally:
        torch.random.set_rng_state(state)
    return save_eagle_head(head, out_dir)
