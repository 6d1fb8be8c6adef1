"""Incremental detokenisation and stop strings on the real SmolLM2 tokenizer.

`IncrementalDetokenizer` is driven directly (one token at a time and in chunks), then stop
strings run end to end through `LLM.chat` on the embedded SmolLM2.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tandem.detokenizer import IncrementalDetokenizer
from tandem.schema.sampling_params import SamplingParams

ASCII = "The quick brown fox jumps over the lazy dog."
MULTIBYTE = "日本語のテキスト 🎉 café ñandú"
MIXED = "Hello🎉world, naïve 東京 — ok!"
TEXTS = [ASCII, MULTIBYTE, MIXED]


def make(tokenizer: Any, stop: list[str] | None = None, **kw: Any) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(
        tokenizer,
        stop=stop or [],
        include_stop_str_in_output=kw.get("include", False),
        min_tokens=kw.get("min_tokens", 0),
        skip_special_tokens=kw.get("skip_special", True),
    )


def feed(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> str | None:
    for start in range(0, len(ids), chunk):
        stop = det.append(ids[start : start + chunk])
        if stop is not None:
            return stop
    return None


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def clean_prefix_len(tokenizer: Any, ids: list[int], n: int) -> int | None:
    """Characters of decode(ids[:n]) when it does not end inside a character."""
    text = tokenizer.decode(ids[:n])
    return None if text.endswith("\ufffd") else len(text)


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
@pytest.mark.parametrize("text", TEXTS)
def test_text_equals_decode_of_tokens(smollm2_tokenizer, text: str, chunk: int) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, text)
    assert tok.decode(ids) == text
    det = make(tok)
    for start in range(0, len(ids), chunk):
        assert det.append(ids[start : start + chunk]) is None
        # Never a half character, never text that the final decode does not start with.
        assert "\ufffd" not in det.text
        assert text.startswith(det.text)
    assert det.text == text
    assert det.token_ids == ids


def test_multibyte_characters_split_across_tokens(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, MULTIBYTE)
    # The test is meaningful: some tokens are fragments of one UTF-8 character.
    fragments = [i for i in ids if tok.decode([i]) == "\ufffd"]
    assert len(fragments) >= 3
    det = make(tok)
    texts = []
    for token in ids:
        det.append([token])
        texts.append(det.text)
    assert det.text == MULTIBYTE
    # The emoji (4 bytes) arrives whole: no intermediate text ends with a partial char.
    assert any("🎉" in t for t in texts)
    assert all("\ufffd" not in t for t in texts)
    # Text only grows, and a fragment token adds nothing until its character is complete.
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert any(a == b for a, b in zip(texts, texts[1:], strict=False))


def test_stop_string_spanning_two_tokens(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, ASCII)
    assert [tok.decode([i]) for i in ids[2:4]] == [" brown", " fox"]
    # "wn f" ends ' brown' and starts ' fox'.
    det = make(tok, ["wn f"])
    assert feed(det, ids) == "wn f"
    assert det.text == "The quick bro"
    assert len(det.token_ids) == 4  # caught on ' fox', nothing after it
    det = make(tok, ["wn f"], include=True)
    assert feed(det, ids) == "wn f"
    assert det.text == "The quick brown f"


def test_stop_strings_every_boundary_and_substring(smollm2_tokenizer) -> None:
    """For many substrings s of each text: the detokenizer stops on the first token whose
    clean decode contains s, its text is everything before the first occurrence of s (plus
    s with include_stop_str_in_output), in any chunking."""
    tok = smollm2_tokenizer
    rng = random.Random(7)
    checked = 0
    for text in TEXTS:
        ids = encode(tok, text)
        for _ in range(40):
            length = rng.randint(1, 6)
            a = rng.randrange(0, len(text) - length + 1)
            stop = text[a : a + length]
            first = text.find(stop)
            need = next(
                n
                for n in range(1, len(ids) + 1)
                if (clean := clean_prefix_len(tok, ids, n)) is not None
                and clean >= first + len(stop)
            )
            for include in (False, True):
                for chunk in (1, 2):
                    det = make(tok, [stop], include=include)
                    assert feed(det, ids, chunk) == stop, (text, stop)
                    expected = text[: first + len(stop)] if include else text[:first]
                    assert det.text == expected, (text, stop, include, chunk)
                    if chunk == 1:
                        assert len(det.token_ids) == need, (text, stop)
                    checked += 1
    assert checked == len(TEXTS) * 40 * 4


def test_stop_string_with_multibyte_characters(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, MIXED)
    det = make(tok, ["🎉w"])
    assert feed(det, ids) == "🎉w"
    assert det.text == "Hello"
    det = make(tok, ["東"], include=True)
    assert feed(det, ids) == "東"
    assert det.text == "Hello🎉world, naïve 東"


def test_earliest_of_several_stop_strings_wins(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, ASCII)
    det = make(tok, ["lazy", "ump", "jumps"])
    assert feed(det, ids, chunk=100) == "jumps"
    assert det.text == "The quick brown fox "
    det = make(tok, ["lazy", "ump", "jumps"], include=True)
    assert feed(det, ids) == "jumps"
    assert det.text == "The quick brown fox jumps"


def test_stop_strings_wait_for_min_tokens(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, ASCII)  # The | quick | brown | fox | ...
    det = make(tok, ["fox"], min_tokens=3)
    assert feed(det, ids) == "fox"  # 4th token: past min_tokens
    assert det.text == "The quick brown "
    det = make(tok, ["fox"], min_tokens=4)
    assert feed(det, ids) is None  # completed within the first min_tokens tokens
    assert det.text == ASCII


def test_special_tokens_and_stop(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, "Hi there") + [tok.eos_token_id] + encode(tok, " after")
    det = make(tok)
    feed(det, ids)
    assert det.text == "Hi there after"
    det = make(tok, [tok.eos_token], skip_special=False)
    assert feed(det, ids) == tok.eos_token
    assert det.text == "Hi there"


# End to end on SmolLM2 -------------------------------------------------------------------
POEM = [{"role": "user", "content": "Write a long poem about the sea."}]


@pytest.fixture(scope="module")
def poem_greedy(smollm2_llm) -> tuple[list[int], str]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = smollm2_llm.chat(POEM, params)[0].outputs[0]
    assert out.finish_reason == "length"
    return list(out.token_ids), out.text


def _stop_across_boundary(tok: Any, tokens: list[int], text: str) -> tuple[str, int, int]:
    """(stop string, token index i, char offset b): the stop is text[b-2:b+2] where b is the
    boundary between tokens i-1 and i; it occurs nowhere earlier in the text."""
    for i in range(6, len(tokens) - 2):
        left, right = tok.decode([tokens[i - 1]]), tok.decode([tokens[i]])
        b = len(tok.decode(tokens[:i], skip_special_tokens=True))
        stop = text[b - 2 : b + 2]
        if (
            len(left.strip()) >= 2
            and len(right) >= 2
            and "\ufffd" not in left + right
            and text[:b] == tok.decode(tokens[:i], skip_special_tokens=True)
            and text.find(stop) == b - 2
        ):
            return stop, i, b
    raise AssertionError(f"no usable token boundary in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_end_to_end(smollm2_llm, poem_greedy, include: bool) -> None:
    tokens, text = poem_greedy
    stop, i, b = _stop_across_boundary(smollm2_llm.tokenizer, tokens, text)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=include,
    )
    out = smollm2_llm.chat(POEM, params)[0]
    completion = out.outputs[0]
    assert out.finished
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop
    assert completion.text == (text[: b + 2] if include else text[: b - 2])
    assert list(completion.token_ids) == tokens[: i + 1]
    assert not smollm2_llm.engine.has_work()


def test_stop_string_never_produced(smollm2_llm, poem_greedy) -> None:
    tokens, text = poem_greedy
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["\u2603zz"])
    completion = smollm2_llm.chat(POEM, params)[0].outputs[0]
    assert completion.finish_reason == "length"
    assert completion.stop_reason is None
    assert completion.text == text
    assert list(completion.token_ids) == tokens


def test_stop_string_in_a_batch_only_stops_its_request(smollm2_llm, poem_greedy) -> None:
    tokens, text = poem_greedy
    stop, i, b = _stop_across_boundary(smollm2_llm.tokenizer, tokens, text)
    chats = [POEM, POEM, [{"role": "user", "content": "Count from one to ten."}]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop]),
    ]
    outs = smollm2_llm.chat(chats, params)
    assert outs[0].outputs[0].text == text[: b - 2]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text == text
    assert list(outs[1].outputs[0].token_ids) == tokens
    assert outs[1].outputs[0].finish_reason == "length"
    assert len(outs[2].outputs[0].token_ids) == 8
