"""Model shapes and device specs as data, for the cost models (`roofline`).

A `ModelShape` is the part of an HF `config.json` a cost model needs: the linear layers'
sizes, the attention geometry (KV heads, head dims, sliding windows), the experts. Named
shapes embed their published config values (`NAMED_MODEL_CONFIGS`, each citing its HF repo);
`ModelShape.from_hf_config` reads any other config dict. A `DeviceSpec` is a device's
published peak numbers (`NAMED_DEVICES`), or this CPU's, measured (`this_cpu`).

Units: parameters are counts, bytes are bytes, FLOP/s and bytes/s per device (one rank).
Norms, biases, rotary tables and the embedding gather are not counted: they are small next
to the linear layers.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Layers sharing one attention geometry: `num_layers` layers of `num_kv_heads` KV heads
    of `head_dim`, each query attending causally to at most `window` keys (0: no window)."""

    num_layers: int
    head_dim: int
    num_kv_heads: int
    window: int = 0

    def keys_attended(self, context: int, query: int) -> float:
        """Keys summed over `query` new tokens after `context` cached ones, one layer and one
        head: sum over k in [c+1, c+q] of min(k, window); without a window
        q * (c + (q + 1) / 2) (the (q+1)/2: the causal mask within the chunk)."""
        if self.window <= 0 or context + query <= self.window:
            return query * (context + (query + 1) / 2)
        unwindowed = max(0, self.window - context)  # the first tokens still see every key
        return unwindowed * (context + (unwindowed + 1) / 2) + (query - unwindowed) * self.window

    def keys_read(self, context: int, query: int) -> int:
        """KV entries one layer reads for the chunk: its whole span c + q, or with a window
        the last window + q - 1 tokens."""
        span = context + query
        return span if self.window <= 0 else min(span, self.window + query - 1)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder's sizes, from HF-config fields (`from_hf_config`).

    Dense when `num_experts == 0`. With experts, every layer has a router, `num_experts`
    experts of width `moe_intermediate_size` (0: `intermediate_size`, Mixtral's layout) of
    which each token uses `num_experts_per_tok`, and an always-on MLP of width
    `shared_intermediate_size` beside them (0: none; Qwen2-MoE's shared expert, Gemma 4's
    dense branch). Attention: `num_sliding_layers` layers attend to at most `sliding_window`
    keys with `head_dim`/`num_key_value_heads`; the others are full layers with
    `global_head_dim`/`num_global_key_value_heads` (0: the same as the sliding ones).
    `head_dim` 0 means hidden_size / num_attention_heads. Every MLP is gated (gate, up, down).
    Invariants (checked): sizes positive, KV heads <= heads, experts_per_tok <= experts.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    sliding_window: int = 0
    num_sliding_layers: int = 0
    global_head_dim: int = 0
    num_global_key_value_heads: int = 0
    dtype_bytes: int = 2
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.global_head_dim == 0:
            object.__setattr__(self, "global_head_dim", self.head_dim)
        if self.num_global_key_value_heads == 0:
            object.__setattr__(self, "num_global_key_value_heads", self.num_key_value_heads)
        sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        for size in (*sizes, "num_key_value_heads", "head_dim", "dtype_bytes"):
            if getattr(self, size) <= 0:
                raise ValueError(f"{self.name}: {size} must be positive")
        if self.num_key_value_heads > self.num_attention_heads:
            raise ValueError(f"{self.name}: more KV heads than attention heads")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.name}: num_experts_per_tok must be in [1, num_experts]")
        if not 0 <= self.num_sliding_layers <= self.num_hidden_layers:
            raise ValueError(f"{self.name}: num_sliding_layers must be in [0, layers]")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def attention_groups(self) -> tuple[AttentionGroup, ...]:
        """The layers by attention geometry: sliding layers (if any), then full layers."""
        sliding, full = self.num_sliding_layers, self.num_hidden_layers - self.num_sliding_layers
        kv, kv_full = self.num_key_value_heads, self.num_global_key_value_heads
        groups = (
            AttentionGroup(sliding, self.head_dim, kv, self.sliding_window),
            AttentionGroup(full, self.global_head_dim, kv_full),
        )
        return tuple(g for g in groups if g.num_layers)

    def _attention_params(self, group: AttentionGroup) -> int:
        """q and o (heads x head_dim each way), k and v (KV heads x head_dim), one layer."""
        heads = self.num_attention_heads + group.num_kv_heads
        return 2 * self.hidden_size * heads * group.head_dim

    def _mlp_params(self, experts: float) -> float:
        """One layer's MLP parameters with `experts` routed experts counted (dense: gate, up,
        down; MoE: router, the shared MLP and `experts` experts)."""
        if not self.is_moe:
            return 3 * self.hidden_size * self.intermediate_size
        width = self.moe_intermediate_size or self.intermediate_size
        router = self.hidden_size * self.num_experts
        shared = 3 * self.hidden_size * self.shared_intermediate_size
        return router + shared + experts * 3 * self.hidden_size * width

    def layer_params(self, experts: float | None = None) -> float:
        """Linear parameters of all decoder layers (no LM head), counting `experts` routed
        experts per layer (None: all of them)."""
        attention = sum(g.num_layers * self._attention_params(g) for g in self.attention_groups())
        count = self.num_experts if experts is None else experts
        return attention + self.num_hidden_layers * self._mlp_params(count)

    def touched_experts(self, num_tokens: int) -> int:
        """Experts a batch of `num_tokens` reads per layer, approximated as
        min(num_experts, tokens x experts_per_tok) (0 for a dense model)."""
        return min(self.num_experts, num_tokens * self.num_experts_per_tok)

    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    def params_linear(self) -> float:
        """Every linear weight: per layer q, k, v, o, gate, up, down (all experts, router,
        shared MLP), plus the LM head."""
        return self.layer_params() + self.lm_head_params()

    def active_params_linear(self) -> float:
        """Linear weights one token multiplies by: the experts it is routed to, not all."""
        return self.layer_params(self.num_experts_per_tok) + self.lm_head_params()

    def weight_bytes(self, num_tokens: int | None = None) -> float:
        """Bytes of linear weights a step of `num_tokens` reads (None: all of them): the
        layers, with only the touched experts of an MoE, and the LM head."""
        experts = None if num_tokens is None else self.touched_experts(num_tokens)
        return (self.layer_params(experts) + self.lm_head_params()) * self.dtype_bytes

    def resident_bytes(self) -> float:
        """Bytes of weights held in memory: all linear weights, plus the embedding table
        when it is not tied to the LM head."""
        embedding = 0 if self.tie_word_embeddings else self.lm_head_params()
        return (self.params_linear() + embedding) * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token holds: 2 (K and V) x layers x KV heads x head_dim x
        dtype_bytes, summed over the attention groups (a window's cap is not applied)."""
        return sum(
            2 * g.num_layers * g.num_kv_heads * g.head_dim * self.dtype_bytes
            for g in self.attention_groups()
        )

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], name: str | None = None, dtype_bytes: int = 2
    ) -> ModelShape:
        """The shape of an HF `config.json` dict; a multimodal config's `text_config` is read
        with the top level's keys as fallbacks. Raises ValueError naming a missing key."""
        cfg = dict(config)
        text = cfg.pop("text_config", None)
        if isinstance(text, Mapping):
            cfg.update({k: v for k, v in text.items() if v is not None})
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            layers, vocab = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as exc:
            raise ValueError(f"model config has no {exc.args[0]!r}") from exc
        experts = int(_first(cfg, "num_experts", "num_local_experts", "n_routed_experts"))
        window, sliding = _sliding_layers(cfg, layers)
        return cls(
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(_first(cfg, "num_key_value_heads", default=heads)),
            vocab_size=vocab,
            head_dim=int(_first(cfg, "head_dim")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts,
            num_experts_per_tok=int(_first(cfg, "num_experts_per_tok", "top_k_experts")),
            moe_intermediate_size=int(_first(cfg, "moe_intermediate_size")),
            shared_intermediate_size=_shared_width(cfg, experts, inter),
            sliding_window=window,
            num_sliding_layers=sliding,
            global_head_dim=int(_first(cfg, "global_head_dim")),
            num_global_key_value_heads=int(_first(cfg, "num_global_key_value_heads")),
            dtype_bytes=dtype_bytes,
            name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "custom"),
        )


