"""Grammar deferral under async scheduling, with the fake grammar of `tandem.testing`.

The fake grammar allows, after token p, only tokens t with (t + p) % modulus == 0, so its
mask for a step needs the request's latest token. Under async scheduling the kernel must
therefore defer that step's sampling until the previous step's output is applied
(`pending_structured_output_tokens`); the grammar plugin asserts it is never asked too
early. Outputs must equal the synchronous engine's and a reference computed directly from
the scripted model's logits with the same mask.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.testing import collect_outputs, make_request, make_scripted_engine
from tandem.testing.fake_grammar import fake_grammar_allows
from tandem.testing.scripted_model import scripted_logits, scripted_next_token

VOCAB = 128
EOS = 1
PLUGINS = [
    {"name": "reference-scheduler"},
    {"name": "default-sampler"},
    {"name": "fake-grammar"},
]
PROMPTS = [[3, 4, 5, 6, 7], [9] * 13, [2, 7, 1, 8, 2, 8], list(range(10, 40)), [5, 5]]
MODULI = [3, None, 5, 2, 7]  # None: unconstrained request in the same batch


def reference(prompt: list[int], modulus: int | None, max_tokens: int) -> list[int]:
    """Greedy over the scripted logits with the fake grammar's mask, one token at a time."""
    history = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = scripted_logits(torch.tensor([scripted_next_token(history, VOCAB)]), VOCAB)[0]
        if modulus is not None:
            allowed = torch.zeros(VOCAB, dtype=torch.bool)
            allowed[fake_grammar_allows(history[-1], modulus, VOCAB)] = True
            logits = logits.masked_fill(~allowed, float("-inf"))
        token = int(logits.argmax())
        history.append(token)
        out.append(token)
    return out


def run(async_scheduling: bool, **overrides: Any) -> tuple[dict[str, list[int]], list[bool]]:
    settings: dict[str, Any] = {
        "max_num_batched_tokens": 16,
        "num_kv_blocks": 64,
        "max_model_len": 96,
        **overrides,
    }
    engine = make_scripted_engine(
        async_scheduling=async_scheduling, plugins=PLUGINS, vocab_size=VOCAB, **settings
    )
    for i, (prompt, modulus) in enumerate(zip(PROMPTS, MODULI, strict=True)):
        grammar = {"custom": {"modulus": modulus}} if modulus is not None else None
        engine.add_request(
            make_request(
                str(i), prompt, EOS, max_tokens=10, ignore_eos=True, structured_outputs=grammar
            )
        )
    outputs = collect_outputs(engine)
    grammar = engine.plugin_manager.get_plugin("fake-grammar")
    return {rid: tokens for rid, (tokens, _) in outputs.items()}, grammar.steps


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_constrained_outputs_match_the_reference(async_scheduling: bool) -> None:
    outputs, steps = run(async_scheduling)
    for i, (prompt, modulus) in enumerate(zip(PROMPTS, MODULI, strict=True)):
        assert outputs[str(i)] == reference(prompt, modulus, 10), i
    # The grammar really constrained something: masked greedy differs from plain greedy.
    assert outputs["0"] != reference(PROMPTS[0], None, 10)
    if async_scheduling:
        assert any(steps), "no step was deferred: the two-phase path did not run"
    else:
        assert not any(steps)


def test_async_equals_sync_with_chunked_prefill_and_preemption() -> None:
    overrides = {
        "num_kv_blocks": 14,
        "block_size": 4,
        "max_num_batched_tokens": 8,
        "max_model_len": 48,
    }
    sync_out, _ = run(False, **overrides)
    async_out, steps = run(True, **overrides)
    assert async_out == sync_out
    assert any(steps)
