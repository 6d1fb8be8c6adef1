"""The JSON Schema vocabulary the schema checker speaks, and what each backend enforces.

Keyword families (`NUMERIC`, `STRING`, `ARRAY`, `OBJECT`), the keywords no bundled backend
enforces, the standard formats; `SchemaSupport` records what one backend enforces natively
(`XGRAMMAR`, `OUTLINES`, by name in `SUPPORT`); `SchemaRefused`/`EmptySchema` are the errors
`json_schema.prepare_schema` raises, and `PreparedSchema` is what it returns. Data only: the
walk that uses them is in `json_schema.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
