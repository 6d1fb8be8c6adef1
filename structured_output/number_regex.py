"""Regular expressions for JSON numbers in a range: how numeric bounds reach outlines-core.

outlines-core turns a JSON schema into one regex and ignores `minimum`/`maximum` (and the
exclusive forms); the schema checker replaces a bounded number by a regex from here.

- `integer_range_regex(lo, hi)`: JSON integers (no leading zeros, no `-0`) n with
  lo <= n <= hi; either bound may be None (unbounded).
- `decimal_range_regex(lo, hi, lo_exclusive, hi_exclusive)`: JSON numbers in plain
  decimal notation (`-?I(.F)?`, no exponent) whose exact decimal value lies in the range.
  Every such string is a valid JSON number; numbers written with an exponent are left
  out (a subset of the schema's language, never a superset).

Both are built digit by digit (no enumeration): the size is linear in the number of digits
of the bounds. The result uses only `[0-9]`-style classes, `(?:...)`, `|`, `*` and
`{m,n}`, which both Python's `re` and outlines-core's (Rust) regex dialect read alike.
"""

from __future__ import annotations

from decimal import Decimal

_ANY_DIGITS = "[0-9]*"


def _digit_class(lo: int, hi: int) -> str:
    """The digits lo..hi as a regex atom ('' when the range is empty)."""
    if lo > hi:
        return ""
    if lo == hi:
        return str(lo)
    return f"[{lo}-{hi}]"


def _alt(parts: list[str]) -> str:
    """Alternation of `parts` as one atom ('' for an empty list: no string matches)."""
    parts = [p for p in dict.fromkeys(parts)]
    if not parts:
        return ""
    if len(parts) == 1:
        return parts[0]
    return "(?:" + "|".join(parts) + ")"


def _fixed(n: int) -> str:
    """Any n digits."""
    if n == 0:
        return ""
    return "[0-9]" if n == 1 else f"[0-9]{{{n}}}"


def _suffix_ge(s: str) -> str:
    """Digit strings of len(s) that are >= s, factored by prefix (`1(?:2|[3-9])`, never
    `12|1[3-9]`): the automaton stays as small as the digits (outlines-core's index build
    grows fast with a regex whose alternatives repeat a prefix)."""
    if not s or s.strip("0") == "":
        return _fixed(len(s))
    head = int(s[0])
    parts = [s[0] + _suffix_ge(s[1:])]
    if head < 9:
        parts.append(_digit_class(head + 1, 9) + _fixed(len(s) - 1))
    return _alt(parts)


def _suffix_le(s: str) -> str:
    """Digit strings of len(s) that are <= s, factored by prefix."""
    if not s or s.strip("9") == "":
        return _fixed(len(s))
    head = int(s[0])
    parts = []
    if head > 0:
        parts.append(_digit_class(0, head - 1) + _fixed(len(s) - 1))
    parts.append(s[0] + _suffix_le(s[1:]))
    return _alt(parts)


def _same_length(lo: str, hi: str) -> str:
    """Digit strings d with len(d) == len(lo) == len(hi) and lo <= d <= hi."""
    prefix = 0
    while prefix < len(lo) and lo[prefix] == hi[prefix]:
        prefix += 1
    if prefix == len(lo):
        return lo
    common, x, y = lo[:prefix], int(lo[prefix]), int(hi[prefix])
    lo_rest, hi_rest = lo[prefix + 1 :], hi[prefix + 1 :]
    rest = len(lo) - prefix - 1
    # A bound whose remaining digits are all 0 (lo) or all 9 (hi) joins the middle class.
    first = x if lo_rest.strip("0") == "" else x + 1
    last = y if hi_rest.strip("9") == "" else y - 1
    parts = []
    if first > x:
        parts.append(lo[prefix] + _suffix_ge(lo_rest))
    if first <= last:
        parts.append(_digit_class(first, last) + _fixed(rest))
    if last < y:
        parts.append(hi[prefix] + _suffix_le(hi_rest))
    return common + _alt(parts)


