"""A schema's plan (plan.py): labeled examples rendered into the cached head, with codes under the
code rule, and the plain wording's field lines."""

from __future__ import annotations

import json

import pytest

from pcd_engine import PCDEngine
from tests.helpers import LABELED, LABELED_TEXTS, Tagged, Ticket

TEXTS, LABELS = LABELED_TEXTS[:6], LABELED[:6]


def test_examples_sit_in_the_cached_head_and_cost_nothing_after_the_first_call(engine):
    examples = [(TEXTS[0], LABELS[0]), (TEXTS[1], Ticket(**LABELS[1]))]
    plan = engine.plan(Ticket, examples=examples)
    bare = engine.plan(Ticket)
    assert plan.head != bare.head and plan.fingerprint != bare.fingerprint
    # the head is exactly the chat template's rendering of the examples as earlier turns
    answer = json.dumps(LABELS[0])
    turns = [("system", plan.system), ("user", TEXTS[0]), ("assistant", answer)]
    turns += [("user", TEXTS[1]), ("assistant", json.dumps(LABELS[1])), ("user", "TEXT")]
    whole = engine.prompt.render_messages(turns)
    assert whole == [*plan.head, *engine.prompt.encode_text("TEXT"), *engine.prompt.tail]
    first = engine.classify(TEXTS[2], Ticket, examples=examples)
    second = engine.classify(TEXTS[3], Ticket, examples=examples)
    assert second.diagnostics.prefix_cache_hit
    assert second.diagnostics.cached_tokens >= len(plan.head)
    assert second.diagnostics.forward_calls == 1
    assert first.fields["topic"].log_scores != engine.classify(TEXTS[2], Ticket).fields["topic"].log_scores


def test_a_schema_can_carry_default_examples_and_bad_examples_are_input_errors(engine):
    from typing import ClassVar

    from pcd_engine import InputError

    class WithExamples(Ticket):
        pcd_examples: ClassVar[list[tuple[str, dict]]] = [(TEXTS[0], LABELS[0])]

    assert engine.plan(WithExamples).examples == ((TEXTS[0], json.dumps(LABELS[0])),)
    assert engine.plan(WithExamples, examples=[]).examples == ()
    with pytest.raises(InputError, match=r"example #0: the answer is not a valid Ticket"):
        engine.classify(TEXTS[0], Ticket, examples=[(TEXTS[0], {"topic": "nope", "urgent": True})])
    with pytest.raises(InputError, match="example #1 must be a"):
        engine.classify(TEXTS[0], Ticket, examples=[(TEXTS[0], LABELS[0]), "just text"])


def test_code_rule_examples_answer_with_codes(engine):
    plan = engine.plan(Ticket, rule="code", examples=[(TEXTS[0], LABELS[0])])
    assert plan.examples == ((TEXTS[0], '{"topic": "A", "urgent": true}'),)
    decoded = engine.tokenizer.decode(list(plan.head))
    assert '{"topic": "A", "urgent": true}' in decoded


def test_the_plain_wording_writes_field_lines_and_scores_labels_after_a_space(tiny_model, tiny_tokenizer):
    plain = PCDEngine(tiny_model, tiny_tokenizer, branch_wording="plain")
    plan = plain.plan(Tagged, examples=[(TEXTS[0], {"topic": "billing", "tags": ["refund"]})])
    decode = tiny_tokenizer.decode
    topic = plan.trees[0]
    assert [decode(list(topic.continuation(c))) for c in range(3)] == [" billing\n", " crash\n", " other\n"]
    assert plan.examples[0][1] == "topic: billing\ntags.refund: true\ntags.bug: false"
    assert "field: value" in plan.system
    json_plan = PCDEngine(tiny_model, tiny_tokenizer).plan(Tagged)
    assert decode(list(json_plan.trees[0].continuation(0))) == 'billing"}'  # the quote joins the prefix
    assert plan.fingerprint != json_plan.fingerprint
    result = plain.classify(TEXTS[0], Tagged)
    assert set(result.fields) == {"topic", "tags[refund]", "tags[bug]"}
    with pytest.raises(ValueError, match="unknown branch wording"):
        PCDEngine(tiny_model, tiny_tokenizer, branch_wording="yaml")
