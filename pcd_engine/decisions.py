"""Per-field decisions: from a tree's scores to a `FieldResult`, and from the results to the answer.

    scores -> minus the content-free prior (rules that correct it) -> rule -> probabilities, choice,
    margin -> FieldResult;   every scored value -> the schema's validated instance

This is the only place a prior is subtracted from scores.

    >>> fields = decide(plan, scorer.score(plan, [ids], [stats])[0], priors)  # doctest: +SKIP
    >>> closed_value(plan, fields)  # doctest: +SKIP
    Ticket(topic='billing', urgent=True)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import torch
from pydantic import BaseModel, ValidationError

from pcd_engine.errors import StructuredOutputError
from pcd_engine.plan import DecisionPlan, SchemaPlan
from pcd_engine.results import FieldResult
from pcd_engine.rules import Rule, tree_shape
from pcd_engine.schema import JSONScalar


def decide(
    plan: SchemaPlan,
    logprobs: Sequence[torch.Tensor | None],
    priors: Sequence[torch.Tensor] | None = None,
    rule: Rule | None = None,
) -> dict[str, FieldResult]:
    """Every decision's FieldResult, keyed by path in plan order. `logprobs` (and `priors`) hold one
    entry per tree (None: a gated tree not scored, whose decision is left out); `rule` replaces each
    decision's own rule where both use the same tree shape (codes or not, cut at the distinguishing
    token or not)."""
    no_priors: list[torch.Tensor | None] = [None] * len(logprobs)
    per_tree = iter(zip(logprobs, priors or no_priors, strict=True))
    fields: dict[str, FieldResult] = {}
    for dp in plan.decisions:
        if dp.tree is None:
            fields[dp.decision.path] = fixed_field(dp)
            continue
        used = dp.rule if rule is None or tree_shape(dp.rule) != tree_shape(rule) else rule
        scores, prior = next(per_tree)
        if scores is not None:
            fields[dp.decision.path] = decide_field(dp, scores, prior, used)
    return fields


def decide_field(
    dp: DecisionPlan, logprobs: torch.Tensor, prior: torch.Tensor | None, rule: Rule
) -> FieldResult:
    """One scored decision under `rule`, after subtracting `prior` if the rule corrects it."""
    assert dp.tree is not None
    if rule.corrects_prior and prior is not None:
        if dp.whole is not None:  # a shortlist's first pass: the whole tree's prior, cut
            rows, columns = dp.first_rows
            prior = prior[rows][:, columns]
        logprobs = logprobs - prior
    values = [c.value for c in dp.decision.candidates]
    return FieldResult.scored(dp.decision.path, values, rule.score(dp.tree, logprobs), rule.name)


def fixed_field(dp: DecisionPlan) -> FieldResult:
    """A decision with a single allowed value: nothing to score."""
    value = dp.decision.candidates[0].value
    return FieldResult(dp.decision.path, value, {value: 1.0}, {value: 0.0}, 1.0, "fixed")


def scored_values(fields: Mapping[str, FieldResult]) -> dict[str, JSONScalar]:
    """The chosen value of every scored field, by path."""
    return {path: f.value for path, f in fields.items() if f.source == "scored"}


def closed_value(plan: SchemaPlan, fields: Mapping[str, FieldResult]) -> BaseModel:
    """The schema's instance made of the scored values; StructuredOutputError if it fails validation
    (a model validator may reject a combination of allowed values)."""
    chosen = scored_values(fields)
    try:
        return plan.compiled.validate(chosen)
    except ValidationError as error:
        raw = json.dumps(plan.compiled.assemble(chosen), ensure_ascii=False)
        raise StructuredOutputError("the scored values failed validation", raw, error) from None