def _natural_range(lo: int, hi: int | None) -> list[str]:
    """Alternatives matching the decimal forms of lo <= n <= hi (n >= 0, no leading
    zeros); hi None: unbounded."""
    assert lo >= 0
    parts: list[str] = []
    top = hi if hi is not None else 10 ** len(str(lo)) - 1
    for digits in range(len(str(lo)), len(str(top)) + 1):
        first = 0 if digits == 1 else 10 ** (digits - 1)
        a, b = max(lo, first), min(top, 10**digits - 1)
        if a <= b:
            parts.append(_same_length(str(a), str(b)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{len(str(lo))},}}")
    return parts


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """A regex of the JSON integers n with lo <= n <= hi (None: unbounded).

    Raises ValueError when the range is empty."""
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"empty integer range [{lo}, {hi}]")
    parts: list[str] = []
    # n < 0, written "-m" with m = -n >= 1: m in [max(1, -hi), -lo].
    if lo is None or lo < 0:
        m_lo = 1 if hi is None or hi >= 0 else -hi
        m_hi = None if lo is None else -lo
        parts.append("-" + _alt(_natural_range(m_lo, m_hi)))
    # n >= 0.
    if hi is None or hi >= 0:
        parts.extend(_natural_range(max(lo or 0, 0), hi))
    return _alt(parts)


# Decimals -------------------------------------------------------------------------------


