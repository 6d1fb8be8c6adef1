"""JSON-schema patterns as the backends get them: anchors dropped, lengths folded in, and
(outlines-core) made safe for the raw JSON text of a string."""

from __future__ import annotations

import re

import pytest

from tandem.structured_output.pattern import PatternError, parse_pattern


def prepared(pattern: str, min_length: int = 0, max_length: int | None = None) -> str:
    p = parse_pattern(pattern).strip_anchors()
    if min_length or max_length is not None:
        folded = p.fold_lengths(min_length, max_length)
        assert folded is not None
        p = folded
    return p.source()


def test_anchors_at_the_ends_of_alternatives_are_dropped_and_the_whole_is_grouped() -> None:
    assert prepared("^[a-z]+$") == "(?:[a-z]+)"
    assert prepared("^a|b$") == "(?:a|b)"  # outlines pastes it between quotes: keep one group
    assert prepared("^(ab|cd)$") == "(?:(?:ab|cd))"
    with pytest.raises(PatternError, match="anchors"):
        parse_pattern("a^b").strip_anchors()


def test_lengths_fold_into_the_variable_repeat() -> None:
    assert prepared("^[a-z]+$", max_length=6) == "(?:[a-z]{1,6})"  # the case
    assert prepared("^@[a-z0-9_]+$", 4, 9) == "(?:@[a-z0-9_]{3,8})"
    assert prepared("^[A-Z][a-z]*$", 0, 10) == "(?:[A-Z][a-z]{0,9})"
    # Lengths the pattern already implies: unchanged; alternatives outside them: dropped.
    assert prepared("^[0-9]{5}$", 1, 10) == "(?:[0-9]{5})"
    assert prepared("^(?:[0-9]{3}|[a-z]+)$", 4, 6) == "(?:[a-z]{4,6})"
    for text in ("abcdef", "a"):
        assert re.fullmatch(prepared("^[a-z]+$", max_length=6), text)
    assert not re.fullmatch(prepared("^[a-z]+$", max_length=6), "tonkfronn")


def test_unfoldable_and_unsatisfiable_lengths() -> None:
    assert parse_pattern("^(ab)+$").strip_anchors().fold_lengths(0, 5) is None
    assert parse_pattern("^a+b+$").strip_anchors().fold_lengths(0, 5) is None
    with pytest.raises(PatternError, match="no string of the pattern"):
        parse_pattern("^[0-9]{5}$").strip_anchors().fold_lengths(0, 3)


@pytest.mark.parametrize(
    ("pattern", "feature"),
    [
        ("(?=a)b", "lookaround"),
        (r"(a)\1", "backreferences"),
        (r"\bword", "word boundaries"),
        ("(?i)abc", "inline flags"),
        ("a++", "possessive"),
        ("[a-", "invalid regex"),
        ("[[a]]", "nested classes"),
    ],
)
def test_features_the_backends_cannot_compile_are_refused(pattern: str, feature: str) -> None:
    with pytest.raises(PatternError, match=feature):
        parse_pattern(pattern)


def test_json_safe_form_never_matches_a_raw_quote_backslash_or_control_character() -> None:
    """outlines-core matches a pattern against the raw JSON text: `.` would let the model
    close the string early (`"a"b"`) or write an escape that decodes to fewer characters."""
    safe = parse_pattern("^.{3}$").strip_anchors().source(json_safe=True)
    assert safe == '(?:[^"\\\\\\x00-\\x1f]{3})'
    assert re.fullmatch(safe, "abc") and not re.fullmatch(safe, 'a"b')
    assert not re.fullmatch(safe, "a\\b") and not re.fullmatch(safe, "a\nb")
    negated = parse_pattern("[^a]").source(json_safe=True)
    assert not re.fullmatch(negated, '"') and re.fullmatch(negated, "b")
    # A literal quote or backslash becomes its JSON escape (matching the raw text `\"`).
    assert parse_pattern('a"b').source(json_safe=True) == '(?:a\\\\"b)'
    assert re.fullmatch(parse_pattern(r"a\\b").source(json_safe=True), "a\\\\b")
    assert re.fullmatch(parse_pattern(r"a\nb").source(json_safe=True), "a\\nb")
    # Positive classes lose the unsafe characters through class subtraction (Rust syntax).
    assert parse_pattern("[ -~]").source(json_safe=True) == '(?:[ -~--["\\\\\\x00-\\x1f]])'
