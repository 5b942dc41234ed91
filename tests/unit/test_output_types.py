"""TypedDict and JSON-schema dict inputs turned into Pydantic models (output_types.py), and the schemas
they refuse."""

from __future__ import annotations

from typing import Annotated, TypedDict

import pytest
from pydantic import Field

from pcd_engine import (
    Limits,
    UnsupportedSchemaError,
    compile_schema,
)
from pcd_engine.output_types import output_type


def test_typed_dict_follows_langchain_annotated_convention():
    class Joke(TypedDict):
        """A joke to tell the user."""

        setup: Annotated[str, ..., "The setup of the joke"]
        punchline: Annotated[str | None, None, "The punchline"]
        rating: Annotated[int, Field(ge=1, le=10)]

    target = output_type(Joke)
    fields = target.model.model_fields
    assert target.returns_dict and target.model.__doc__ == "A joke to tell the user."
    assert fields["setup"].is_required() and fields["setup"].description == "The setup of the joke"
    assert not fields["punchline"].is_required() and fields["punchline"].default is None
    assert compile_schema(target.model, Limits(), allow_open=True).fields[0].path == "rating"  # bounded int
    assert target.to_output(target.model(setup="s", rating=3)) == {"setup": "s", "rating": 3}


@pytest.mark.parametrize(
    "schema",
    [
        {
            "title": "Pick",
            "type": "object",
            "properties": {"kind": {"enum": ["a", "b"]}},
            "required": ["kind"],
        },
        {"name": "Pick", "parameters": {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}}},
        {
            "type": "function",
            "function": {"name": "Pick", "parameters": {"properties": {"kind": {"enum": ["a", "b"]}}}},
        },
    ],
)
def test_json_schema_dicts_become_models_with_closed_fields(schema):
    target = output_type(schema)
    assert target.returns_dict and target.model.__name__ == "Pick"
    assert compile_schema(target.model).fields[0].candidates[0].value == "a"
    assert output_type(dict(schema)) is target  # converted once per distinct schema


def test_bad_schemas_raise_unsupported_schema_error():
    with pytest.raises(UnsupportedSchemaError, match="TypedDict or a JSON-schema dict"):
        output_type(int)
    with pytest.raises(UnsupportedSchemaError, match="object with 'properties'"):
        output_type({"type": "string"})
