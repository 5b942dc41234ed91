"""Pydantic model -> CompiledSchema: the closed fields and their candidate values, the open fields.

A closed field (Literal, bool, Enum, bounded int, Optional of those, list/set of Literal) is scored;
any other leaf is open and is generated (constrained AR) when `allow_open=True`. Compilation is pure
(no tokenizer, no model) and cached per (schema, limits, allow_open). With `allow_open=False` the first
open field raises `UnsupportedSchemaError` here, before any model work.

    >>> from typing import Literal
    >>> from pydantic import BaseModel
    >>> class Ticket(BaseModel):
    ...     topic: Literal["billing", "bug"]
    ...     urgent: bool
    >>> [d.path for d in compile_schema(Ticket).decisions]
    ['topic', 'urgent']
"""

from __future__ import annotations

import enum
import functools
import inspect
import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pcd_engine.errors import SchemaLimitError, UnsupportedSchemaError

JSONScalar = str | int | bool | None


@dataclass(frozen=True)
class Limits:
    """Bounds checked at compile time (schema) and per request (prompt)."""

    max_fields: int = 32
    max_candidates: int = 256
    max_prompt_tokens: int = 4096
    max_candidate_tokens: int = 64
    max_generated_tokens: int = 4096  # cap on the schema-derived token budget of a generation
    max_string_length: int = 1000  # characters of a generated string whose schema sets no max_length
    max_list_items: int = 64  # items of a generated list whose schema sets no max_length

    def __post_init__(self) -> None:
        for name in (
            "max_fields",
            "max_candidates",
            "max_prompt_tokens",
            "max_candidate_tokens",
            "max_generated_tokens",
            "max_string_length",
            "max_list_items",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Candidate:
    """One allowed value, as it appears in the JSON object."""

    value: JSONScalar

    @property
    def json(self) -> str:
        return json.dumps(self.value, ensure_ascii=False)


@dataclass(frozen=True)
class ClosedField:
    """One leaf field of the user's model whose allowed values are a closed set."""

    path: str  # dotted path from the root model, e.g. "shipping.method"
    json_keys: tuple[str, ...]  # JSON keys from the root to this field
    description: str | None
    candidates: tuple[Candidate, ...]
    multi_label: bool = False  # list[Literal]/set[Literal]: one yes/no decision per option
    container: type = list


@dataclass(frozen=True)
class OpenField:
    """A leaf field that cannot be scored: its value is generated under the model's JSON schema."""

    path: str
    json_keys: tuple[str, ...]
    description: str | None
    annotation: Any
    reason: str  # why it is not a closed choice

    def error(self) -> UnsupportedSchemaError:
        return UnsupportedSchemaError(self.path, self.annotation, self.reason)


@dataclass(frozen=True)
class Decision:
    """One scored choice. A plain field is one decision; a multi-label field is one per option."""

    path: str  # "topic", "shipping.method", "tags[billing]"
    json_keys: tuple[str, ...]  # keys of the one-field JSON object the branch writes
    candidates: tuple[Candidate, ...]
    field_index: int  # index into CompiledSchema.fields
    option: JSONScalar = None  # the multi-label option this decision is about


YES_NO = (Candidate(True), Candidate(False))


@dataclass(frozen=True)
class CompiledSchema:
    """Immutable result of compiling a Pydantic model: fields, decisions and how to assemble them."""

    schema: type[BaseModel]
    description: str | None
    fields: tuple[ClosedField, ...]  # the closed (scored) fields
    open_fields: tuple[OpenField, ...] = ()  # the generated fields
    order: tuple[str, ...] = ()  # dotted paths of all leaves, closed and open, in declaration order
    decisions: tuple[Decision, ...] = field(init=False)

    def __post_init__(self) -> None:
        decisions: list[Decision] = []
        for index, f in enumerate(self.fields):
            if not f.multi_label:
                decisions.append(Decision(f.path, f.json_keys, f.candidates, index))
                continue
            for c in f.candidates:
                key = c.value if isinstance(c.value, str) else c.json
                decisions.append(Decision(f"{f.path}[{key}]", (*f.json_keys, key), YES_NO, index, c.value))
        object.__setattr__(self, "decisions", tuple(decisions))

    def assemble(self, chosen: Mapping[str, JSONScalar]) -> dict[str, Any]:
        """Nest the chosen value of every decision (by path) into the model's JSON object. A field
        with a decision not made is left out (a tool's arguments where another tool was chosen:
        plan.gates); a group so emptied takes its default."""
        data: dict[str, Any] = {}
        for f in self.fields:
            if f.multi_label:
                members = [d for d in self.decisions if self.fields[d.field_index] is f]
                if any(d.path not in chosen for d in members):
                    continue
                value: Any = [d.option for d in members if chosen[d.path] is True]
            elif f.path not in chosen:
                continue
            else:
                value = chosen[f.path]
            node = data
            for key in f.json_keys[:-1]:
                node = node.setdefault(key, {})
            node[f.json_keys[-1]] = value
        return data

    def validate(self, chosen: Mapping[str, JSONScalar]) -> BaseModel:
        return self.schema.model_validate(self.assemble(chosen))

    def closed_values(self, chosen: Mapping[str, JSONScalar]) -> dict[tuple[str, ...], Any]:
        """The value of every closed field (multi-label ones as lists), keyed by JSON key path."""
        data = self.assemble(chosen)
        out: dict[tuple[str, ...], Any] = {}
        for f in self.fields:
            node: Any = data
            for key in f.json_keys:
                node = node[key]
            out[f.json_keys] = node
        return out


@functools.lru_cache(maxsize=256)
def compile_schema(
    schema: type[BaseModel], limits: Limits = Limits(), allow_open: bool = False
) -> CompiledSchema:
    """Compile a Pydantic model into closed (scored) and open (generated) fields.

    With `allow_open=False` every leaf must be a closed choice. Raises before any model work.
    """
    if not (inspect.isclass(schema) and issubclass(schema, BaseModel)):
        raise UnsupportedSchemaError("<root>", schema, "the schema must be a pydantic.BaseModel subclass")
    leaves = _compile_model(schema, (), (), limits, allow_open)
    if not leaves:
        raise UnsupportedSchemaError(schema.__name__, schema, "the model has no fields")
    open_fields = tuple(f for f in leaves if isinstance(f, OpenField))
    if open_fields and not allow_open:
        raise open_fields[0].error()
    fields = tuple(f for f in leaves if isinstance(f, ClosedField))
    order = tuple(f.path for f in leaves)
    compiled = CompiledSchema(schema, _docstring(schema), fields, open_fields, order)
    n = len(compiled.decisions)
    if n > limits.max_fields:
        raise SchemaLimitError("scored fields", n, limits.max_fields, schema.__name__, "max_fields")
    return compiled


def _docstring(schema: type[BaseModel]) -> str | None:
    doc = schema.__dict__.get("__doc__")
    return inspect.cleandoc(doc) if doc else None


def _compile_model(
    model: type[BaseModel], path: tuple[str, ...], keys: tuple[str, ...], limits: Limits, allow_open: bool
) -> list[ClosedField | OpenField]:
    out: list[ClosedField | OpenField] = []
    for name, info in model.model_fields.items():
        key = info.alias if isinstance(info.alias, str) else name
        field_path, field_keys = (*path, name), (*keys, key)
        annotation = _annotated(info)
        nested = _nested_model(annotation)
        if nested is not None:
            out.extend(_compile_model(nested, field_path, field_keys, limits, allow_open))
            continue
        dotted = ".".join(field_path)
        try:
            out.append(_closed_field(dotted, field_keys, info, annotation, limits))
        except UnsupportedSchemaError as error:  # not a closed choice: generated when allowed
            out.append(OpenField(dotted, field_keys, info.description, annotation, error.reason))
        except SchemaLimitError as error:  # a bounded int too wide to score is generated instead
            if not (allow_open and _base_type(annotation) is int):
                raise
            out.append(OpenField(dotted, field_keys, info.description, annotation, str(error)))
    return out


def _closed_field(
    path: str, keys: tuple[str, ...], info: FieldInfo, annotation: Any, limits: Limits
) -> ClosedField:
    multi = _multi_label(path, annotation, limits)
    if multi is not None:
        container, candidates = multi
        return ClosedField(path, keys, info.description, candidates, True, container)
    return ClosedField(path, keys, info.description, _candidates(path, annotation, limits))


def _annotated(info: FieldInfo) -> Any:
    """The field's annotation with its pydantic metadata (bounds) folded back in as Annotated."""
    if info.metadata:
        return Annotated[(info.annotation, *info.metadata)]  # type: ignore[misc]
    return info.annotation


def _base_type(annotation: Any) -> Any:
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _multi_label(path: str, annotation: Any, limits: Limits) -> tuple[type, tuple[Candidate, ...]] | None:
    origin = typing.get_origin(annotation)
    if origin not in (list, set, frozenset):
        return None
    (item,) = typing.get_args(annotation) or (Any,)
    item_origin = typing.get_origin(item)
    is_closed = item_origin is Literal or (inspect.isclass(item) and issubclass(item, enum.Enum))
    if not is_closed:
        raise UnsupportedSchemaError(
            path,
            annotation,
            "only lists/sets of Literal or Enum values are closed (multi-label); "
            "other lists are open fields, generated rather than scored",
        )
    candidates = _candidates(path, item, limits)
    if any(isinstance(c.value, bool) or c.value is None for c in candidates):
        raise UnsupportedSchemaError(path, annotation, "multi-label options must be str or int")
    return origin, candidates


def _candidates(path: str, annotation: Any, limits: Limits) -> tuple[Candidate, ...]:
    values = _closed_values(path, annotation)
    if len(values) > limits.max_candidates:
        raise SchemaLimitError(
            "candidates", len(values), limits.max_candidates, f"field {path!r}", "max_candidates"
        )
    unique = list(dict.fromkeys((isinstance(v, bool), v) for v in values))
    ints = {v for is_bool, v in unique if not is_bool and isinstance(v, int)}
    if any(is_bool and int(v) in ints for is_bool, v in unique):  # type: ignore[arg-type]
        raise UnsupportedSchemaError(path, annotation, "it mixes values that compare equal (1/True)")
    if not unique:
        raise UnsupportedSchemaError(path, annotation, "it allows no value")
    return tuple(Candidate(v) for _, v in unique)


def _closed_values(path: str, annotation: Any) -> Sequence[JSONScalar]:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Annotated:
        return _annotated_values(path, annotation, args[0], args[1:])
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) != 1 or len(members) == len(args):
            raise UnsupportedSchemaError(
                path, annotation, "unions are supported only as Optional[<closed type>]"
            )
        if _nested_model(members[0]) is not None:
            reason = "an optional nested model is an open field (generated, not scored)"
            raise UnsupportedSchemaError(path, annotation, reason)
        return [*_closed_values(path, members[0]), None]
    if origin is Literal:
        return [_literal_value(path, annotation, a) for a in args]
    if annotation is bool:
        return [True, False]
    if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
        return [_enum_value(path, annotation, m) for m in annotation]
    if annotation is type(None):
        return [None]
    reason = _open_reason(annotation)
    raise UnsupportedSchemaError(path, annotation, reason)


