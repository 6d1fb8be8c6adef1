"""The compiled decode forward (`models/decode_program.py`): bit-identical to the Python
decoder loop it replaces, used only for the steps and layers it can run, and on the
embedded SmolLM2 (quantized, the default) the same tokens and logprobs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM
from tandem.models import paged_attention
from tandem.models.decode_program import DecodeProgram
from tandem.models.panel_linear import panel_gemm_kernel
from tandem.testing.engine import make_request

pytestmark = pytest.mark.skipif(panel_gemm_kernel() is None, reason="no C++ compiler")

#: Prompts of different lengths arriving one step apart: decode batches of 1-3 rows, and
#: steps where a prefill runs beside decodes (the Python loop's).
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(30, 75)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 11]]


class _Spy:
    """Counts the steps the program ran and the steps it handed back to the Python loop."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ran = self.declined = 0
        original = DecodeProgram.run

        def run(program: DecodeProgram, *args: Any) -> torch.Tensor | None:
            out = original(program, *args)
            if out is None:
                self.declined += 1
            else:
                self.ran += 1
            return out

        monkeypatch.setattr(DecodeProgram, "run", run)


def _generate(model: str | Path, **options: Any) -> tuple[dict[str, Any], bool]:
    """Each request's (tokens, logprobs), and whether the decoder has a program."""
    llm = LLM(model=str(model), max_model_len=128, num_kv_blocks=96, block_size=4, **options)
    engine = llm.engine
    try:
        has_program = engine.executor.worker.model.fused.decode_program is not None
        results: dict[str, tuple[list[int], list[Any]]] = {}
        finished: set[str] = set()

        def take(outputs: list[Any]) -> None:
            for out in outputs:
                tokens, logprobs = results.setdefault(out.request_id, ([], []))
                tokens.extend(out.new_token_ids)
                logprobs.extend(out.new_logprobs or [])
                if out.finished:
                    finished.add(out.request_id)

        for i, prompt in enumerate(PROMPTS):  # staggered: one new request a step
            engine.add_request(
                make_request(f"r{i}", prompt, max_tokens=14, ignore_eos=True, logprobs=4)
            )
            take(engine.step()[0])
        for _ in range(200):
            if len(finished) == len(PROMPTS):
                break
            take(engine.step()[0])
        assert finished == {f"r{i}" for i in range(len(PROMPTS))}
        assert all(len(tokens) == 14 for tokens, _ in results.values())
        return results, has_program
    finally:
        engine.shutdown()


@pytest.fixture
def python_loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TANDEM_DECODE_PROGRAM", "0")
    yield
    monkeypatch.delenv("TANDEM_DECODE_PROGRAM")


@pytest.mark.parametrize(
    ("arch", "mode"), [("llama", "int8"), ("qwen2", "int4"), ("llama", "int4")]
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prefill_as_decodes", [True, False])
def test_program_is_bit_identical_to_the_python_loop(
    tiny_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    mode: str,
    threads: int,
    prefill_as_decodes: bool,
) -> None:
    """With prefill chunks attended as kernel decodes (short contexts, the default) every
    step is one the program runs; without, steps with a prefill decline it."""
    if not prefill_as_decodes:
        monkeypatch.setattr(paged_attention, "MAX_CONTEXT_AS_KERNEL_DECODES", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        spy = _Spy(monkeypatch)
        compiled = _generate(tiny_models[arch], quantization=mode)
        assert compiled[1], "the program was not built for kernel-only layers"
        assert spy.ran > 0
        assert (spy.declined == 0) if prefill_as_decodes else (spy.declined > 0)
        monkeypatch.setenv("TANDEM_DECODE_PROGRAM", "0")
        looped = _generate(tiny_models[arch], quantization=mode)
    finally:
        torch.set_num_threads(before)
    assert not looped[1]
    assert compiled[0] == looped[0]  # token ids and logprobs, exactly


def test_program_is_not_built_for_per_head_norms(tiny_models: dict[str, Path]) -> None:
    """Qwen3's q/k norms are not in the compiled step: its decoder keeps the Python loop."""
    result = _generate(tiny_models["qwen3"], quantization="int8")
    assert not result[1]


def test_switch_turns_the_program_off(
    tiny_models: dict[str, Path], python_loop: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _Spy(monkeypatch)
    result = _generate(tiny_models["llama"], quantization="int8")
    assert not result[1] and spy.ran == 0


def test_bfloat16_pools_fall_back_to_the_python_loop(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The program reads float32 pools only; with a bfloat16 model (bfloat16 KV) every step declines, and the
    tokens are still the Python loop's."""
    spy = _Spy(monkeypatch)
    compiled = _generate(tiny_models["llama"], quantization="int8", dtype="bfloat16")
    assert spy.ran == 0 and spy.declined > 0
    monkeypatch.setenv("TANDEM_DECODE_PROGRAM", "0")
    looped = _generate(tiny_models["llama"], quantization="int8", dtype="bfloat16")
    assert compiled[0] == looped[0]
