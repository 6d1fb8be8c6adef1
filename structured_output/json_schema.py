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
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from tandem.structured_output.number_regex import (
    MAX_BOUND_DIGITS,
    bound_digits,
    decimal_range_regex,
    integer_range_regex,
)
from tandem.structured_output.pattern import PatternError, parse_pattern

ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$comment", "$schema", "$id",
        "$anchor", "$dynamicAnchor", "$vocabulary", "readOnly", "writeOnly", "deprecated",
        "contentMediaType", "contentEncoding", "contentSchema", "discriminator", "$defs",
        "definitions",
    }
)  # fmt: skip
NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
STRING = frozenset({"minLength", "maxLength", "pattern", "format"})
ARRAY = frozenset(
    {"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains",
     "maxContains", "unevaluatedItems"}
)  # fmt: skip
OBJECT = frozenset(
    {"properties", "required", "additionalProperties", "patternProperties", "propertyNames",
     "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
     "dependencies", "unevaluatedProperties"}
)  # fmt: skip
FAMILIES = {"number": NUMERIC, "string": STRING, "array": ARRAY, "object": OBJECT}
GENERIC = frozenset({"type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf"})
#: Keywords no bundled backend enforces; refused wherever they appear.
NEVER_ENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                  "dependencies", "contains", "$dynamicRef", "$recursiveRef")  # fmt: skip
TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
#: The formats JSON Schema 2020-12 defines (others are annotations without meaning).
STANDARD_FORMATS = frozenset(
    {"date-time", "date", "time", "duration", "email", "idn-email", "hostname",
     "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid",
     "uri-template", "json-pointer", "relative-json-pointer", "regex"}
)  # fmt: skip
#: Lengths every string of a format has (so `minLength`/`maxLength` beside it may hold).
FORMAT_LENGTHS = {"date": (10, 10), "uuid": (36, 36), "ipv4": (7, 15)}
INT64_MAX = 2**63 - 1
#: outlines-core: most multiples of `multipleOf` listed as alternatives of a regex.
MAX_LISTED_MULTIPLES = 256


@dataclass(frozen=True)
class SchemaSupport:
    """What one backend enforces natively (measured on the installed versions; see
    docs/structured-output.md)."""

    name: str
    label: str
    #: minimum/maximum/exclusive* on integer and number (outlines-core: no).
    number_bounds: bool
    #: multipleOf on integers.
    multiple_of: bool
    #: patternProperties, propertyNames, minProperties, maxProperties.
    object_keywords: bool
    #: Formats whose language the backend restricts strings to.
    formats: frozenset[str]
    #: Patterns are matched against the raw JSON text of a string (outlines-core).
    raw_json_patterns: bool
    #: Integer bounds must fit in int64 (xgrammar).
    int64_bounds: bool
    #: Recursive `$ref` (outlines-core unrolls a few levels and then writes an object with
    #: the recursive property dropped and a trailing comma: invalid JSON).
    recursion: bool


XGRAMMAR = SchemaSupport(
    name="xgrammar",
    label="xgrammar",
    number_bounds=True,
    multiple_of=True,
    object_keywords=True,
    formats=frozenset(
        {
            "date-time",
            "date",
            "time",
            "duration",
            "email",
            "hostname",
            "ipv4",
            "ipv6",
            "uri",
            "uri-reference",
            "uuid",
            "uri-template",
            "json-pointer",
            "relative-json-pointer",
        }
    ),  # fmt: skip
    raw_json_patterns=False,
    int64_bounds=True,
    recursion=True,
)
OUTLINES = SchemaSupport(
    name="outlines",
    label="outlines-core",
    number_bounds=False,
    multiple_of=False,
    object_keywords=False,
    formats=frozenset({"date-time", "date", "time", "email", "uri", "uuid"}),
    raw_json_patterns=True,
    int64_bounds=False,
    recursion=False,
)
SUPPORT = {s.name: s for s in (XGRAMMAR, OUTLINES)}


class SchemaRefused(ValueError):
    """The backend cannot enforce the keyword at `path` (a JSON path, `$.properties.x.k`)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class EmptySchema(SchemaRefused):
    """No JSON value satisfies the (sub)schema at `path`."""


@dataclass
class PreparedSchema:
    """The schema to hand to the backend, plus (outlines-core) regexes to splice in:
    each `regexes` key is a string constant of `schema` that stands for a regex."""

    schema: Any
    regexes: dict[str, str] = field(default_factory=dict)


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


class _Walker:
    """One pass over one schema for one backend (see the module docstring)."""

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
