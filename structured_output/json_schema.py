"""What each grammar backend enforces of a JSON schema, and the schema it is given.

Both backends silently drop keywords they cannot enforce (outlines-core: integer and
number bounds; xgrammar: `minLength`/`maxLength` beside a `pattern`; both: `uniqueItems`,
`not`, ...), so a constrained output could violate its schema. `prepare_schema` walks a
schema once per (backend, schema) and either returns an equivalent schema in a form the
backend enforces, or raises `SchemaRefused` naming the JSON path of the first keyword it
cannot enforce, e.g. `$.properties.age.maximum: not enforced by outlines-core`.

The contract: every JSON value the backend's grammar for the prepared schema accepts is
valid under the original schema (by the `jsonschema` library). Where an exact rewrite
does not exist, the prepared schema may accept *fewer* values (a subset), never more:
backends anchor patterns, write numbers without exponents, emit no properties a schema
does not list, and cap recursion depth.

Rewrites (both backends unless noted):
- draft-4 boolean `exclusiveMinimum`/`exclusiveMaximum`, draft-7 `items: [...]` /
  `additionalItems` → their 2020-12 forms;
- `allOf` → its subschemas merged into one (bounds tightened, `required` united, ...);
- keywords beside `anyOf`/`oneOf` → merged into every alternative; `oneOf` whose
  alternatives provably exclude each other (types, constants, a constant discriminator
  property) → `anyOf`;
- keywords beside `$ref` → the (non-recursive) target inlined and merged;
- `enum`/`const` beside other keywords → the values that satisfy them;
- a `type` list with type-specific keywords → `anyOf` of one branch per type; keywords
  of one type's family without `type` → that type;
- `multipleOf` k (an integer) on numbers → integers; float bounds on integers →
  integer bounds; `uniqueItems` with `maxItems <= 1`, `unevaluated*`,
  `minProperties <= len(required)` and other keywords that cannot fail → dropped;
- `pattern` beside `minLength`/`maxLength` → one pattern (`pattern.Pattern.fold_lengths`);
  patterns → anchor-free, JSON-safe on outlines-core (`pattern.Pattern.source`);
- outlines-core: bounded integers and numbers → a regex of the range
  (`number_regex`), spliced into outlines' regex through a placeholder `const`;
  `multipleOf` with at most 256 multiples in bounds → their list;
- xgrammar: integer bounds beyond int64 (which it cannot compile) → clamped.

Refused (`SchemaRefused`): `not`, `if`/`then`/`else`, `dependentRequired`,
`dependentSchemas`, `dependencies`, `contains`, `uniqueItems`, overlapping `oneOf`,
`multipleOf` on non-integers, remote or recursive-with-siblings `$ref`; on outlines-core
also recursive `$ref` (its depth limit writes invalid JSON), `patternProperties`, `propertyNames`, `minProperties`/`maxProperties` that can fail,
and formats it lacks; on xgrammar the formats it ignores; `format` beside `pattern` or
lengths the format does not imply; and schemas no value satisfies.

The checker's parts: `schema_support.py` (keyword families, what each backend enforces,
the errors), `schema_values.py` (pure helpers on values and keywords), `schema_walk.py`
(the pass's state, `$ref` resolution, merging), `schema_types.py` (one type's keywords);
this module dispatches a subschema by keyword kind and holds `prepare_schema`.
"""

from __future__ import annotations

import re
from typing import Any

from tandem.structured_output.schema_support import (
    ANNOTATIONS,
    ARRAY,
    FAMILIES,
    NEVER_ENFORCED,
    NUMERIC,
    OBJECT,
    OUTLINES,
    STRING,
    SUPPORT,
    XGRAMMAR,
    EmptySchema,
    PreparedSchema,
    SchemaRefused,
    SchemaSupport,
)
from tandem.structured_output.schema_types import TypedKeywords
from tandem.structured_output.schema_values import (
    _canonical,
    _declared_types,
    _exclusive,
    _normalize_drafts,
    _number,
    _type_of,
    _types,
    child,
)

__all__ = [
    "OUTLINES",
    "SUPPORT",
    "XGRAMMAR",
    "EmptySchema",
    "PreparedSchema",
    "SchemaRefused",
    "SchemaSupport",
    "child",
    "prepare_schema",
]


