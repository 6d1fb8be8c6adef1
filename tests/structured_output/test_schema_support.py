"""Each backend enforces every keyword of a JSON schema it accepts (rewriting where an
equivalent form exists) or refuses the request naming the keyword's JSON path.

Documents are walked through the real matchers over the SmolLM2 tokenizer: a document
the grammar accepts must validate with `jsonschema`, the reference implementation."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from so_helpers import BACKENDS, EOS

from tandem.schema.request_checks import RequestRejectedError
from tandem.schema.structured_outputs import StructuredOutputsParams


def obj(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


def accepts(backend: Any, tokenizer: Any, schema: dict[str, Any], document: str) -> bool:
    """Whether the backend's grammar for `schema` accepts `document` and then EOS."""
    spec = StructuredOutputsParams(json=schema)
    matcher = backend.matcher(backend.compile(spec))
    return all(matcher.accept_token(t) for t in tokenizer.encode(document)) and bool(
        matcher.accept_token(EOS)
    )


def is_valid(schema: dict[str, Any], document: str) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(json.loads(document))


#: (name, schema, documents the grammar must accept, documents it must reject). Every
#: rejected document violates the schema; each case used to leak on at least one backend.
ENFORCED: list[tuple[str, dict[str, Any], list[str], list[str]]] = [
    (
        "int-bounds (outlines ignored them)",
        obj(age={"type": "integer", "minimum": 0, "maximum": 99}),
        ['{"age":0}', '{"age":42}', '{"age":99}'],
        ['{"age":100}', '{"age":-1}', '{"age":3220354922319476233533897}'],
    ),
    (
        "int exclusive and float bounds",
        obj(n={"type": "integer", "exclusiveMinimum": 0.5, "maximum": 10.7}),
        ['{"n":1}', '{"n":10}'],
        ['{"n":0}', '{"n":11}'],
    ),
    (
        "number bounds",
        obj(t={"type": "number", "minimum": -10.5, "maximum": 40.25}),
        ['{"t":-10.5}', '{"t":40.25}', '{"t":3.14}', '{"t":0}'],
        ['{"t":40.26}', '{"t":-10.51}', '{"t":41}'],
    ),
    (
        "number exclusive bounds",
        obj(p={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
        ['{"p":0.5}', '{"p":0.999}'],
        ['{"p":0}', '{"p":1}', '{"p":1.0}', '{"p":1.5}', '{"p":-0.5}'],
    ),
    (
        "pattern beside maxLength (xgrammar ignored the length)",
        obj(w={"type": "string", "pattern": "^[a-z]+$", "maxLength": 6}),
        ['{"w":"abc"}', '{"w":"abcdef"}'],
        ['{"w":"tonkfronn"}', '{"w":""}', '{"w":"ABC"}'],
    ),
    (
        "pattern beside min/maxLength (outlines ignored the pattern)",
        obj(w={"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4}),
        ['{"w":"ab"}', '{"w":"abcd"}'],
        ['{"w":"A1"}', '{"w":"a"}', '{"w":"abcde"}'],
    ),
    (
        "pattern dot on an escape (outlines matched the raw JSON text)",
        obj(w={"type": "string", "pattern": "^.{2}$"}),
        ['{"w":"ab"}'],
        ['{"w":"\\n"}', '{"w":"\\\\"}'],
    ),
    (
        "nullable bounds (outlines ignored bounds beside a type list)",
        obj(r={"type": ["integer", "null"], "minimum": 1, "maximum": 5}),
        ['{"r":null}', '{"r":3}'],
        ['{"r":6}', '{"r":0}'],
    ),
    (
        "enum beside type (both ignored the type)",
        obj(v={"type": "string", "enum": ["a", 1]}),
        ['{"v":"a"}'],
        ['{"v":1}'],
    ),
    (
        "keywords beside $ref (both ignored them)",
        {"$defs": {"A": {"type": "integer"}}, **obj(v={"$ref": "#/$defs/A", "maximum": 3})},
        ['{"v":3}'],
        ['{"v":4}'],
    ),
    (
        "required property not listed (both ignored it)",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["x"]},
        [],
        ['{"a":1}', "{}"],
    ),
    (
        "allOf (xgrammar took one subschema, outlines failed to compile)",
        {"allOf": [obj(x={"type": "integer"}), {"properties": {"x": {"maximum": 5}}}]},
        ['{"x":1}'],
        ['{"x":9}'],
    ),
    (
        "disjoint oneOf",
        {
            "oneOf": [
                obj(kind={"const": "cat"}, lives={"type": "integer", "minimum": 1, "maximum": 9}),
                obj(kind={"const": "dog"}, good={"type": "boolean"}),
            ]
        },
        ['{"kind":"cat","lives":3}', '{"kind":"dog","good":true}'],
        ['{"kind":"cat","lives":10}', '{"kind":"cat","good":true}'],
    ),
    (
        "multipleOf with bounds (outlines ignored it)",
        obj(d={"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}),
        ['{"d":0}', '{"d":10}', '{"d":50}'],
        ['{"d":7}', '{"d":55}'],
    ),
]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("case", ENFORCED, ids=[c[0] for c in ENFORCED])
def test_accepted_documents_validate_and_violations_are_rejected(
    backends: dict[str, Any], tokenizer: Any, name: str, case: tuple
) -> None:
    _, schema, good, bad = case
    backend = backends[name]
    for document in good:
        assert is_valid(schema, document), document
        assert accepts(backend, tokenizer, schema, document), f"{name} rejects {document}"
    for document in bad:
        assert not is_valid(schema, document), document
        assert not accepts(backend, tokenizer, schema, document), f"{name} accepts {document}"


REFUSED: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    (
        "uniqueItems",
        obj(ids={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
        {
            "xgrammar": "$.properties.ids.uniqueItems: not enforced by xgrammar",
            "outlines": "$.properties.ids.uniqueItems: not enforced by outlines-core",
        },
    ),
    ("not", {"type": "integer", "not": {"const": 3}}, {"*": "$.not: not enforced by"}),
    ("if", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, {"*": "$.if: "}),
    ("contains", {"type": "array", "contains": {"const": 5}}, {"*": "$.contains: "}),
    (
        "dependentRequired",
        {"type": "object", "dependentRequired": {"a": ["b"]}},
        {"*": "$.dependentRequired: "},
    ),
    (
        "overlapping oneOf",
        {"oneOf": [{"type": "integer"}, {"type": "number"}]},
        {"*": "$.oneOf: not enforced by"},
    ),
    (
        "multipleOf on floats",
        {"type": "number", "multipleOf": 0.5},
        {"*": "$.multipleOf: not enforced by"},
    ),
    (
        "a pattern the lengths cannot fold into",
        {"type": "string", "pattern": "^(ab)+$", "maxLength": 5},
        {"*": "$.maxLength: not enforced by"},
    ),
    (
        "format beside lengths",
        {"type": "string", "format": "email", "maxLength": 5},
        {"*": "$.maxLength: not enforced by"},
    ),
    (
        "no integer in bounds",
        {"type": "integer", "minimum": 10, "maximum": 5},
        {"*": "$: no integer lies in [10, 5]"},
    ),
    (
        "allOf whose additionalProperties closes the other's properties",
        {"allOf": [{"type": "object", "additionalProperties": False}, {"properties": {"x": {}}}]},
        {"*": "$.allOf[1].properties: not enforced by"},
    ),
    (
        "minProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
        {"outlines": "$.minProperties: not enforced by outlines-core"},
    ),
    (
        "patternProperties",
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
        {"outlines": "$.patternProperties: not enforced by outlines-core"},
    ),
    (
        "recursion",
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                }
            },
            "$ref": "#/$defs/n",
        },
        {"outlines": "$.$ref: not enforced by outlines-core (recursive reference '#/$defs/n')"},
    ),
    (
        "format regex",
        {"type": "string", "format": "regex"},
        {"*": "$.format: not enforced by"},
    ),
    (
        "ipv4",
        {"type": "string", "format": "ipv4"},
        {"outlines": "$.format: not enforced by outlines-core (format 'ipv4')"},
    ),
    (
        "a long bound",
        {"type": "integer", "minimum": 1234567890},
        {"outlines": "$.minimum: not enforced by outlines-core (a bound of more than 9 digits"},
    ),
    (
        "int64",
        {"type": "integer", "minimum": 10**20},
        {"xgrammar": "$.minimum: not enforced by xgrammar (bounds outside the int64 range)"},
    ),
]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_at_add_request_naming_the_keyword_path(
    backends: dict[str, Any], name: str, case: tuple
) -> None:
    _, schema, messages = case
    expected = messages.get(name, messages.get("*"))
    spec = StructuredOutputsParams(json=schema)
    if expected is None:  # this backend enforces it
        backends[name].check(spec)
        return
    with pytest.raises(RequestRejectedError) as info:
        backends[name].check(spec)
    assert str(info.value).startswith("structured_outputs.json: "), info.value
    assert expected in str(info.value), info.value


def test_property_order_is_the_schemas_own(backends: dict[str, Any], tokenizer: Any) -> None:
    """The prepared schema keeps `properties` in order: the model writes them so."""
    schema = obj(zeta={"type": "integer", "maximum": 5}, alpha={"type": "integer", "maximum": 5})
    for backend in backends.values():
        assert accepts(backend, tokenizer, schema, '{"zeta":1,"alpha":2}')
        assert not accepts(backend, tokenizer, schema, '{"alpha":2,"zeta":1}')