def _first(cfg: Mapping[str, Any], *keys: str, default: int = 0) -> Any:
    """The first of `keys` set (not None) in `cfg`, else `default`."""
    return next((cfg[k] for k in keys if cfg.get(k) is not None), default)


def _sliding_layers(cfg: Mapping[str, Any], layers: int) -> tuple[int, int]:
    """(window, sliding layers) of a config. The window counts only where the config says
    which layers slide: `layer_types`, `sliding_window_pattern` (every p-th layer full) or
    `use_sliding_window` true (all layers); else every layer is full (an overestimate of a
    model whose code implies the pattern)."""
    window = int(cfg.get("sliding_window") or 0)
    if window <= 0:
        return 0, 0
    if cfg.get("layer_types"):
        sliding = sum(1 for t in cfg["layer_types"] if t == "sliding_attention")
    elif cfg.get("sliding_window_pattern"):
        pattern = int(cfg["sliding_window_pattern"])
        sliding = sum(1 for i in range(layers) if (i + 1) % pattern)
    else:
        sliding = layers if cfg.get("use_sliding_window") else 0
    return (window, sliding) if sliding else (0, 0)


def _shared_width(cfg: Mapping[str, Any], experts: int, intermediate: int) -> int:
    """Width of the always-on MLP beside the experts: Qwen2-MoE's shared expert, DeepSeek's
    shared experts, Gemma 4's (and DiffusionGemma's) dense branch; 0 for a dense model."""
    if not experts:
        return 0
    if cfg.get("shared_expert_intermediate_size"):
        return int(cfg["shared_expert_intermediate_size"])
    if cfg.get("n_shared_experts"):
        return int(cfg["n_shared_experts"]) * int(cfg.get("moe_intermediate_size") or 0)
    model_type = str(cfg.get("model_type") or "")
    if cfg.get("enable_moe_block") or model_type.startswith(("gemma4", "diffusion_gemma")):
        return intermediate
    return 0


