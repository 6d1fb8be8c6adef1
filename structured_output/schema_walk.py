"""The state of one pass of the schema checker, `$ref` resolution and schema merging.

`SchemaWalk` holds what one pass over one schema for one backend accumulates (rewritten
`$defs`, spliced regexes, which references were walked) and the two operations every part
of the walk needs: resolving a local `$ref` (inlining a non-recursive target where keywords
sit beside it) and `merge`, the conjunction of two schemas as one schema (bounds tightened,
`required` united, ...; refused where no such form exists). `TypedKeywords`
(`schema_types.py`) and the walker in `json_schema.py` build on it; `node`, the prepared
form of a subschema, is the walker's.
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

from tandem.structured_output.schema_support import (
    ANNOTATIONS,
    TYPES,
    EmptySchema,
    SchemaRefused,
    SchemaSupport,
)
from tandem.structured_output.schema_values import (
    _canonical,
    _is_integer_value,
    _refs_in,
    _types,
    child,
)


class SchemaWalk:
    """One pass over one schema for one backend: its state, references and merging."""

    def __init__(self, root: Any, support: SchemaSupport) -> None:
        self.root = root
        self.support = support
        self.regexes: dict[str, str] = {}
        self.defs: dict[str, dict[str, Any]] = {}  # "$defs" / "definitions" -> name -> out
        self.walked: set[str] = set()
        text = json.dumps(root)
        nonce = 0
        while f"tandem{nonce}x" in text:
            nonce += 1
        self.sentinel_prefix = f"tandem{nonce}x"
        self._recursive: dict[str, bool] = {}

    def refuse(self, path: str, detail: str = "") -> SchemaRefused:
        return SchemaRefused(path, f"not enforced by {self.support.label}{detail}")

    def node(self, schema: Any, path: str) -> Any:
        """The prepared form of `schema` at `path` (defined by the walker, `json_schema`)."""
        raise NotImplementedError

    # $ref ------------------------------------------------------------------------------
    def _target(self, ref: Any, path: str) -> tuple[str, str | None, Any]:
        """(ref, defs key or None for the root, the target schema as written)."""
        if not isinstance(ref, str):
            raise SchemaRefused(path, f"expected a string, got {ref!r}")
        if ref == "#":
            return ref, None, self.root
        match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
        if match is None:
            raise SchemaRefused(
                path, f"only local references '#/$defs/NAME' are supported, got {ref!r}"
            )
        key, name = match.group(1), match.group(2).replace("~1", "/").replace("~0", "~")
        defs = self.root.get(key) if isinstance(self.root, dict) else None
        if not isinstance(defs, dict) or name not in defs:
            raise SchemaRefused(path, f"unresolvable reference {ref!r}")
        return ref, key, defs[name]

    def _is_recursive(self, ref: str, path: str) -> bool:
        """Whether `ref`'s target reaches itself through references."""
        if ref not in self._recursive:
            seen: set[str] = set()
            stack = [ref]
            found = False
            while stack and not found:
                _, _, target = self._target(stack.pop(), path)
                for inner in _refs_in(target):
                    if inner == ref:
                        found = True
                    elif inner not in seen:
                        seen.add(inner)
                        stack.append(inner)
            self._recursive[ref] = found
        return self._recursive[ref]

    def _walk_ref(self, ref: str, path: str) -> None:
        """Rewrite the target of `ref` once, into `self.defs` (its path: `$.$defs.NAME`)."""
        if ref in self.walked:
            return
        self.walked.add(ref)
        _, key, target = self._target(ref, path)
        if key is None:
            return  # the root, walked by `prepare`
        name = ref.split("/", 2)[2].replace("~1", "/").replace("~0", "~")
        try:
            out = self.node(target, child(child("$", key), name))
        except EmptySchema:
            out = False  # a reference to it admits no value; a branch holding it is dropped
        self.defs.setdefault(key, {})[name] = out

    def _ref_is_empty(self, ref: str) -> bool:
        if ref == "#":
            return False
        key, name = ref.split("/", 2)[1:]
        return self.defs.get(key, {}).get(name.replace("~1", "/").replace("~0", "~")) is False

    def _inline(self, schema: Any, path: str) -> Any:
        """`schema` with a top-level `$ref` replaced by a copy of its (non-recursive)
        target merged with the siblings."""
        while isinstance(schema, dict) and "$ref" in schema:
            ref, _, target = self._target(schema["$ref"], child(path, "$ref"))
            if self._is_recursive(ref, path):
                sibling = next((k for k in schema if k != "$ref" and k not in ANNOTATIONS), "$ref")
                raise self.refuse(child(path, sibling), " beside a recursive $ref")
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = self.merge(copy.deepcopy(target), rest, path)
        return schema

    # Merging ---------------------------------------------------------------------------
    def merge(self, a: Any, b: Any, path: str) -> Any:
        """The conjunction of schemas a and b as one schema (refused where it has no
        such form here)."""
        if b is True or b == {}:
            return a
        if a is True or a == {}:
            return b
        if a is False or b is False:
            raise EmptySchema(path, "no value satisfies the schema")
        a = self._inline(a, path)
        b = self._inline(b, path)
        for mine, theirs in ((a, b), (b, a)):
            # `mine`'s additionalProperties/patternProperties govern the properties only
            # `theirs` lists: not merged here.
            closed = (
                mine.get("additionalProperties", True) is not True or "patternProperties" in mine
            )
            if closed and set(theirs.get("properties", {})) - set(mine.get("properties", {})):
                raise self.refuse(
                    child(path, "properties"),
                    " (properties one subschema lists and another's additionalProperties "
                    "governs cannot be combined)",
                )
        out = dict(a)
        for key, value in b.items():
            if key not in out or _canonical(out[key]) == _canonical(value) or key in ANNOTATIONS:
                out.setdefault(key, value)
                continue
            mine = out[key]
            if key == "type":
                types = (_types(a) or set()) & (_types(b) or set())
                if not types:
                    raise EmptySchema(child(path, "type"), "no value satisfies the schema")
                out[key] = [
                    t for t in TYPES if t in types and not (t == "integer" and "number" in types)
                ]
            elif key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
                out[key] = max(mine, value)
            elif key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
                out[key] = min(mine, value)
            elif key == "required":
                out[key] = list(dict.fromkeys([*mine, *value]))
            elif key == "enum":
                theirs = {_canonical(v) for v in value}
                out[key] = [v for v in mine if _canonical(v) in theirs]
            elif key == "const":
                raise EmptySchema(child(path, key), "two subschemas require different constants")
            elif key == "properties" and isinstance(mine, dict) and isinstance(value, dict):
                props = dict(mine)
                for name, sub in value.items():
                    props[name] = (
                        self.merge(props[name], sub, child(child(path, key), name))
                        if name in props
                        else sub
                    )
                out[key] = props
            elif key == "items" and isinstance(mine, dict) and isinstance(value, dict):
                out[key] = self.merge(mine, value, child(path, key))
            elif key == "multipleOf" and _is_integer_value(mine) and _is_integer_value(value):
                out[key] = math.lcm(int(mine), int(value))
            else:
                raise self.refuse(
                    child(path, key),
                    " (two subschemas give it different values that cannot be combined)",
                )
        return out
