"""The DiffusionGemma engine tests' shared workload: three prompts with their seeds, and
a run of them through an `EngineCore` (its tokens per request, every KV block freed after)."""

from __future__ import annotations

from tandem.core.engine_core import EngineCore
from tandem.testing.engine import collect_outputs, make_request

PROMPTS = [[5, 9, 11, 7, 3, 8, 21, 4, 6], [7, 3], [4, 17, 5, 6, 30]]
SEEDS = [11, 1234, 7]


def run(core: EngineCore, max_tokens: int) -> dict[str, list[int]]:
    """Every prompt as request `r{i}` (no EOS, seeded), run until idle."""
    for i, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS, strict=True)):
        request = make_request(f"r{i}", prompt, eos_token_id=None, max_tokens=max_tokens, seed=seed)
        core.add_request(request)
    out = {rid: tokens for rid, (tokens, _) in collect_outputs(core, max_steps=500).items()}
    assert core.scheduler_state.kv_cache_manager.all_blocks_free()
    return out
