"""Schema compiler (schema.py): every supported closed type, closed and open fields split in
declaration order, every error, the limits."""

from __future__ import annotations

import enum
from enum import Enum
from typing import Annotated, Literal, Optional

import pytest
from pydantic import BaseModel, Field, conint

from pcd_engine import (
    Limits,
    SchemaLimitError,
    UnsupportedSchemaError,
    compile_schema,
)
from pcd_engine.errors import PCDError


class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


class Size(enum.IntEnum):
    S = 1
    M = 2


class Shipping(BaseModel):
    method: Literal["air", "sea"]
    insured: bool


class Everything(BaseModel):
    """A model with every closed type."""

    topic: Literal["billing", "bug"] = Field(description="What it is about.")
    urgent: bool
    numbers: Literal[1, 2, 3]
    flag: Literal[True, False]
    color: Color
    size: Size
    maybe: Optional[Literal["x", "y"]] = None  # noqa: UP045 (the typing.Optional spelling)
    maybe_pipe: Literal["p", "q"] | None = None
    priority: Annotated[int, Field(ge=1, le=5)]
    stars: conint(gt=0, lt=4)  # type: ignore[valid-type]
    shipping: Shipping
    tags: list[Literal["a", "b"]]
    colors: set[Color]
    fixed: Literal["only"]


def values(compiled, path):
    return [c.value for c in next(d for d in compiled.decisions if d.path == path).candidates]


def test_every_supported_type_compiles_to_its_candidates():
    compiled = compile_schema(Everything)
    assert compiled.description == "A model with every closed type."
    assert values(compiled, "topic") == ["billing", "bug"]
    assert values(compiled, "urgent") == [True, False]
    assert values(compiled, "numbers") == [1, 2, 3]
    assert values(compiled, "flag") == [True, False]
    assert values(compiled, "color") == ["red", "blue"]
    assert values(compiled, "size") == [1, 2]
    assert values(compiled, "maybe") == ["x", "y", None]
    assert values(compiled, "maybe_pipe") == ["p", "q", None]
    assert values(compiled, "priority") == [1, 2, 3, 4, 5]
    assert values(compiled, "stars") == [1, 2, 3]
    assert values(compiled, "shipping.method") == ["air", "sea"]
    assert values(compiled, "tags[a]") == [True, False]
    assert values(compiled, "colors[blue]") == [True, False]
    assert values(compiled, "fixed") == ["only"]
    topic = next(f for f in compiled.fields if f.path == "topic")
    assert topic.description == "What it is about."


def test_assemble_builds_nested_and_multilabel_values_that_validate():
    compiled = compile_schema(Everything)
    chosen = {d.path: d.candidates[-1].value for d in compiled.decisions}
    chosen["tags[a]"] = True
    chosen["colors[red]"] = True
    value = compiled.validate(chosen)
    assert value.shipping == Shipping(method="sea", insured=False)
    assert value.tags == ["a"]
    assert value.colors == {Color.RED}
    assert value.color is Color.BLUE
    assert value.size is Size.M
    assert value.maybe is None


def test_alias_is_the_json_key():
    class Aliased(BaseModel):
        kind: Literal["a", "b"] = Field(alias="Kind")

    compiled = compile_schema(Aliased)
    assert compiled.decisions[0].json_keys == ("Kind",)
    assert compiled.validate({"kind": "b"}).kind == "b"


@pytest.mark.parametrize(
    ("annotation", "reason"),
    [
        (str, "free text"),
        (int, "unbounded int"),
        (float, "float"),
        (dict[str, int], "dicts"),
        (list[str], "lists/sets of Literal"),
        (Literal["a"] | Literal[1] | str, "Optional"),
        (Optional[Shipping], "optional nested"),  # noqa: UP045
        (Literal[1.5, 2.5], "not str, int or bool"),
        (Annotated[int, Field(ge=1)], "both bounds"),
        (Annotated[int, Field(ge=5, le=1)], "allow no value"),
        (Literal[1, True], "compare equal"),
        (list[Literal[True, False]], "must be str or int"),
    ],
)
def test_unsupported_types_raise_with_path_type_reason_and_supported_list(annotation, reason):
    class Outer(BaseModel):
        ok: bool
        inner: annotation  # type: ignore[valid-type]

    with pytest.raises(UnsupportedSchemaError) as info:
        compile_schema(Outer)
    message = str(info.value)
    assert "'inner'" in message
    assert reason in message
    assert "Supported closed types" in message
    assert info.value.path == "inner"
    assert isinstance(info.value, PCDError)


