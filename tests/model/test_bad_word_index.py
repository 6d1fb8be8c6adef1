"""The bad-word index blocks exactly what the word-by-word rule blocks (vLLM's: a word's
last token when its other tokens end the output history)."""

from __future__ import annotations

import random

from tandem.core.worker.bad_words import BadWordIndex


def word_by_word(words: list[list[int]], history: list[int]) -> list[int]:
    blocked = []
    for word in words:
        prefix = word[:-1]
        if not prefix or history[len(history) - len(prefix) :] == prefix:
            blocked.append(word[-1])
    return blocked


def test_random_words_and_histories_match_the_word_by_word_rule() -> None:
    rng = random.Random(0)
    for _ in range(500):
        words = [
            [rng.randint(0, 5) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 30))
        ]
        history = [rng.randint(0, 5) for _ in range(rng.randint(0, 8))]
        index = BadWordIndex(words)
        assert sorted(index.blocked(history)) == sorted(word_by_word(words, history))


def test_a_prefix_longer_than_the_history_never_matches() -> None:
    index = BadWordIndex([[1, 2, 3], [7]])
    assert index.blocked([2]) == [7]
    assert sorted(index.blocked([1, 2])) == [3, 7]
    assert index.longest_prefix == 2