#: Published config.json values (the fields `from_hf_config` reads), by shape name.
NAMED_MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    # meta-llama/Meta-Llama-3-70B
    "llama-3-70b": {
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-8B (head_dim 128 is explicit in its config)
    "qwen3-8b": {
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-32B (64 heads x 128 = 8192 != hidden 5120: q/o are not square)
    "qwen3-32b": {
        "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": False,
    },
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "tie_word_embeddings": True,
    },
    # google/diffusiongemma-26B-A4B-it (the checkpoint transformers' DiffusionGemmaConfig
    # names; the repo's tests build tiny configs only). Text tower of Gemma-4-26B-A4B's
    # geometry: every layer runs a dense MLP (2112) beside 128 experts (704 wide, top 8);
    # every 6th layer is full attention (head_dim 512, 2 KV heads), the others slide over
    # 1024 tokens. Values from third-party copies of the config.json, not checked against
    # the HF repo itself; they give 25.2B text parameters, 3.8B active (the published
    # figures). Full layers' `attention_k_eq_v` (V = K, no v_proj) is ignored (v counted).
    "diffusion-gemma": {
        "model_type": "diffusion_gemma",
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "diffusion_gemma_text",
            "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
            "global_head_dim": 512, "num_global_key_value_heads": 2,
            "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
            "vocab_size": 262144, "sliding_window": 1024,
            "layer_types": [
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)
            ],
        },
    },
}  # fmt: skip
MODEL_NAMES: tuple[str, ...] = tuple(sorted(NAMED_MODEL_CONFIGS))


