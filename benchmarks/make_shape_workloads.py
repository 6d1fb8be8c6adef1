"""Write the workload shapes of issue 16 into benchmarks/workloads/, deterministically.

    python benchmarks/make_shape_workloads.py

Writes `summarise.json` (24 requests, 1,024-2,048 prompt tokens, 32 out),
`generate_long.json` (16 requests, 32 prompt tokens, 512 out), `shared_prefix_chat.json`
(16 conversations x 8 turns on one 1,024-token system prompt, 64 out per turn, every turn's
prompt generated in advance) and `burst256.json` (256 requests, 16-256 prompt tokens, 64 out,
submitted at once), and stamps the `"engine"` section of `tandem.bench.BUILTIN_ENGINES` into
`default.json` and `latency.json` (their requests are left as they are).

Every file's `"engine"` section holds the settings a user of either engine would pick for
the workload (vLLM's names): `max_num_seqs`, `max_model_len` (longest prompt + max_tokens,
rounded up to a multiple of 256), `enable_prefix_caching` (only the chat shares prefixes),
`max_num_batched_tokens` and `kv_cache_memory_gib` (whole GiB: tandem's
`kv_cache_memory_gib`, vLLM-CPU's `VLLM_CPU_KVCACHE_SPACE`; sized to hold the
`max_num_seqs` longest requests in fp32 with a 128-token block of slack each).
Token ids are drawn from SmolLM2's ordinary vocabulary: no special ids (< 100) and none of
the last ids (>= 49000).
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "benchmarks" / "workloads"
SEED = 16  # issue 16
TOKEN_RANGE = (100, 48_999)  # inclusive
#: fp32 KV bytes per token of SmolLM2-135M: K and V x 30 layers x 3 KV heads x 64 x 4 bytes.
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
GIB = 1 << 30
SHAPES = ("summarise", "generate_long", "shared_prefix_chat", "burst256")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(*TOKEN_RANGE) for _ in range(n)]


def engine_section(
    requests: list[dict[str, Any]],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    enable_prefix_caching: bool = False,
) -> dict[str, Any]:
    """The peers' settings for these requests (see the module docstring for the rules)."""
    lengths = sorted((len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests), reverse=True)
    max_model_len = 256 * math.ceil(lengths[0] / 256)
    resident = sum(n + 128 for n in lengths[:max_num_seqs])
    return {
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "enable_prefix_caching": enable_prefix_caching,
        "max_num_batched_tokens": max_num_batched_tokens,
        "kv_cache_memory_gib": max(1, math.ceil(resident * KV_BYTES_PER_TOKEN / GIB)),
    }


def _simple(
    rng: random.Random, count: int, lens: tuple[int, int], out: int
) -> list[dict[str, Any]]:
    return [
        {"prompt_token_ids": _tokens(rng, rng.randint(*lens)), "max_tokens": out}
        for _ in range(count)
    ]


def summarise(rng: random.Random) -> dict[str, Any]:
    """Long prompts, short outputs: 24 x (1,024-2,048 in, 32 out)."""
    reqs = _simple(rng, 24, (1024, 2048), 32)
    return {"name": "summarise", "engine": engine_section(reqs, 24, 4096), "requests": reqs}


def generate_long(rng: random.Random) -> dict[str, Any]:
    """Short prompts, long outputs: 16 x (32 in, 512 out)."""
    reqs = _simple(rng, 16, (32, 32), 512)
    return {"name": "generate_long", "engine": engine_section(reqs, 16, 2048), "requests": reqs}


def burst256(rng: random.Random) -> dict[str, Any]:
    """256 requests at once: 16-256 in, 64 out."""
    reqs = _simple(rng, 256, (16, 256), 64)
    return {"name": "burst256", "engine": engine_section(reqs, 256, 4096), "requests": reqs}


def shared_prefix_chat(rng: random.Random) -> dict[str, Any]:
    """16 conversations x 8 turns on one 1,024-token system prompt, 64 out per turn.

    Turn t's prompt is turn t-1's prompt + a fixed 32-token "assistant" reply + a new user
    turn of 16-48 tokens, so every prompt extends its conversation's previous one and all
    share the system prompt. Requests are in turn order (every conversation's turn 0, then
    every turn 1, ...), as turns of concurrent chats would arrive; each carries its
    `conversation` and `turn`.
    """
    system = _tokens(rng, 1024)
    history: list[list[int]] = [[] for _ in range(16)]
    turns: list[list[dict[str, Any]]] = [[] for _ in range(8)]
    for conv in range(16):
        for turn in range(8):
            history[conv] += _tokens(rng, rng.randint(16, 48))
            prompt = system + history[conv]
            turns[turn].append(
                {"prompt_token_ids": prompt, "max_tokens": 64, "conversation": conv, "turn": turn}
            )
            history[conv] += _tokens(rng, 32)  # the pre-generated assistant reply
    reqs = [r for turn in turns for r in turn]
    engine = engine_section(reqs, 16, 2048, enable_prefix_caching=True)
    return {"name": "shared_prefix_chat", "engine": engine, "requests": reqs}


def build_all() -> dict[str, dict[str, Any]]:
    """The four shapes by name; each from its own seeded generator (same output every call)."""
    makers = (summarise, generate_long, shared_prefix_chat, burst256)
    return {m.__name__: m(random.Random(f"{SEED}-{m.__name__}")) for m in makers}


def with_builtin_engine(workload: dict[str, Any], name: str) -> dict[str, Any]:
    """`workload` with `tandem.bench.BUILTIN_ENGINES[name]` as its engine section."""
    from tandem.bench import BUILTIN_ENGINES

    return {"name": workload["name"], "engine": BUILTIN_ENGINES[name]} | {
        k: v for k, v in workload.items() if k not in ("name", "engine")
    }


def main() -> int:
    for name, workload in build_all().items():
        (WORKLOADS / f"{name}.json").write_text(json.dumps(workload))
    for name in ("default", "latency"):
        path = WORKLOADS / f"{name}.json"
        path.write_text(json.dumps(with_builtin_engine(json.loads(path.read_text()), name)))
    print(f"wrote {', '.join(SHAPES)} and the engine sections of default, latency", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
