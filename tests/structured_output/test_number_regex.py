"""Range regexes for numeric bounds on outlines-core: exactly the in-range integers and
plain decimals, checked against exact arithmetic."""

from __future__ import annotations

import itertools
import re
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.structured_output.number_regex import (
    bound_digits,
    decimal_range_regex,
    integer_range_regex,
)

INT_BOUNDS = [None, -1000, -101, -100, -99, -10, -9, -1, 0, 1, 9, 10, 11, 99, 100, 101, 999, 12345]
INTS = [*range(-1300, 1300), 12344, 12345, 12346, 99999, 100000, -99999]


def test_integer_ranges_match_exactly_the_integers_in_bounds() -> None:
    for lo, hi in itertools.product(INT_BOUNDS, INT_BOUNDS):
        if lo is not None and hi is not None and lo > hi:
            continue
        regex = re.compile(integer_range_regex(lo, hi))
        wrong = [
            n
            for n in INTS
            if (regex.fullmatch(str(n)) is not None)
            != ((lo is None or n >= lo) and (hi is None or n <= hi))
        ]
        assert not wrong, (lo, hi, wrong[:5], regex.pattern)
        assert not any(regex.fullmatch(s) for s in ("-0", "007", "+1", "1.0", "", "1e2"))


def test_the_issue_example_is_out_of_range() -> None:
    regex = re.compile(integer_range_regex(0, 99))
    assert regex.fullmatch("3220354922319476233533897") is None
    assert regex.fullmatch("99") and not regex.fullmatch("100")


def test_an_empty_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty integer range"):
        integer_range_regex(5, 4)
    with pytest.raises(ValueError, match="empty number range"):
        decimal_range_regex(Decimal(1), Decimal(1), lo_exclusive=True)


def _decimal_strings() -> list[str]:
    out = set()
    for whole in ["0", "1", "2", "3", "9", "10", "12", "99", "100"]:
        out.add(whole)
        for frac in ["0", "00", "5", "50", "05", "25", "2", "49", "5001", "4999", "1", "9", "001"]:
            out.add(f"{whole}.{frac}")
    return sorted(out | {"-" + s for s in out})


DECIMALS = _decimal_strings()
DEC_BOUNDS = [None, "0", "-0.5", "0.5", "1", "2.5", "-2.5", "0.05", "-1", "10", "12.49", "100"]


def _in_range(s: str, lo: Decimal | None, hi: Decimal | None, lo_x: bool, hi_x: bool) -> bool:
    d = Decimal(s)
    if s.startswith("-") and d == 0:
        return False  # "-0", "-0.0": left out by design
    above = lo is None or (d > lo if lo_x else d >= lo)
    below = hi is None or (d < hi if hi_x else d <= hi)
    return above and below


def test_decimal_ranges_match_exactly_the_plain_decimals_in_bounds() -> None:
    for lo_s, hi_s, lo_x, hi_x in itertools.product(
        DEC_BOUNDS, DEC_BOUNDS, [False, True], [False, True]
    ):
        if (lo_s is None and lo_x) or (hi_s is None and hi_x):
            continue
        lo = None if lo_s is None else Decimal(lo_s)
        hi = None if hi_s is None else Decimal(hi_s)
        try:
            regex = re.compile(decimal_range_regex(lo, hi, lo_x, hi_x))
        except ValueError:
            assert not any(_in_range(s, lo, hi, lo_x, hi_x) for s in DECIMALS), (lo, hi)
            continue
        wrong = [
            s
            for s in DECIMALS
            if (regex.fullmatch(s) is not None) != _in_range(s, lo, hi, lo_x, hi_x)
        ]
        assert not wrong, (lo_s, hi_s, lo_x, hi_x, wrong[:5])


_bound = st.one_of(
    st.none(),
    st.decimals(min_value=-200, max_value=200, places=3, allow_nan=False, allow_infinity=False),
)
_number = st.decimals(
    min_value=-300, max_value=300, places=4, allow_nan=False, allow_infinity=False
)


@settings(max_examples=300, deadline=None)
@given(lo=_bound, hi=_bound, lo_x=st.booleans(), hi_x=st.booleans(), x=_number)
def test_decimal_range_property(
    lo: Decimal | None, hi: Decimal | None, lo_x: bool, hi_x: bool, x: Decimal
) -> None:
    lo_x = lo_x and lo is not None
    hi_x = hi_x and hi is not None
    try:
        regex = decimal_range_regex(lo, hi, lo_x, hi_x)
    except ValueError:
        assert lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_x or hi_x)))
        return
    text = format(x, "f")
    assert (re.fullmatch(regex, text) is not None) == _in_range(text, lo, hi, lo_x, hi_x), (
        text,
        regex,
    )


def test_bound_digits_counts_only_bounds_that_branch() -> None:
    """outlines-core's index build grows steeply with long branching bounds: the schema
    checker refuses those over `MAX_BOUND_DIGITS`; round bounds cost nothing."""
    assert bound_digits(123456789, None) == 9
    assert bound_digits(1234567890, 9876543210) == 10
    assert bound_digits(None, -1234567890) == 10
    assert bound_digits(0, 10**12) == bound_digits(-(10**12), 10**12) == 0
    assert bound_digits(1000, 1999) == bound_digits(100000, 999999) == 0