def model_shape(name: str, dtype_bytes: int = 2) -> ModelShape:
    """The named shape (`MODEL_NAMES`); ValueError listing the names for another."""
    if name not in NAMED_MODEL_CONFIGS:
        raise ValueError(f"unknown model shape {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    return ModelShape.from_hf_config(NAMED_MODEL_CONFIGS[name], name=name, dtype_bytes=dtype_bytes)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One device (one rank): `peak_flops` dense FLOP/s at the serving dtype (bf16 tensor
    cores on a GPU, not the 2:4-sparse figure), `mem_bandwidth` bytes/s, `mem_bytes` of
    memory, `link_bandwidth` bytes/s per direction to a peer (NVLink), and
    `collective_latency_s`, the fixed time of one collective or point-to-point transfer."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: float
    link_bandwidth: float
    collective_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        for rate in ("peak_flops", "mem_bandwidth", "link_bandwidth"):
            if getattr(self, rate) <= 0:
                raise ValueError(f"device {self.name!r}: {rate} must be positive")
        if self.mem_bytes < 0 or self.collective_latency_s < 0:
            raise ValueError(f"device {self.name!r}: mem_bytes and latency must be >= 0")


# NVIDIA datasheets, SXM parts, bf16 dense. NVLink per direction: half the bidirectional
# total (A100 600 GB/s, H100/H200 900 GB/s, B200 1.8 TB/s). The 10 us collective latency
# is an assumption (a small NCCL all-reduce inside one NVLink node), not a datasheet value.
NAMED_DEVICES: dict[str, DeviceSpec] = {
    "a100": DeviceSpec("a100", 312e12, 2.039e12, 80e9, 300e9),  # A100 SXM 80GB
    "h100": DeviceSpec("h100", 989e12, 3.35e12, 80e9, 450e9),  # H100 SXM 80GB
    "h200": DeviceSpec("h200", 989e12, 4.8e12, 141e9, 450e9),  # H200 SXM 141GB
    # B200: 192 GB HBM3e, 180 GB usable as shipped in HGX/DGX B200.
    "b200": DeviceSpec("b200", 2.25e15, 8e12, 180e9, 900e9),
}
DEVICE_NAMES: tuple[str, ...] = tuple(sorted([*NAMED_DEVICES, "cpu"]))


def device_spec(name: str) -> DeviceSpec:
    """The named device (`DEVICE_NAMES`; "cpu" is `this_cpu()`); ValueError listing the
    names for another."""
    if name == "cpu":
        return this_cpu()
    if name not in NAMED_DEVICES:
        raise ValueError(f"unknown device {name!r}; valid names: {', '.join(DEVICE_NAMES)}")
    return NAMED_DEVICES[name]


def _rate(work: float, run: Any, seconds: float) -> float:
    """`work` units per second of `run()`, called once to warm up, then repeatedly for
    about `seconds`."""
    run()
    count, start = 0, time.perf_counter()
    while True:
        run()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return work * count / elapsed


@functools.cache
def this_cpu() -> DeviceSpec:
    """This CPU, measured once per process (about 0.3 s) with torch at its current thread
    count: FLOP/s of a float32 512x512x512 matmul, bytes/s of a 64 MB tensor copy (read
    plus write). A coarse measurement (float32, one size, a warm cache for the matmul):
    `tandem simulate calibrate` fits a model to measured steps and is the accurate option.
    Ranks on one host talk through memory, so the link is the memory bandwidth; memory is
    the host's physical memory (0 where the OS does not say)."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    out = torch.empty(512, 512)
    flops = _rate(2 * 512**3, lambda: torch.mm(a, b, out=out), 0.1)
    src = torch.zeros(16 * 2**20)  # 64 MB of float32
    dst = torch.empty_like(src)
    bandwidth = _rate(2 * src.nbytes, lambda: dst.copy_(src), 0.1)
    try:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        memory = 0.0
    return DeviceSpec("cpu", flops, bandwidth, memory, bandwidth, collective_latency_s=20e-6)
