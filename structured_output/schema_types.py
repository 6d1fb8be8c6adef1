"""The schema checker's rewrite of a schema by its type's keywords.

`TypedKeywords.number`/`integer` (bounds and `multipleOf`: kept where the backend enforces
them, else a regex of the range spliced in through a placeholder `const`), `string`
(`format`, `pattern` folded with the lengths), `array` and `object` (properties that
`required` names but `properties` does not list, and the object keywords a backend may
lack). Each returns the prepared schema of one type or raises `SchemaRefused` /
`EmptySchema`; subschemas go back through the walker's `node`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from tandem.structured_output.number_regex import (
    MAX_BOUND_DIGITS,
    bound_digits,
    decimal_range_regex,
    integer_range_regex,
)
from tandem.structured_output.pattern import PatternError, parse_pattern
from tandem.structured_output.schema_support import (
    FORMAT_LENGTHS,
    INT64_MAX,
    MAX_LISTED_MULTIPLES,
    STANDARD_FORMATS,
    EmptySchema,
    SchemaRefused,
)
from tandem.structured_output.schema_values import _bound, _number, child
from tandem.structured_output.schema_walk import SchemaWalk


class TypedKeywords(SchemaWalk):
    """The rewrite of one type's keywords (number, integer, string, array, object)."""

    def number(self, s: dict[str, Any], t: str, path: str) -> dict[str, Any]:
        m = s.get("multipleOf")
        if m is not None:
            step = _number(m, child(path, "multipleOf"))
            if step <= 0:
                raise SchemaRefused(child(path, "multipleOf"), f"expected a number > 0, got {m!r}")
            if step != step.to_integral_value():
                raise self.refuse(child(path, "multipleOf"), f" ({m!r} is not an integer)")
            t, m = "integer", int(step)
        lo, lo_excl, lo_key = _bound(s, path, upper=False)
        hi, hi_excl, hi_key = _bound(s, path, upper=True)
        if t == "integer":
            ilo = None if lo is None else (math.floor(lo) + 1 if lo_excl else math.ceil(lo))
            ihi = None if hi is None else (math.ceil(hi) - 1 if hi_excl else math.floor(hi))
            if ilo is not None and ihi is not None and ilo > ihi:
                raise EmptySchema(path, f"no integer lies in [{ilo}, {ihi}]")
            return self.integer(ilo, ihi, m, path, lo_key, hi_key)
        if lo is not None and hi is not None and (lo > hi or lo == hi and (lo_excl or hi_excl)):
            raise EmptySchema(path, "no number satisfies the bounds")
        if lo is None and hi is None:
            return {"type": "number"}
        if self.support.number_bounds:
            out: dict[str, Any] = {"type": "number"}
            if lo is not None:
                out[lo_key] = s[lo_key]
            if hi is not None:
                out[hi_key] = s[hi_key]
            return out
        whole = [None if b is None else int(b) for b in (lo, hi)]
        if bound_digits(whole[0], whole[1]) > MAX_BOUND_DIGITS:
            key = lo_key if lo is not None and len(str(abs(int(lo)))) > MAX_BOUND_DIGITS else hi_key
            raise self.refuse(
                child(path, key),
                f" (a bound of more than {MAX_BOUND_DIGITS} digits: its index would take "
                "seconds to build)",
            )
        return self.splice(decimal_range_regex(lo, hi, lo_excl, hi_excl))

    def integer(
        self, lo: int | None, hi: int | None, step: int | None, path: str, lo_key: str, hi_key: str
    ) -> dict[str, Any]:
        if self.support.number_bounds:
            out: dict[str, Any] = {"type": "integer"}
            if self.support.int64_bounds:  # clamped: a subset; refused if none is left
                if lo is not None and lo > INT64_MAX:
                    raise self.refuse(child(path, lo_key), " (bounds outside the int64 range)")
                if hi is not None and hi < -INT64_MAX:
                    raise self.refuse(child(path, hi_key), " (bounds outside the int64 range)")
                lo = None if lo is None else max(lo, -INT64_MAX)
                hi = None if hi is None else min(hi, INT64_MAX)
            if lo is not None:
                out["minimum"] = lo
            if hi is not None:
                out["maximum"] = hi
            if step is not None and step != 1:
                out["multipleOf"] = step
            return out
        if step is not None and step != 1:
            if lo is None or hi is None:
                raise self.refuse(child(path, "multipleOf"), " (without both bounds)")
            first = -(-lo // step) * step
            count = (hi - first) // step + 1 if first <= hi else 0
            if count <= 0:
                raise EmptySchema(path, "no multiple lies within the bounds")
            if count > MAX_LISTED_MULTIPLES:
                raise self.refuse(
                    child(path, "multipleOf"),
                    f" (more than {MAX_LISTED_MULTIPLES} multiples in bounds)",
                )
            values = range(first, hi + 1, step)
            return self.splice("(?:" + "|".join(str(v) for v in values) + ")")
        if lo is None and hi is None:
            return {"type": "integer"}
        if bound_digits(lo, hi) > MAX_BOUND_DIGITS:
            key = lo_key if lo is not None and len(str(abs(lo))) > MAX_BOUND_DIGITS else hi_key
            raise self.refuse(
                child(path, key),
                f" (a bound of more than {MAX_BOUND_DIGITS} digits: its index would take "
                "seconds to build)",
            )
        return self.splice(integer_range_regex(lo, hi))

    def splice(self, regex: str) -> dict[str, Any]:
        """A placeholder constant that `OutlinesBackend` replaces by `regex`."""
        sentinel = f"{self.sentinel_prefix}{len(self.regexes)}"
        self.regexes[sentinel] = regex
        return {"const": sentinel}

    def string(self, s: dict[str, Any], path: str) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "string"}
        min_len = int(s.get("minLength", 0))
        max_len = s.get("maxLength")
        if max_len is not None and min_len > max_len:
            raise EmptySchema(path, "minLength > maxLength")
        has_lengths = "minLength" in s or "maxLength" in s
        length_key = "minLength" if "minLength" in s else "maxLength"
        fmt = s.get("format")
        if fmt is not None and fmt not in self.support.formats:
            if fmt in STANDARD_FORMATS:
                raise self.refuse(child(path, "format"), f" (format {fmt!r})")
            fmt = None  # a format JSON Schema does not define: an annotation
        if fmt is not None:
            if "pattern" in s:
                raise self.refuse(child(path, "pattern"), " beside 'format'")
            if has_lengths:
                implied = FORMAT_LENGTHS.get(fmt)
                if (
                    implied is None
                    or implied[0] < min_len
                    or max_len is not None
                    and implied[1] > max_len
                ):
                    raise self.refuse(child(path, length_key), f" beside 'format' ({fmt!r})")
            out["format"] = fmt
            return out
        if "pattern" in s:
            where = child(path, "pattern")
            try:
                pattern = parse_pattern(s["pattern"]).strip_anchors()
                if has_lengths:
                    folded = pattern.fold_lengths(min_len, max_len)
                    if folded is None:
                        raise self.refuse(
                            child(path, length_key),
                            " beside 'pattern' (the pattern cannot be narrowed to these lengths)",
                        )
                    pattern = folded
                out["pattern"] = pattern.source(json_safe=self.support.raw_json_patterns)
            except EmptySchema:
                raise
            except PatternError as exc:
                if "no string of the pattern" in str(exc):
                    raise EmptySchema(where, str(exc)) from None
                raise SchemaRefused(where, f"{exc}; not enforced by {self.support.label}") from None
            return out
        if "minLength" in s:
            out["minLength"] = min_len
        if max_len is not None:
            out["maxLength"] = max_len
        return out

    def array(self, s: dict[str, Any], path: str) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "array"}
        max_items = s.get("maxItems")
        if s.get("uniqueItems") and (max_items is None or max_items > 1):
            raise self.refuse(child(path, "uniqueItems"))
        if "unevaluatedItems" in s and "items" not in s and "prefixItems" not in s:
            raise self.refuse(child(path, "unevaluatedItems"))
        min_items = s.get("minItems", 0)
        if max_items is not None and min_items > max_items:
            raise EmptySchema(path, "minItems > maxItems")
        if "prefixItems" in s:
            out["prefixItems"] = [
                self.node(sub, child(child(path, "prefixItems"), i))
                for i, sub in enumerate(s["prefixItems"])
            ]
        if "items" in s:
            items = s["items"]
            if items is False:
                out["items"] = False
            else:
                try:
                    out["items"] = self.node(items, child(path, "items"))
                except EmptySchema:
                    if min_items > len(s.get("prefixItems", ())):
                        raise
                    out["items"] = False
        for key in ("minItems", "maxItems"):
            if key in s:
                out[key] = s[key]
        return out

    def object(self, s: dict[str, Any], path: str) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "object"}
        required = list(s.get("required", []))
        props = dict(s.get("properties", {}))
        for name in required:
            # Backends enforce `required` only for listed properties: list the others
            # with the schema that applies to them.
            if name not in props:
                props[name] = self._unlisted_property(s, name, path)
        kept: dict[str, Any] = {}
        for name, sub in props.items():
            here = child(child(path, "properties"), name)
            try:
                kept[name] = self.node(sub, here)
            except EmptySchema:
                if name in required:
                    raise
        if props:
            out["properties"] = kept
        if required:
            out["required"] = required
        extra = s.get("additionalProperties")
        if isinstance(extra, bool):
            out["additionalProperties"] = extra
        elif extra is not None:
            try:
                out["additionalProperties"] = self.node(extra, child(path, "additionalProperties"))
            except EmptySchema:
                out["additionalProperties"] = False
        for key in ("patternProperties", "propertyNames"):
            if key not in s:
                continue
            if not self.support.object_keywords:
                raise self.refuse(child(path, key))
            if key == "propertyNames":
                out[key] = self.node(s[key], child(path, key))
            else:
                out[key] = {
                    p: self.node(sub, child(child(path, key), p)) for p, sub in s[key].items()
                }
        closed = s.get("additionalProperties", False) is False and "patternProperties" not in s
        if "unevaluatedProperties" in s and "additionalProperties" not in s and not props:
            raise self.refuse(child(path, "unevaluatedProperties"))
        if "minProperties" in s:
            if self.support.object_keywords:
                out["minProperties"] = s["minProperties"]
            elif s["minProperties"] > len(set(required)):
                raise self.refuse(child(path, "minProperties"))
        if "maxProperties" in s:
            if self.support.object_keywords:
                out["maxProperties"] = s["maxProperties"]
            elif not (props and closed and len(props) <= s["maxProperties"]):
                raise self.refuse(child(path, "maxProperties"))
        return out

    def _unlisted_property(self, s: dict[str, Any], name: str, path: str) -> Any:
        """The schema of property `name` that `properties` does not list."""
        matching = [
            sub
            for pattern, sub in s.get("patternProperties", {}).items()
            if re.search(pattern, name) is not None
        ]
        if matching:
            merged: Any = {}
            for sub in matching:
                merged = self.merge(merged, sub, child(path, "patternProperties"))
            return merged
        extra = s.get("additionalProperties", True)
        if extra is False:
            raise EmptySchema(child(path, "required"), f"required property {name!r} is not allowed")
        return {} if extra is True else extra
