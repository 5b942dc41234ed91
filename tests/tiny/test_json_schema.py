"""The generation schema (json_schema.py): scored values pinned, strings and lists capped, a finite
token budget, dates and times bounded."""

from __future__ import annotations

import json
from datetime import datetime, time
from enum import Enum
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from pcd_engine import (
    Limits,
    PCDEngine,
    compile_schema,
)
from pcd_engine.json_schema import capped, model_schema, pinned_schema, token_budget


class Kind(str, Enum):
    BUG = "bug"
    BILLING = "billing"


class Shipping(BaseModel):
    method: Literal["air", "sea"]
    note: str = Field(max_length=12)


class Ticket(BaseModel):
    """A support ticket."""

    topic: Kind
    summary: str = Field(max_length=20, description="One line.")
    refund: bool
    priority: int = Field(ge=1, le=3)
    shipping: Shipping
    tags: list[str] = Field(default_factory=list, max_length=2)


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    return PCDEngine(tiny_model, tiny_tokenizer, rule="option")


def test_pinned_schema_fixes_scored_values_first_and_requires_them():
    compiled = compile_schema(Ticket, Limits(), allow_open=True)
    chosen = {"topic": "bug", "refund": True, "priority": 2, "shipping.method": "sea"}
    closed = compiled.closed_values(chosen)
    pinned = pinned_schema(model_schema(Ticket), closed, [f.json_keys for f in compiled.open_fields])
    assert list(pinned["properties"]) == ["topic", "refund", "priority", "summary", "shipping", "tags"]
    assert pinned["properties"]["topic"] == {"const": "bug"}
    assert pinned["required"] == ["topic", "refund", "priority", "summary", "shipping"]  # tags has a default
    shipping = pinned["properties"]["shipping"]  # a nested model with a scored leaf is inlined
    assert list(shipping["properties"]) == ["method", "note"] and shipping["properties"]["method"] == {
        "const": "sea"
    }
    assert shipping["required"] == ["method", "note"]


def test_capped_schema_bounds_every_string_and_list():
    schema = capped(model_schema(Ticket), max_string_length=50, max_items=3)
    props = schema["properties"]
    assert props["summary"]["maxLength"] == 20  # the model's own bound is kept
    assert props["tags"]["maxItems"] == 2 and props["tags"]["items"]["maxLength"] == 50
    assert schema["$defs"]["Shipping"]["properties"]["note"]["maxLength"] == 12
    assert "maxLength" not in schema["$defs"]["Kind"]  # an enum is not free text
    assert token_budget(schema) < token_budget(model_schema(Ticket))


def test_token_budget_is_finite_and_follows_max_length():
    schema = model_schema(Ticket)
    short = token_budget(schema, default_string_tokens=10)
    assert 0 < short < token_budget(schema, default_string_tokens=100)
    bounded = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 7}}}
    assert token_budget(bounded) == 2 + len('"s"') + 3 + 7 + 2


def test_datetime_and_time_texts_are_bounded_so_generation_always_ends(engine):
    """xgrammar's own date-time grammar allows any number of fraction digits (a model writing digits
    ran out of its budget); the capped schema stops at microseconds and budgets the longest text."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    class Meeting(BaseModel):
        when: datetime
        at: time | None

    schema = capped(model_schema(Meeting), 1000, 64)
    grammar = Grammar.from_json_schema(json.dumps(schema))
    for when, accepted in [
        ("2025-03-03T10:30:00Z", True),
        ("2025-03-03T10:30:00.123456+05:00", True),
        ("2025-03-03T10:30:00.1234567Z", False),
        ("2025-03-03T10:30:4999999Z", False),  # xgrammar read `(\.[0-9]{1,6})?` with an optional dot
        ("2025-13-03T10:30:00Z", False),
    ]:
        text = json.dumps({"when": when, "at": "10:30:00.5"}, separators=(",", ":"))
        assert _is_grammar_accept_string(grammar, text) is accepted, when
    assert token_budget(schema) < 100  # was over 500: two default-length strings
    result = engine.classify("Meet me on 3 March 2025 at 10:30", Meeting)
    assert isinstance(result.value.when, datetime)
