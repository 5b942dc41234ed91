"""What the caller asked for: a Pydantic class, a TypedDict or a JSON-schema dict, as one Pydantic model.

The engine works on Pydantic models. A TypedDict becomes a model with the same keys (LangChain's
`Annotated[type, default, "description"]` convention is honoured); a JSON-schema dict (a plain object
schema, or a function/tool definition with `parameters`) becomes a model through
`json-schema-to-pydantic`. For those two, results are plain dicts (`returns_dict`), holding the keys the
answer set.

    >>> from typing import TypedDict
    >>> class Joke(TypedDict):
    ...     setup: str
    ...     punchline: str
    >>> output_type(Joke).returns_dict, sorted(output_type(Joke).model.model_fields)
    (True, ['punchline', 'setup'])
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import annotated_types
import pydantic
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from typing_extensions import is_typeddict

from pcd_engine.bounded_cache import BoundedCache
from pcd_engine.errors import UnsupportedSchemaError
from pcd_engine.schema import CompiledSchema, Limits, compile_schema


@dataclass(frozen=True)
class OutputType:
    model: type[BaseModel]
    returns_dict: bool  # True for TypedDict and JSON-schema dict inputs

    def to_output(self, value: BaseModel) -> Any:
        if not self.returns_dict:
            return value
        return value.model_dump(mode="json", by_alias=True, exclude_unset=True)


PYDANTIC_METADATA = (FieldInfo, annotated_types.BaseMetadata, annotated_types.GroupedMetadata)
# Models built from JSON-schema dicts, by the dict's JSON: the most recently used are kept.
DICT_MODELS: BoundedCache[str, OutputType] = BoundedCache(512)


def output_type(schema: Any) -> OutputType:
    """The Pydantic model behind `schema`; raises UnsupportedSchemaError for anything else."""
    if inspect.isclass(schema) and issubclass(schema, BaseModel):
        return OutputType(schema, returns_dict=False)
    if is_typeddict(schema):
        return _typed_dict_type(schema)
    if isinstance(schema, Mapping):
        key = json.dumps(schema, sort_keys=True, default=str)
        return DICT_MODELS.get_or_build(
            key, lambda: OutputType(_json_schema_model(schema), returns_dict=True)
        )
    raise UnsupportedSchemaError(
        "<root>",
        schema,
        "the schema must be a pydantic.BaseModel subclass, a TypedDict or a JSON-schema dict",
    )


def require_closed(schema: Any, limits: Limits | None = None) -> CompiledSchema:
    """`schema` (any form `output_type` takes) compiled with closed fields only: an open field raises
    UnsupportedSchemaError naming it, before any model work (what `allow_generation=False` promises)."""
    return compile_schema(output_type(schema).model, limits or Limits(), allow_open=False)


@functools.lru_cache(maxsize=256)
def _typed_dict_type(schema: Any) -> OutputType:
    return OutputType(_typed_dict_model(schema), returns_dict=True)


def _typed_dict_model(schema: Any) -> type[BaseModel]:
    hints = typing.get_type_hints(schema, include_extras=True)
    required = getattr(schema, "__required_keys__", frozenset(hints))
    fields: dict[str, Any] = {}
    for name, hint in hints.items():
        annotation, default, description = _split_annotated(hint)
        if is_typeddict(annotation):
            annotation = _typed_dict_model(annotation)
        if default is ... and name not in required:
            default = None
        fields[name] = (annotation, pydantic.Field(default, description=description))
    doc = inspect.cleandoc(schema.__doc__) if schema.__doc__ else None
    return pydantic.create_model(schema.__name__, __doc__=doc, **fields)


def _split_annotated(hint: Any) -> tuple[Any, Any, str | None]:
    """LangChain's TypedDict convention: Annotated[type, default, "description"] (both optional)."""
    if typing.get_origin(hint) is not Annotated:
        return _strip_required(hint), ..., None
    base, *meta = typing.get_args(hint)
    kept = [m for m in meta if isinstance(m, PYDANTIC_METADATA)]
    plain = [m for m in meta if not any(m is k for k in kept)]
    description = plain.pop() if plain and isinstance(plain[-1], str) else None
    default: Any = plain[0] if plain else ...
    base = _strip_required(base)
    return (Annotated[(base, *kept)] if kept else base), default, description  # type: ignore[misc]


def _strip_required(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Required, typing.NotRequired):
        return typing.get_args(hint)[0]
    return hint


def _json_schema_model(schema: Mapping[str, Any]) -> type[BaseModel]:
    from json_schema_to_pydantic import create_model

    body = dict(schema)
    if "function" in body and isinstance(body["function"], Mapping):  # {"type": "function", ...}
        body = dict(body["function"])
    if "parameters" in body and "properties" not in body:  # a function / tool definition
        params = dict(body["parameters"])
        params.setdefault("title", body.get("name") or "Output")
        if body.get("description"):
            params.setdefault("description", body["description"])
        body = params
    if body.get("type", "object") != "object" or not isinstance(body.get("properties"), Mapping):
        raise UnsupportedSchemaError(
            "<root>", dict(schema), "a JSON schema must describe an object with 'properties'"
        )
    _check_meta_schema(body)
    try:
        return create_model(body)
    except Exception as error:  # the library raises its own error types for unsupported schema parts
        raise UnsupportedSchemaError("<root>", dict(schema), f"it could not be converted: {error}") from error


def _check_meta_schema(schema: Mapping[str, Any]) -> None:
    """UnsupportedSchemaError for a dict that is not a valid JSON Schema (checked against the meta-schema
    its `$schema` names, Draft 2020-12 by default), naming where it is invalid."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path) or "<root>"
        raise UnsupportedSchemaError(
            where, dict(schema), f"it is not a valid JSON Schema: {error.message}"
        ) from None
