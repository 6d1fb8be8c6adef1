"""The request side: `SamplingParams(structured_outputs=...)` has vLLM's shape and its
shape errors name the field."""

from __future__ import annotations

import pickle

import pytest
from pydantic import BaseModel

from tandem import SamplingParams
from tandem.schema.sampling_params import SamplingParamsError
from tandem.schema.structured_outputs import StructuredOutputsParams


class Point(BaseModel):
    x: int
    y: int


def test_pydantic_model_becomes_its_json_schema() -> None:
    params = SamplingParams(structured_outputs={"json": Point})
    spec = params.structured_outputs
    assert spec is not None and spec.kind == "json"
    assert spec.json == Point.model_json_schema()
    assert pickle.loads(pickle.dumps(params)) == params  # crosses process boundaries


def test_json_string_is_parsed_and_cache_key_is_canonical() -> None:
    a = StructuredOutputsParams(json='{"type": "object", "required": ["a"]}')
    b = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    assert a.json == b.json
    assert a.spec_key() == b.spec_key()
    assert a.spec_key() != StructuredOutputsParams(regex="a").spec_key()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"regex": "a", "choice": ["x"]}, "exactly one of json, regex, grammar, choice"),
        ({}, "(got none)"),
        ({"json": "{not json"}, "structured_outputs.json: not a valid JSON"),
        ({"json": "[1, 2]"}, "a JSON schema must be an object"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"regex": "a", "shape": 1}, "structured_outputs.shape"),
    ],
)
def test_shape_errors_name_the_field(value: dict, message: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.build(structured_outputs=value)
    assert message in str(info.value)


def test_json_object_false_is_not_a_constraint() -> None:
    with pytest.raises(SamplingParamsError, match="got none"):
        SamplingParams.build(structured_outputs={"json_object": False})
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
