"""Pure helpers of the schema checker: reading JSON values and schema keywords.

JSON paths (`child`), canonical JSON text, the JSON types of a value or a schema, numeric
keywords as `Decimal`, the tightest bound, earlier drafts' spellings in their 2020-12 form,
the `$ref`s inside a schema, and whether two `oneOf` alternatives exclude each other. None
of them knows a backend. The underscored names are shared by the checker's modules
(`schema_walk`, `schema_types`, `json_schema`) and are not part of the package's API.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import Any

from tandem.structured_output.schema_support import TYPES, SchemaRefused


def child(path: str, key: str | int) -> str:
    """The JSON path of `key` under `path`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if re.fullmatch(r"[A-Za-z_$][A-Za-z0-9_$-]*", key):
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key)}]"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _is_integer_value(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )


def _type_of(value: Any) -> set[str]:
    """The JSON types of a value (an integral number is both integer and number)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, (int, float)):
        return {"integer", "number"} if _is_integer_value(value) else {"number"}
    if isinstance(value, str):
        return {"string"}
    if isinstance(value, list):
        return {"array"}
    return {"object"}


def _types(schema: dict[str, Any]) -> set[str] | None:
    raw = schema.get("type")
    if raw is None:
        return None
    names = {raw} if isinstance(raw, str) else set(raw)
    return names | ({"integer"} if "number" in names else set())


def _number(value: Any, path: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SchemaRefused(path, f"expected a finite number, got {value!r}")
    return Decimal(value) if isinstance(value, int) else Decimal(repr(value))


def _exclusive(
    a: tuple[set[str] | None, set[str] | None, dict[str, set[str]]],
    b: tuple[set[str] | None, set[str] | None, dict[str, set[str]]],
) -> bool:
    """Whether no value can match both oneOf alternatives with these signatures."""
    types_a, consts_a, tags_a = a
    types_b, consts_b, tags_b = b
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    if consts_a is not None and consts_b is not None and not consts_a & consts_b:
        return True
    for consts, types in ((consts_a, types_b), (consts_b, types_a)):
        if (
            consts is not None
            and types is not None
            and not any(_type_of(json.loads(c)) & types for c in consts)
        ):
            return True
    return any(name in tags_b and not tags_a[name] & tags_b[name] for name in tags_a)


def _refs_in(schema: Any) -> list[str]:
    """Every `$ref` string inside a schema."""
    found: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                found.append(ref)
            stack.extend(
                v for k, v in node.items() if k not in ("$defs", "definitions", "enum", "const")
            )
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _declared_types(s: dict[str, Any], path: str) -> list[str] | None:
    raw = s.get("type")
    if raw is None:
        return None
    names = [raw] if isinstance(raw, str) else raw
    if not isinstance(names, list) or not names or any(n not in TYPES for n in names):
        raise SchemaRefused(
            child(path, "type"),
            f"expected one of {', '.join(TYPES)} or a list of them, got {raw!r}",
        )
    return list(dict.fromkeys(names))


def _normalize_drafts(schema: dict[str, Any]) -> dict[str, Any]:
    """Earlier drafts' spellings in their 2020-12 form: boolean exclusive bounds, `items`
    as a list with `additionalItems`."""
    s = dict(schema)
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(s.get(key), bool) and s.pop(key) and bound in s:
            s[key] = s.pop(bound)
    if isinstance(s.get("items"), list):
        s["prefixItems"] = s.pop("items")
        if "additionalItems" in s:
            s["items"] = s.pop("additionalItems")
        else:
            s.pop("additionalItems", None)
    else:
        s.pop("additionalItems", None)  # ignored beside a schema `items` (2019-09)
    return s


def _bound(s: dict[str, Any], path: str, upper: bool) -> tuple[Decimal | None, bool, str]:
    """The tightest lower (or upper) bound: (value, exclusive, keyword)."""
    keys = ("maximum", "exclusiveMaximum") if upper else ("minimum", "exclusiveMinimum")
    best: tuple[Decimal | None, bool, str] = (None, False, keys[0])
    for key, exclusive in zip(keys, (False, True), strict=True):
        if key in s:
            value = _number(s[key], child(path, key))
            tighter = best[0] is None or (value < best[0] if upper else value > best[0])
            if tighter or value == best[0] and exclusive:
                best = (value, exclusive, key)
    return best
