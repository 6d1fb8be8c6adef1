"""The grammar conformance corpus: JSON schemas with prompts that tempt a model to break them.

`SchemaCase` is one constrained request; `CORPUS` covers numeric bounds on integers and
floats, exclusive bounds, string lengths, patterns, a pattern beside lengths, enums,
constants, nested arrays with item counts, nested and optional objects, `oneOf`, `allOf`,
`$ref` recursion and keywords no bundled backend enforces; `CI_CORPUS` is the subset CI
runs; `CORPORA` names both. Data only: `grammar_conformance.py` runs them and
`grammar_outcomes.py` classifies what they gave.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_TOKENS = 48


@dataclass(frozen=True)
class SchemaCase:
    """One constrained request: a prompt (often one that tempts the model to break the
    schema) and the JSON schema its output must satisfy."""

    name: str
    prompt: str
    schema: dict[str, Any]
    #: Plain shapes every grammar backend must enforce (a refusal is a failure).
    must_enforce: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS


def _obj(required: Sequence[str] | None = None, **properties: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    schema["required"] = list(properties) if required is None else list(required)
    return schema


_DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
CORPUS: tuple[SchemaCase, ...] = (
    SchemaCase(
        "plain-shapes",
        "Describe a city (name, population, coastal) as JSON.",
        _obj(name={"type": "string"}, population={"type": "integer"}, coastal={"type": "boolean"}),
        must_enforce=True,
    ),
    SchemaCase(
        "int-bounds",
        "How old is the universe, in years? Answer as JSON with a name and an age.",
        _obj(
            name={"type": "string", "maxLength": 12},
            age={"type": "integer", "minimum": 0, "maximum": 99},
        ),
    ),
    SchemaCase(
        "int-exclusive-and-large",
        "Give the population of Tokyo and a score as JSON.",
        _obj(
            population={"type": "integer", "minimum": 100000, "maximum": 999999},
            score={"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        ),
    ),
    SchemaCase(
        "float-bounds",
        "Report the temperature of the sun's surface in Celsius as JSON.",
        _obj(
            temperature={"type": "number", "minimum": -10.5, "maximum": 40.25},
            unit={"enum": ["C", "F"]},
        ),
    ),
    SchemaCase(
        "float-exclusive",
        "What is the probability that it rains tomorrow, and the humidity? As JSON.",
        _obj(
            probability={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            humidity={"type": "number", "minimum": 0, "exclusiveMaximum": 100},
        ),
    ),
    SchemaCase(
        "string-lengths",
        "Give an airport's full name and its code as JSON.",
        _obj(
            name={"type": "string", "minLength": 3, "maxLength": 10},
            code={"type": "string", "minLength": 3, "maxLength": 3},
        ),
    ),
    SchemaCase(
        "pattern",
        "Give a US zip code and a hex colour as JSON.",
        _obj(
            zip={"type": "string", "pattern": "^[0-9]{5}$"},
            color={"type": "string", "pattern": "^#[0-9a-f]{6}$"},
        ),
    ),
    SchemaCase(
        "pattern-and-length",
        "Write the longest English word you know and a social media handle as JSON.",
        _obj(
            word={"type": "string", "pattern": "^[a-z]+$", "maxLength": 6},
            handle={"type": "string", "pattern": "^@[a-z0-9_]+$", "minLength": 4, "maxLength": 9},
        ),
    ),
    SchemaCase(
        "enum-and-const",
        "Describe a traffic light's state as JSON.",
        _obj(
            kind={"const": "light"},
            version={"const": 2},
            color={"enum": ["red", "amber", "green"]},
            value={"enum": [1, "one", None, True]},
        ),
    ),
    SchemaCase(
        "nested-arrays",
        "Write a small grid of digits as JSON.",
        _obj(
            grid={
                "type": "array",
                "items": {"type": "array", "items": _DIGIT, "minItems": 2, "maxItems": 3},
                "minItems": 1,
                "maxItems": 2,
            }
        ),
    ),
    SchemaCase(
        "nested-objects",
        "Describe a famous novel and its author as JSON.",
        _obj(
            title={"type": "string", "maxLength": 24},
            author=_obj(
                name={"type": "string", "maxLength": 20},
                born={"type": "integer", "minimum": 1000, "maximum": 2024},
            ),
            tags={"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        ),
        max_tokens=64,
    ),
    SchemaCase(
        "optional-properties",
        "Describe a pet as JSON; add a nickname if it has one.",
        _obj(
            required=["name"],
            name={"type": "string", "maxLength": 10},
            nickname={"type": "string", "maxLength": 8},
            age={"type": "integer", "minimum": 0, "maximum": 30},
        ),
    ),
    SchemaCase(
        "array-counts",
        "List many fruits as JSON tags.",
        _obj(
            tags={
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            }
        ),
    ),
    SchemaCase(
        "nullable-bounds",
        "Rate the film Titanic from 1 to 5 as JSON.",
        _obj(rating={"type": ["integer", "null"], "minimum": 1, "maximum": 5}),
    ),
    SchemaCase(
        "multiple-of",
        "Give a discount percentage as JSON.",
        _obj(discount={"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}),
    ),
    SchemaCase(
        "format-date",
        "When did the Berlin wall fall? Answer as JSON.",
        _obj(event={"type": "string", "maxLength": 16}, when={"type": "string", "format": "date"}),
    ),
    SchemaCase(
        "one-of-tagged",
        "Describe a pet, a cat or a dog, as JSON.",
        {
            "oneOf": [
                _obj(kind={"const": "cat"}, lives={"type": "integer", "minimum": 1, "maximum": 9}),
                _obj(kind={"const": "dog"}, good={"type": "boolean"}),
            ]
        },
    ),
    SchemaCase(
        "all-of",
        "Give a point with x and y as JSON.",
        {
            "allOf": [
                _obj(x={"type": "integer"}, y={"type": "integer"}),
                {"properties": {"x": {"minimum": -5, "maximum": 5}, "y": {"maximum": 0}}},
            ]
        },
    ),
    SchemaCase(
        "ref-recursion",
        "Write the arithmetic expression 1 + 2 * 3 as a JSON tree.",
        {
            "$defs": {
                "expr": {
                    "anyOf": [
                        _DIGIT,
                        _obj(
                            op={"enum": ["+", "*"]},
                            args={
                                "type": "array",
                                "items": {"$ref": "#/$defs/expr"},
                                "minItems": 2,
                                "maxItems": 2,
                            },
                        ),
                    ]
                }
            },
            "$ref": "#/$defs/expr",
        },
        max_tokens=64,
    ),
    SchemaCase(
        "map-min-properties",
        "Give the scores of at least two players as a JSON object.",
        {
            "type": "object",
            "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 99},
            "minProperties": 2,
            "maxProperties": 3,
        },
    ),
    SchemaCase(
        "unique-items",
        "List three different lucky numbers as JSON.",
        _obj(numbers={"type": "array", "items": _DIGIT, "uniqueItems": True, "maxItems": 3}),
    ),
)
#: The schemas of the CI run (about a minute for both bundled backends, both modes).
CI_CASE_NAMES = (
    "plain-shapes",
    "int-bounds",
    "float-exclusive",
    "pattern-and-length",
    "enum-and-const",
    "nested-arrays",
    "optional-properties",
    "unique-items",
)
CI_CORPUS: tuple[SchemaCase, ...] = tuple(c for c in CORPUS if c.name in CI_CASE_NAMES)
CORPORA = {"ci": CI_CORPUS, "full": CORPUS}
