"""Open fields generated after the scored ones (filling.py) on a tiny Llama: scored values written into
the JSON, retries, budgets, batches with a poisoned input, token log-probabilities."""

from __future__ import annotations

import json
import math
from typing import Annotated, ClassVar, Literal, TypedDict

import pytest
from pydantic import BaseModel, Field, ValidationError, field_validator

from pcd_engine import (
    InputError,
    Limits,
    PCDEngine,
    StructuredOutputError,
    UnsupportedSchemaError,
)


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    return PCDEngine(tiny_model, tiny_tokenizer, rule="option")


class Small(BaseModel):
    topic: Literal["billing", "bug", "other"]
    summary: str = Field(max_length=16)
    urgent: bool


def test_mixed_model_scores_closed_fields_and_generation_never_changes_them(engine):
    for text in ["I was charged twice", "The app crashes", "hello"]:
        result = engine.classify(text, Small)
        assert isinstance(result.value, Small)
        for path in ("topic", "urgent"):
            field = result.fields[path]
            assert field.source == "scored"
            assert field.value == max(field.probabilities, key=field.probabilities.__getitem__)
            assert getattr(result.value, path) == field.value
            assert math.isclose(sum(field.probabilities.values()), 1.0, abs_tol=1e-9)
        summary = result.fields["summary"]
        assert summary.source == "generated" and summary.rule == "generated"
        assert summary.value == result.value.summary and summary.confidence is None
        assert len(result.value.summary) <= 16
        assert result.diagnostics.generated_tokens > 0 and result.diagnostics.attempts == 1


def test_scored_values_are_written_into_the_generated_json(engine):
    plan = engine.plan(Small)
    prompt = engine.prompt.with_head(plan.head, "text")
    job = engine.filler.job(plan, prompt.ids, {("topic",): "other", ("urgent",): False})
    assert job.forced == '{"topic": "other", "urgent": false, "summary":'
    (completion,) = engine.generator.run(
        [job.prompt], max_new_tokens=job.budget, sampling=engine.sampling, matchers=[job.matcher]
    )
    raw, value = engine.filler.parse(job, completion, Small)
    assert json.loads(raw)["topic"] == "other" and value.urgent is False


def test_generation_is_deterministic_under_greedy_decoding(engine):
    first = engine.classify("The app crashes when I log in", Small)
    second = engine.classify("The app crashes when I log in", Small)
    assert first.value == second.value


def test_retry_shows_the_validation_error_and_succeeds(engine):
    class Picky(BaseModel):
        calls: ClassVar[list[str]] = []
        topic: Literal["billing", "bug"]
        summary: str = Field(max_length=10)

        @field_validator("summary")
        @classmethod
        def reject_first(cls, value: str) -> str:
            cls.calls.append(value)
            if len(cls.calls) == 1:
                raise ValueError("summary must be rewritten")
            return value

    result = engine.classify("text", Picky)
    assert result.diagnostics.attempts == 2 and len(Picky.calls) == 2
    assert result.value.summary == Picky.calls[1]


def test_second_validation_failure_raises_structured_output_error(engine):
    class Never(BaseModel):
        summary: str = Field(max_length=10)

        @field_validator("summary")
        @classmethod
        def reject(cls, value: str) -> str:
            raise ValueError("never valid")

    with pytest.raises(StructuredOutputError) as caught:
        engine.classify("text", Never)
    assert caught.value.attempts == 2
    assert isinstance(caught.value.error, ValidationError) and "never valid" in str(caught.value.error)
    assert json.loads(caught.value.raw)["summary"] is not None


def test_budget_exhaustion_stops_generation(tiny_model, tiny_tokenizer):
    class Two(BaseModel):
        first: str
        second: str

    engine = PCDEngine(tiny_model, tiny_tokenizer, limits=Limits(max_generated_tokens=5))
    with pytest.raises(StructuredOutputError, match="whole budget of 5 tokens") as caught:
        engine.classify("text", Two)
    assert caught.value.raw.startswith('{"first":')


def test_allow_generation_false_refuses_open_fields(engine):
    with pytest.raises(UnsupportedSchemaError, match="'summary'"):
        engine.classify("text", Small, allow_generation=False)


def test_typed_dict_and_dict_schemas_return_dicts(engine):
    class Pick(TypedDict):
        topic: Literal["billing", "bug"]
        note: Annotated[str, Field(max_length=8)]

    result = engine.classify("text", Pick)
    assert isinstance(result.value, dict) and set(result.value) == {"topic", "note"}
    assert result.value["topic"] == result.fields["topic"].value
    schema = {"title": "Pick", "type": "object", "properties": {"topic": {"enum": ["billing", "bug"]}}}
    as_dict = engine.classify("text", schema)
    assert as_dict.value == {"topic": as_dict.fields["topic"].value}


def test_batch_of_16_with_a_poisoned_input_keeps_every_other_result(engine):
    texts: list = [f"ticket number {i}: the app crashes" for i in range(16)]
    texts[5] = 12345  # not a string
    results = engine.classify_batch(texts, Small, return_exceptions=True)
    assert len(results) == 16
    assert isinstance(results[5], InputError) and "text #5" in str(results[5])
    singles = {i: engine.classify(texts[i], Small).value for i in (0, 7, 15)}
    for i, result in enumerate(results):
        if i != 5:
            assert isinstance(result.value, Small)
    assert {i: results[i].value for i in singles} == singles  # padded batch == one by one (greedy)
    with pytest.raises(InputError):
        engine.classify_batch(texts, Small)


def test_open_model_without_closed_fields(engine):
    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int

    result = engine.classify("Anna is 31", Person)
    assert isinstance(result.value, Person) and result.fields["age"].source == "generated"
    assert result.diagnostics.branch_tokens == 0


def test_logprobs_cover_the_generated_json_tokens(engine, tiny_model):
    plain = engine.classify("The app crashes", Small)
    assert plain.token_logprobs is None
    result = engine.classify("The app crashes", Small, logprobs=2)
    assert result.value == plain.value
    tokens = result.token_logprobs
    assert tokens and len(tokens) == result.diagnostics.generated_tokens - 1  # the stop token is not one
    plan = engine.plan(Small)
    closed = {("topic",): result.value.topic, ("urgent",): result.value.urgent}
    forced = engine.filler.job(plan, [], closed).forced  # the scored values, written before generation
    assert json.loads(forced + "".join(t.token for t in tokens)) == result.value.model_dump()
    for token in tokens:
        assert token.logprob <= 0 and len(token.top) == 2 and token.top[0][1] >= token.top[1][1]
        assert token.top[0] == (token.token, pytest.approx(token.logprob, abs=1e-6))  # greedy
    batch = engine.classify_batch(["The app crashes", "hello"], Small, logprobs=2)
    assert [t.token for t in batch[0].token_logprobs] == [t.token for t in tokens]
    assert [t.logprob for t in batch[0].token_logprobs] == pytest.approx(
        [t.logprob for t in tokens], abs=1e-4
    )
    with pytest.raises(InputError, match="logprobs"):
        engine.classify("hello", Small, logprobs=99)