class _Walker(TypedKeywords):
    """One pass over one schema for one backend (see the module docstring): dispatch by
    keyword kind (`$ref`, `allOf`, constants, alternatives, a type's keywords)."""

    # Nodes -----------------------------------------------------------------------------
    def node(self, schema: Any, path: str) -> Any:
        """The prepared form of `schema` at `path`."""
        if schema is True or schema == {}:
            return {}
        if schema is False:
            raise EmptySchema(path, "the schema 'false' admits no value")
        if not isinstance(schema, dict):
            raise SchemaRefused(path, f"a schema must be an object or a boolean, got {schema!r}")
        s = _normalize_drafts(schema)
        for key in NEVER_ENFORCED:
            if key in s:
                raise self.refuse(child(path, key))
        if "$ref" in s:
            ref, _, _ = self._target(s["$ref"], child(path, "$ref"))
            siblings = {k: v for k, v in s.items() if k != "$ref" and k not in ANNOTATIONS}
            if not siblings:
                if not self.support.recursion and self._is_recursive(ref, path):
                    raise self.refuse(child(path, "$ref"), f" (recursive reference {ref!r})")
                self._walk_ref(ref, path)
                if self._ref_is_empty(ref):
                    raise EmptySchema(child(path, "$ref"), "the referenced schema admits no value")
                return {"$ref": ref}
            return self.node(self._inline(s, path), path)
        if "allOf" in s:
            merged: Any = {k: v for k, v in s.items() if k != "allOf"}
            subs = s["allOf"]
            if not isinstance(subs, list) or not subs:
                raise SchemaRefused(child(path, "allOf"), "expected a non-empty list of schemas")
            for i, sub in enumerate(subs):
                merged = self.merge(merged, sub, child(child(path, "allOf"), i))
            return self.node(merged, path)
        if "enum" in s or "const" in s:
            return self.constants(s, path)
        if "anyOf" in s or "oneOf" in s:
            return self.alternatives(s, path)
        return self.typed(s, path)

    def constants(self, s: dict[str, Any], path: str) -> dict[str, Any]:
        """`enum`/`const`: the listed values that satisfy the sibling keywords."""
        values = list(s["enum"]) if "enum" in s else [s["const"]]
        if "const" in s and "enum" in s:
            values = [v for v in values if _canonical(v) == _canonical(s["const"])]
        keyword = "enum" if "enum" in s else "const"
        siblings = {
            k: v for k, v in s.items() if k not in ANNOTATIONS and k not in ("enum", "const")
        }
        kept = [v for v in values if self._value_ok(v, siblings, path)]
        if not kept:
            raise EmptySchema(child(path, keyword), "no listed value satisfies the schema")
        return {"enum": kept} if keyword == "enum" else {"const": kept[0]}

    def _value_ok(self, value: Any, keywords: dict[str, Any], path: str) -> bool:
        """Whether a constant satisfies `keywords` (the scalar keywords beside an enum)."""
        kinds = _type_of(value)
        for key, arg in keywords.items():
            here = child(path, key)
            if key == "type":
                if not kinds & ({arg} if isinstance(arg, str) else set(arg)):
                    return False
            elif key in NUMERIC:
                if "number" not in kinds:
                    continue
                x = _number(value, here)
                bound = _number(arg, here)
                if key == "minimum" and x < bound or key == "maximum" and x > bound:
                    return False
                if (
                    key == "exclusiveMinimum"
                    and x <= bound
                    or key == "exclusiveMaximum"
                    and x >= bound
                ):
                    return False
                if key == "multipleOf" and x % bound != 0:
                    return False
            elif key in ("minLength", "maxLength"):
                if "string" in kinds and (
                    len(value) < arg if key == "minLength" else len(value) > arg
                ):
                    return False
            elif key == "pattern":
                try:
                    if "string" in kinds and re.search(arg, value) is None:
                        return False
                except re.error as exc:
                    raise SchemaRefused(here, f"invalid regex: {exc}") from None
            elif key in ("minItems", "maxItems"):
                if "array" in kinds and (
                    len(value) < arg if key == "minItems" else len(value) > arg
                ):
                    return False
            elif key in FAMILIES["object"] | FAMILIES["array"] | {"anyOf", "oneOf", "format"}:
                raise self.refuse(here, " beside enum/const")
        return True

    def alternatives(self, s: dict[str, Any], path: str) -> dict[str, Any]:
        """`anyOf`/`oneOf` (one of them): the alternatives, with the sibling keywords
        merged into each; `oneOf` only when its alternatives exclude each other."""
        if "anyOf" in s and "oneOf" in s:
            raise self.refuse(child(path, "oneOf"), " beside 'anyOf'")
        keyword = "anyOf" if "anyOf" in s else "oneOf"
        branches = s[keyword]
        if not isinstance(branches, list) or not branches:
            raise SchemaRefused(child(path, keyword), "expected a non-empty list of schemas")
        if keyword == "oneOf" and not self._disjoint(branches, path):
            raise self.refuse(
                child(path, "oneOf"),
                " (its alternatives may overlap; a value matching two of them is invalid)",
            )
        siblings = {k: v for k, v in s.items() if k != keyword and k not in ANNOTATIONS}
        out = []
        for i, branch in enumerate(branches):
            here = child(child(path, keyword), i)
            try:
                merged = self.merge(branch, siblings, here) if siblings else branch
                out.append(self.node(merged, here))
            except EmptySchema:
                continue
        if not out:
            raise EmptySchema(child(path, keyword), "no alternative admits a value")
        return out[0] if len(out) == 1 else {"anyOf": out}

    def _disjoint(self, branches: list[Any], path: str) -> bool:
        sigs = [self._signature(b, path) for b in branches]
        return all(
            _exclusive(sigs[i], sigs[j]) for i in range(len(sigs)) for j in range(i + 1, len(sigs))
        )

    def _signature(
        self, schema: Any, path: str
    ) -> tuple[set[str] | None, set[str] | None, dict[str, set[str]]]:
        """(types, constants, required constant properties) of a oneOf alternative."""
        while isinstance(schema, dict) and "$ref" in schema:
            schema = self._target(schema["$ref"], path)[2]
        if not isinstance(schema, dict):
            return None, None, {}
        consts = None
        if "const" in schema:
            consts = {_canonical(schema["const"])}
        elif "enum" in schema and isinstance(schema["enum"], list):
            consts = {_canonical(v) for v in schema["enum"]}
        tags: dict[str, set[str]] = {}
        props = schema.get("properties")
        if isinstance(props, dict):
            for name in schema.get("required", []):
                sub = props.get(name)
                if isinstance(sub, dict) and ("const" in sub or "enum" in sub):
                    tags[name] = self._signature(sub, path)[1] or set()
        return _types(schema), consts, tags

    def typed(self, s: dict[str, Any], path: str) -> Any:
        """A schema without composition or constants: by its type."""
        types = _declared_types(s, path)
        if types is None:
            families = [name for name, keys in FAMILIES.items() if keys & set(s)]
            if not families:
                return {}
            if len(families) > 1:
                raise self.refuse(path, " (keywords of several types without 'type')")
            types = [families[0]]
        if len(types) > 1:
            specific = set(s) & (NUMERIC | STRING | ARRAY | OBJECT)
            if not specific:
                return {"type": types}
            out = []
            for t in types:
                try:
                    out.append(self.typed({**s, "type": t}, path))
                except EmptySchema:
                    continue
            if not out:
                raise EmptySchema(path, "no value satisfies the schema")
            return out[0] if len(out) == 1 else {"anyOf": out}
        t = types[0]
        if t in ("integer", "number"):
            return self.number(s, t, path)
        if t == "string":
            return self.string(s, path)
        if t == "array":
            return self.array(s, path)
        if t == "object":
            return self.object(s, path)
        return {"type": t}


def prepare_schema(schema: Any, support: SchemaSupport) -> PreparedSchema:
    """The schema to compile on the backend `support` describes; raises `SchemaRefused`
    (path and reason) when the backend cannot enforce it, `EmptySchema` when no value
    satisfies it."""
    walker = _Walker(schema, support)
    walker.walked.add("#")
    out = walker.node(schema, "$")
    if walker.defs:
        out = {**out, **{key: defs for key, defs in walker.defs.items()}}
    return PreparedSchema(out, walker.regexes)
