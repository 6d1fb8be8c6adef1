"""The front end's per-request output work (detokenising, stop strings, logprobs) fails
for one request only: that request ends with `finish_reason="error"` naming the failure
and is listed for the engine to abort; the other requests of the step go on."""

from __future__ import annotations

from typing import Any

from tandem.core.outputs import EngineCoreOutput
from tandem.output_processor import OutputProcessor
from tandem.schema.sampling_params import SamplingParams


class Tokenizer:
    """Characters as tokens; decoding token 13 raises (as a broken vocabulary entry)."""

    all_special_ids: list[int] = []

    def decode(self, ids: list[int], **_: Any) -> str:
        if 13 in ids:
            raise ValueError("token 13 has no text")
        return "".join(chr(96 + i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int], **_: Any) -> list[str]:
        if 13 in ids:
            raise ValueError("token 13 has no text")
        return [chr(96 + i) for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


def step(rid: str, tokens: list[int], finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=rid, new_token_ids=tokens, finish_reason=finish)


def test_a_request_whose_detokenising_fails_ends_alone() -> None:
    processor = OutputProcessor(Tokenizer())
    for rid in ("good", "bad"):
        processor.add_request(rid, "p", [1, 2], 0.0, SamplingParams(stop=["zz"]))
    finished = processor.process([step("good", [1, 2]), step("bad", [3, 13])])
    assert finished == ["bad"] and processor.ended_here == {"bad": "error"}
    bad = processor.pop("bad")
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "token 13 has no text" in (bad.error or "")
    processor.process([step("good", [3], "length")])
    good = processor.pop("good")
    assert good.outputs[0].token_ids == [1, 2, 3] and good.outputs[0].finish_reason == "length"
    assert good.outputs[0].text == "abc" and good.error is None