def _annotated_values(
    path: str, annotation: Any, base: Any, metadata: tuple[Any, ...]
) -> Sequence[JSONScalar]:
    if base is not int:
        return _closed_values(path, base)
    low, high = None, None
    for m in _flatten_metadata(metadata):
        if isinstance(m, annotated_types.Ge):
            low = int(m.ge)  # type: ignore[call-overload]
        elif isinstance(m, annotated_types.Gt):
            low = int(m.gt) + 1  # type: ignore[call-overload]
        elif isinstance(m, annotated_types.Le):
            high = int(m.le)  # type: ignore[call-overload]
        elif isinstance(m, annotated_types.Lt):
            high = int(m.lt) - 1  # type: ignore[call-overload]
    if low is None or high is None:
        raise UnsupportedSchemaError(
            path,
            annotation,
            "an int is closed only with both bounds, e.g. Annotated[int, Field(ge=1, le=5)]",
        )
    if high < low:
        raise UnsupportedSchemaError(path, annotation, f"its bounds allow no value ({low}..{high})")
    return range(low, high + 1)  # materialised only after the candidate limit is checked


def _flatten_metadata(metadata: tuple[Any, ...]) -> list[Any]:
    out: list[Any] = []
    for m in metadata:
        if isinstance(m, FieldInfo):
            out.extend(m.metadata)
        elif isinstance(m, annotated_types.Interval):
            out.extend(iter(m))
        else:
            out.append(m)
    return out


def _literal_value(path: str, annotation: Any, value: Any) -> JSONScalar:
    if isinstance(value, enum.Enum):
        return _enum_value(path, annotation, value)
    if value is None or isinstance(value, (str, int)):
        return value  # bool is an int
    raise UnsupportedSchemaError(path, annotation, f"Literal value {value!r} is not str, int or bool")


def _enum_value(path: str, annotation: Any, member: enum.Enum) -> JSONScalar:
    value = member.value
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return value
    raise UnsupportedSchemaError(path, annotation, f"Enum value {value!r} is not str or int")


def _open_reason(annotation: Any) -> str:
    if annotation is str:
        return "free text is an open field (it needs generation, not scoring)"
    if annotation is int:
        return "an unbounded int is open; bound it, e.g. Annotated[int, Field(ge=1, le=5)]"
    if annotation is float:
        return "a float is an open field (it needs generation, not scoring)"
    if typing.get_origin(annotation) in (dict, tuple) or annotation in (dict, tuple, list, set):
        return "dicts, tuples and untyped containers are open fields"
    return "it is not a closed choice"
