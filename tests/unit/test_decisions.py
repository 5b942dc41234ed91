"""Per-field decisions on synthetic scores: no model, no tokenizer (a plan built on a character
encoding). Prior subtraction, rule override, fixed fields, margins, closed-answer validation."""

from __future__ import annotations

import math
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, model_validator

from pcd_engine import FieldResult, Limits, StructuredOutputError, compile_schema
from pcd_engine.decisions import closed_value, decide, decide_field, scored_values
from pcd_engine.plan import SchemaPlan, build_plan
from pcd_engine.rules import RULES, token_logprobs


class CharPrompt:
    """What `build_plan` needs of a ChatPrompt, with one token per character."""

    @staticmethod
    def encode_text(text: str) -> list[int]:
        return [ord(c) for c in text]

    def render_head(self, system: str, examples: tuple[tuple[str, str], ...] = ()) -> tuple[int, ...]:
        return tuple(self.encode_text(system + "".join(text + answer for text, answer in examples)))

    @staticmethod
    def framed_system(system: str) -> str:
        return system  # the "turn" framing adds nothing


class Ticket(BaseModel):
    topic: Literal["billing", "crash", "other"]  # distinct first characters: one token each
    urgent: bool
    channel: Literal["email"]

    @model_validator(mode="after")
    def crashes_are_never_urgent(self) -> Ticket:
        if self.topic == "crash" and self.urgent:
            raise ValueError("a crash report cannot be urgent")
        return self


def plan_for(rule: str) -> SchemaPlan:
    return build_plan(compile_schema(Ticket), CharPrompt(), RULES[rule], None, Limits())  # type: ignore[arg-type]


def scores_for(plan: SchemaPlan, wanted: dict[str, list[float]]) -> list[torch.Tensor]:
    """Per tree, log-probs whose candidates' token log-probs sum to `wanted[path]`: the whole amount
    sits on each continuation's first token, every later token has log-prob 0."""
    out = []
    for dp in plan.scored_decisions:
        tree = dp.tree
        assert tree is not None
        table = torch.full((len(tree.scored), len(tree.vocab)), -50.0)
        rows = {fed: row for row, fed in enumerate(tree.scored)}
        for path in tree.paths:  # every later step is certain
            for pred, token in path[1:]:
                table[rows[pred], tree.column[token]] = 0.0
        for (pred, token), value in zip((p[0] for p in tree.paths), wanted[dp.decision.path], strict=True):
            table[rows[pred], tree.column[token]] = value
        out.append(table)
    return out


def test_decide_scores_every_tree_and_fixes_single_value_fields():
    plan = plan_for("option")
    logprobs = scores_for(plan, {"topic": [-2.0, -0.5, -1.0], "urgent": [-0.1, -3.0]})
    fields = decide(plan, logprobs)
    assert list(fields) == ["topic", "urgent", "channel"]
    topic = fields["topic"]
    assert topic.value == "crash" and topic.rule == "option"
    assert topic.log_scores == pytest.approx({"billing": -2.0, "crash": -0.5, "other": -1.0})
    expected = torch.softmax(torch.tensor([-2.0, -0.5, -1.0], dtype=torch.float64), 0).tolist()
    assert list(topic.probabilities.values()) == pytest.approx(expected)
    assert topic.margin == pytest.approx(expected[1] - expected[2])
    assert fields["urgent"].value is True
    assert fields["channel"] == FieldResult("channel", "email", {"email": 1.0}, {"email": 0.0}, 1.0, "fixed")


def test_the_prior_is_subtracted_only_by_rules_that_correct_it():
    plan = plan_for("option-cc")
    logprobs = scores_for(plan, {"topic": [-1.0, -1.2, -3.0], "urgent": [-0.2, -2.0]})
    priors = scores_for(plan, {"topic": [-0.5, -2.0, -3.0], "urgent": [-0.1, -2.5]})
    corrected = decide(plan, logprobs, priors)
    assert corrected["topic"].rule == "option-cc"
    assert corrected["topic"].log_scores == pytest.approx({"billing": -0.5, "crash": 0.8, "other": 0.0})
    assert corrected["topic"].value == "crash"  # the model's prior for "billing" is removed
    assert corrected["urgent"].value is False  # -0.1 vs +0.5
    plain = decide(plan, logprobs, priors, rule=RULES["option"])  # the same scores, no correction
    assert plain["topic"].value == "billing" and plain["topic"].rule == "option"
    assert decide(plan, logprobs)["topic"].value == "billing"  # no priors given: nothing subtracted


def test_a_rule_override_applies_only_where_the_layout_matches():
    plan = plan_for("code")
    rules = {dp.decision.path: dp.rule.name for dp in plan.scored_decisions}
    assert rules == {"topic": "code", "urgent": "option"}  # bools have no codes: option layout
    logprobs = scores_for(plan, {"topic": [-0.1, -2.0, -3.0], "urgent": [-1.0, -0.5]})
    fields = decide(plan, logprobs, rule=RULES["option-mean"])  # reads the bools' whole trees
    assert fields["topic"].rule == "code" and fields["urgent"].rule == "option-mean"
    fields = decide(plan, logprobs, rule=RULES["greedy"])  # reads cut trees: not these
    assert fields["topic"].rule == "code" and fields["urgent"].rule == "option"


def test_decide_field_equals_the_rule_on_prior_corrected_scores():
    plan = plan_for("option-cc")
    dp = plan.scored_decisions[0]
    assert dp.tree is not None
    (logprobs,) = scores_for(plan, {"topic": [-1.0, -2.0, -4.0], "urgent": [0.0, 0.0]})[:1]
    (prior,) = scores_for(plan, {"topic": [-3.0, -1.0, -1.0], "urgent": [0.0, 0.0]})[:1]
    got = decide_field(dp, logprobs, prior, dp.rule)
    want = [float(t.sum()) for t in token_logprobs(dp.tree, logprobs - prior)]
    assert list(got.log_scores.values()) == pytest.approx(want)
    assert math.isclose(sum(got.probabilities.values()), 1.0)


def test_the_closed_answer_is_validated_by_the_model():
    plan = plan_for("option")
    fine = decide(plan, scores_for(plan, {"topic": [-0.1, -2.0, -3.0], "urgent": [-0.1, -2.0]}))
    assert closed_value(plan, fine) == Ticket(topic="billing", urgent=True, channel="email")
    rejected = decide(plan, scores_for(plan, {"topic": [-2.0, -0.1, -3.0], "urgent": [-0.1, -2.0]}))
    with pytest.raises(StructuredOutputError, match="scored values failed validation") as caught:
        closed_value(plan, rejected)
    assert '"topic": "crash"' in caught.value.raw and "cannot be urgent" in str(caught.value.error)


def test_scored_values_leave_generated_fields_out():
    fields = {
        "topic": FieldResult("topic", "crash", {"crash": 1.0}, {"crash": 0.0}, 1.0, "option"),
        "summary": FieldResult.generated("summary", "It crashes."),
    }
    assert scored_values(fields) == {"topic": "crash"}
