"""Shared helpers for the tandem-lrw tests (plain functions, no fixtures)."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from tandem.core.engine_core import EngineCore
from tandem.core.request import Request
from tandem.testing import collect_outputs, expected_scripted_output, make_request

from tandem_lrw import LRWVictim

VOCAB = 128
EOS = 1
STACK = Path(__file__).resolve().parent.parent / "stack.yaml"


def lrw_stack(max_preemptions: int = 2) -> list[Any]:
    """The plugin named by its entry-point name only, stacked with the reference scheduler."""
    return [
        "reference-scheduler",
        {"name": "lrw-victim", "options": {"max_preemptions": max_preemptions}},
        "default-sampler",
    ]


def prompt(request_id: str, length: int) -> list[int]:
    """A deterministic prompt of `length` token ids in [2, VOCAB) (no EOS)."""
    seed = zlib.crc32(request_id.encode())
    return [2 + (seed + 37 * i + i * i) % (VOCAB - 2) for i in range(length)]


def req(request_id: str, prompt_len: int, max_tokens: int, **params: Any) -> Request:
    """A greedy request that runs exactly `max_tokens` steps of output (EOS ignored)."""
    params.setdefault("ignore_eos", True)
    return make_request(request_id, prompt(request_id, prompt_len), max_tokens=max_tokens, **params)


def expected(request: Request, max_model_len: int) -> tuple[list[int], str]:
    return expected_scripted_output(
        request.prompt_token_ids, request.sampling_params, VOCAB, EOS, max_model_len
    )


def victim_plugin(engine: EngineCore) -> LRWVictim:
    plugin = engine.plugin_manager.get_plugin("lrw-victim")
    assert isinstance(plugin, LRWVictim)
    return plugin


def run_exact(engine: EngineCore, requests: list[Request]) -> dict[str, int]:
    """Run `requests` to the end, check every output against the scripted reference, and
    return how many times each request was preempted."""
    for request in requests:
        engine.add_request(request)
    outputs = collect_outputs(engine)
    for request in requests:
        assert outputs[request.request_id] == expected(request, engine.config.max_model_len)
    return {r.request_id: r.num_preemptions for r in requests}