def test_nested_unsupported_field_names_its_dotted_path():
    class Inner(BaseModel):
        note: str

    class Outer(BaseModel):
        inner: Inner

    with pytest.raises(UnsupportedSchemaError, match=r"'inner\.note'"):
        compile_schema(Outer)


def test_not_a_model_is_rejected():
    with pytest.raises(UnsupportedSchemaError, match="BaseModel"):
        compile_schema(dict)  # type: ignore[arg-type]


def test_limits_on_fields_and_candidates():
    class Many(BaseModel):
        a: bool
        b: bool
        c: bool

    with pytest.raises(SchemaLimitError, match=r"3 scored fields exceeds the limit of 2") as info:
        compile_schema(Many, Limits(max_fields=2))
    assert isinstance(info.value, PCDError)
    compile_schema(Many, Limits(max_fields=3))

    class Wide(BaseModel):
        n: Annotated[int, Field(ge=0, le=10**9)]

    with pytest.raises(SchemaLimitError, match=r"field 'n'.*max_candidates"):
        compile_schema(Wide)

    class Tags(BaseModel):
        tags: list[Literal["a", "b", "c"]]

    with pytest.raises(SchemaLimitError, match="scored fields"):
        compile_schema(Tags, Limits(max_fields=2))


def test_limits_reject_nonsense_values():
    with pytest.raises(ValueError, match="max_fields"):
        Limits(max_fields=0)


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "object", "properties": {"a": {"type": "nonsense"}}}, "properties/a/type"),
        ({"type": "object", "properties": {"a": {"enum": "x"}}}, "properties/a/enum"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"}, "required"),
        (
            {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 3}}}},
            "properties/a/type",
        ),
    ],
)
def test_json_schema_dicts_are_checked_against_the_meta_schema(schema, where):
    from pcd_engine import output_type

    with pytest.raises(UnsupportedSchemaError, match="not a valid JSON Schema") as caught:
        output_type(schema)
    assert caught.value.path == where


class ShippingNote(BaseModel):
    method: Literal["air", "sea"]
    note: str = Field(max_length=12)


class Kind(str, Enum):
    BUG = "bug"
    BILLING = "billing"


class Ticket(BaseModel):
    """A support ticket."""

    topic: Kind
    summary: str = Field(max_length=20, description="One line.")
    refund: bool
    priority: int = Field(ge=1, le=3)
    shipping: ShippingNote
    tags: list[str] = Field(default_factory=list, max_length=2)


def test_compiler_splits_closed_and_open_fields_in_declaration_order():
    compiled = compile_schema(Ticket, Limits(), allow_open=True)
    assert [f.path for f in compiled.fields] == ["topic", "refund", "priority", "shipping.method"]
    assert [f.path for f in compiled.open_fields] == ["summary", "shipping.note", "tags"]
    assert compiled.order == (
        "topic",
        "summary",
        "refund",
        "priority",
        "shipping.method",
        "shipping.note",
        "tags",
    )
    assert "free text" in compiled.open_fields[0].reason
    with pytest.raises(UnsupportedSchemaError, match=r"'summary'.*free text"):
        compile_schema(Ticket)  # allow_open defaults to False


def test_a_bounded_int_too_wide_to_score_is_generated():
    class Order(BaseModel):
        quantity: int = Field(ge=0, le=10_000)
        gift: bool

    compiled = compile_schema(Order, Limits(), allow_open=True)
    assert [f.path for f in compiled.open_fields] == ["quantity"]
    assert "max_candidates" in compiled.open_fields[0].reason