def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal as (integer part, fraction digits without trailing zeros)."""
    text = format(value, "f")
    whole, _, frac = text.partition(".")
    return int(whole), frac.rstrip("0")


def _digits_ge(frac: str, strict: bool) -> list[str]:
    """Non-empty digit strings D with 0.D >= 0.frac (> when strict); frac is non-empty
    with no trailing zero."""
    head, rest = int(frac[0]), frac[1:]
    parts = []
    if head < 9:
        parts.append(_digit_class(head + 1, 9) + _ANY_DIGITS)
    parts.extend(frac[0] + t for t in _tail_ge(rest, strict))
    return parts


def _tail_ge(rest: str, strict: bool) -> list[str]:
    """Digit strings T (possibly empty) with 0.T >= 0.rest (> when strict)."""
    if not rest:
        return ["[0-9]*[1-9][0-9]*"] if strict else [_ANY_DIGITS]
    return _digits_ge(rest, strict)


def _digits_le(frac: str, strict: bool) -> list[str]:
    """Non-empty digit strings D with 0.D <= 0.frac (< when strict); frac is non-empty
    with no trailing zero."""
    head, rest = int(frac[0]), frac[1:]
    parts = []
    if head > 0:
        parts.append(_digit_class(0, head - 1) + _ANY_DIGITS)
    parts.extend(frac[0] + t for t in _tail_le(rest, strict))
    return parts


def _tail_le(rest: str, strict: bool) -> list[str]:
    """Digit strings T (possibly empty) with 0.T <= 0.rest (< when strict)."""
    if not rest:
        return [] if strict else ["0*"]
    return ["", *_digits_le(rest, strict)]


def _digits_between(lo: str, lo_strict: bool, hi: str, hi_strict: bool) -> list[str]:
    """Digit strings T (possibly empty) with 0.lo <= 0.T <= 0.hi (strict where asked);
    lo < hi as decimals, neither with a trailing zero, hi non-empty."""
    a, b = int(lo[0]) if lo else 0, int(hi[0])
    lo_rest, hi_rest = lo[1:], hi[1:]
    parts: list[str] = []
    if not lo and not lo_strict:
        parts.append("")  # T empty: 0.T == 0 == 0.lo
    if a == b:
        # lo's rest < hi's rest (hi_rest non-empty, else lo >= hi).
        inner = _digits_between(lo_rest, lo_strict, hi_rest, hi_strict)
        parts.extend(str(a) + t for t in inner)
        return parts
    if lo:
        parts.extend(lo[0] + t for t in _tail_ge(lo_rest, lo_strict))
    else:  # lo == 0: T starts with 0
        parts.extend("0" + t for t in _tail_ge("", lo_strict))
    if a + 1 <= b - 1:
        parts.append(_digit_class(a + 1, b - 1) + _ANY_DIGITS)
    parts.extend(hi[0] + t for t in _tail_le(hi_rest, hi_strict))
    return parts


def _fraction(parts: list[str]) -> str:
    """The fraction-part atom for digit strings `parts` ('' in parts: no fraction)."""
    written = [p for p in parts if p]
    options = []
    if written:
        options.append("\\." + _alt(written))
    alt = _alt(options) if options else ""
    if "" in parts:
        return f"(?:{alt})?" if alt else ""
    return alt


def _nonneg_decimal(lo: Decimal, lo_strict: bool, hi: Decimal | None, hi_strict: bool) -> list[str]:
    """Plain decimals x >= 0 with lo <= x <= hi (strict where asked; hi None: unbounded)."""
    a_int, a_frac = _split(lo)
    parts: list[str] = []
    if hi is not None and lo == hi:  # one value
        if lo_strict or hi_strict:
            return []
        return [str(a_int) + (f"\\.{a_frac}0*" if a_frac else "(?:\\.0+)?")]
    any_frac = "(?:\\.[0-9]+)?"
    if hi is None:
        parts.extend(p + any_frac for p in _natural_range(a_int + 1, None))
        parts.append(str(a_int) + _fraction(_whole_ge(a_frac, lo_strict)))
        return parts
    b_int, b_frac = _split(hi)
    if a_int == b_int:
        between = _digits_between(a_frac, lo_strict, b_frac, hi_strict)
        if between:
            parts.append(str(a_int) + _fraction(between))
        return parts
    parts.append(str(a_int) + _fraction(_whole_ge(a_frac, lo_strict)))
    if a_int + 1 <= b_int - 1:
        parts.extend(p + any_frac for p in _natural_range(a_int + 1, b_int - 1))
    upper = _whole_le(b_frac, hi_strict)
    if upper is not None:
        parts.append(str(b_int) + _fraction(upper))
    return parts


def _whole_ge(frac: str, strict: bool) -> list[str]:
    """Fraction digit strings (empty: no fraction) with 0.T >= 0.frac (> when strict)."""
    if not frac:
        return ["[0-9]*[1-9][0-9]*"] if strict else ["", "[0-9]+"]
    return _digits_ge(frac, strict)


def _whole_le(frac: str, strict: bool) -> list[str] | None:
    """Fraction digit strings (empty: no fraction) with 0.T <= 0.frac (< when strict);
    None when there are none."""
    if not frac:
        return None if strict else ["", "0+"]
    return ["", *_digits_le(frac, strict)]


def decimal_range_regex(
    lo: Decimal | None,
    hi: Decimal | None,
    lo_exclusive: bool = False,
    hi_exclusive: bool = False,
) -> str:
    """A regex of the plain-decimal JSON numbers x with lo <= x <= hi (< where exclusive;
    None: unbounded). No exponent, no `-0`.

    Raises ValueError when the range has no such number."""
    if (
        lo is not None
        and hi is not None
        and (lo > hi or (lo == hi and (lo_exclusive or hi_exclusive)))
    ):
        raise ValueError(f"empty number range ({lo}, {hi})")
    parts: list[str] = []
    # x < 0, written "-y": y in (max(0, -hi), -lo], y > 0.
    if lo is None or lo < 0:
        if hi is None or hi >= 0:
            y_lo, y_lo_strict = Decimal(0), True
        else:
            y_lo, y_lo_strict = -hi, hi_exclusive
        y_hi, y_hi_strict = (None, False) if lo is None else (-lo, lo_exclusive)
        negative = _nonneg_decimal(y_lo, y_lo_strict, y_hi, y_hi_strict)
        if negative:
            parts.append("-" + _alt(negative))
    # x >= 0.
    if hi is None or hi >= 0:
        if lo is None or lo < 0:
            x_lo, x_lo_strict = Decimal(0), False
        else:
            x_lo, x_lo_strict = lo, lo_exclusive
        parts.extend(_nonneg_decimal(x_lo, x_lo_strict, hi, hi_exclusive))
    if not parts:
        raise ValueError(f"empty number range ({lo}, {hi})")
    return _alt(parts)


#: Longest bound (in digits) whose range regex outlines-core indexes quickly. Measured on
#: the SmolLM2 vocabulary: [12345678, inf) 0.3 s, [123456789, inf) 0.7 s,
#: [123456789, 987654321] 1.0 s, [1234567890, inf) 2 s, a 12-digit bound 25 s. Round
#: bounds (1000, 999, 10**12) make no branches and cost nothing at any length.
MAX_BOUND_DIGITS = 9


def bound_digits(lo: int | None, hi: int | None) -> int:
    """The digits of the longest bound that makes `integer_range_regex` branch (a literal
    digit beside a digit class): a lower bound at a digit below 9 followed by a non-zero
    tail, an upper bound at a digit above 0 followed by a tail not all nines (1000, 1999
    and 10**12 do not branch); 0 when none does."""

    def branches(n: int, lower: bool) -> bool:
        rest = str(n)[1:]
        if lower:  # `_suffix_ge` branches at a digit below 9 with a non-zero tail
            return any(d != "9" and rest[i:].strip("0") for i, d in enumerate(rest))
        return any(d != "0" and rest[i:].strip("9") for i, d in enumerate(rest))

    longest = 0
    for bound, lower in ((lo, True), (hi, False)):
        if bound is None:
            continue
        if bound < 0:  # written as -m: the sides swap
            bound, lower = -bound, not lower
        if branches(bound, lower):
            longest = max(longest, len(str(bound)))
    return longest
