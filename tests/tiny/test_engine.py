"""The engine end to end on a tiny random Llama (engine.py): results, batches, errors before model work.
The rules are in test_rules.py, the phases one by one in test_pipeline.py."""

from __future__ import annotations

import math
from typing import Literal

import pytest
from pydantic import BaseModel

from pcd_engine import (
    InputError,
    Limits,
    PCDEngine,
    PCDError,
    SchemaLimitError,
    UnsupportedSchemaError,
)
from tests.helpers import SupportTicket


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    return PCDEngine(tiny_model, tiny_tokenizer, rule="option")


def test_classify_returns_a_validated_instance_and_full_probabilities(engine):
    result = engine.classify("I was charged twice", SupportTicket)
    assert isinstance(result.value, SupportTicket)
    assert set(result.fields) == {"topic", "urgent", "priority", "channel"}
    for path, field in result.fields.items():
        assert math.isclose(sum(field.probabilities.values()), 1.0, abs_tol=1e-9)
        assert field.value == getattr(result.value, path)
        assert field.calibrated is False and field.source == "scored"
    topic = result.fields["topic"]
    assert set(topic.probabilities) == {"billing", "billing_dispute", "bug", "other"}
    assert topic.rule == "option"
    assert topic.value == max(topic.log_scores, key=topic.log_scores.__getitem__)
    others = [p for v, p in topic.probabilities.items() if v != topic.value]
    assert topic.margin == pytest.approx(topic.confidence - max(others))
    assert result.fields["channel"].rule == "fixed" and result.fields["channel"].confidence == 1.0
    d = result.diagnostics
    assert d.forward_calls == 2 and d.prompt_tokens > d.cached_tokens == 0
    assert d.branch_tokens > 0 and set(d.timings_ms) == {"render", "forward", "score", "total"}


def test_batch_keeps_every_input_and_checks_inputs_before_model_work(engine):
    texts = ["charged twice", 42, "x " * 5000, "crash"]
    with pytest.raises(InputError, match="text #1 must be a str"):
        engine.classify_batch(texts, SupportTicket)
    assert engine.prefix_cache.stats.misses == 0  # nothing reached the model
    seen = []
    results = engine.classify_batch(texts, SupportTicket, return_exceptions=True, progress=seen.append)
    assert len(results) == 4 and len(seen) == 4
    assert isinstance(results[1], InputError) and isinstance(results[2], InputError)
    assert "Limits.max_prompt_tokens" in str(results[2])
    assert isinstance(results[0].value, SupportTicket) and isinstance(results[3].value, SupportTicket)
    single = engine.classify("charged twice", SupportTicket)
    assert results[0].fields["topic"].log_scores == pytest.approx(single.fields["topic"].log_scores, abs=1e-4)


def test_schema_errors_come_before_any_model_work(engine):
    class Open(BaseModel):
        topic: Literal["a", "b"]
        summary: str

    with pytest.raises(UnsupportedSchemaError, match="'summary'"):
        engine.classify("text", Open, allow_generation=False)
    with pytest.raises(PCDError):
        engine.classify_batch(["a", "b"], Open, return_exceptions=True, allow_generation=False)
    strict = PCDEngine(engine.model, engine.tokenizer, allow_generation=False)
    with pytest.raises(UnsupportedSchemaError, match="free text is an open field"):
        strict.classify("text", Open)
    assert engine.prefix_cache.stats.misses == 0 and strict.prefix_cache.stats.misses == 0


def test_candidate_token_limit(tiny_model, tiny_tokenizer):
    class Long(BaseModel):
        kind: Literal["a very long label that takes many tokens to write out", "short"]

    engine = PCDEngine(tiny_model, tiny_tokenizer, limits=Limits(max_candidate_tokens=4))
    with pytest.raises(SchemaLimitError, match="max_candidate_tokens"):
        engine.classify("text", Long)


def test_bad_options_are_rejected_up_front(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="unknown rule 'best'"):
        PCDEngine(tiny_model, tiny_tokenizer, rule="best")
    with pytest.raises(ValueError, match="max_tokens_per_forward"):
        PCDEngine(tiny_model, tiny_tokenizer, max_tokens_per_forward=0)


@pytest.mark.parametrize("rule", ["option-cc", "greedy"])
def test_a_schema_of_single_value_fields_needs_no_forward_call(tiny_model, tiny_tokenizer, rule):
    class Fixed(BaseModel):
        channel: Literal["email"]
        version: Literal[2]

    engine = PCDEngine(tiny_model, tiny_tokenizer, rule=rule)
    result = engine.classify("text", Fixed)
    assert result.value == Fixed(channel="email", version=2)
    assert result.fields["channel"].rule == "fixed" and result.diagnostics.forward_calls == 0
    assert [r.value for r in engine.classify_batch(["a", "b"], Fixed)] == [result.value] * 2
