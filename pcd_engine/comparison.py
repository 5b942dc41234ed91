"""Several scoring rules compared on one packed pass (`PCDEngine.compare_rules`).

Rules that read the same trees (codes or not, cut or not) share the pass, the priors and the text's
rendering; each then decides every field its own way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pcd_engine.decisions import decide
from pcd_engine.errors import PCDError
from pcd_engine.pipeline import Pipeline
from pcd_engine.plan import SchemaPlan
from pcd_engine.request import Request
from pcd_engine.results import PCDResult
from pcd_engine.rules import Rule


def compare_rules(
    pipeline: Pipeline, plan: SchemaPlan, text: str, rules: Sequence[Rule]
) -> dict[str, PCDResult[Any]]:
    """Per rule name, the result of `text` under that rule (the plan's trees read by every rule)."""
    started = time.perf_counter()
    (shared,) = pipeline.render(plan, [text], single=True)
    assert isinstance(shared, Request)
    scorer = pipeline.scorer
    normalized = [any(r.needs_normalizer for r in rules)] * len(plan.trees)
    (logprobs,) = scorer.score(plan, [shared.prompt.ids], [shared.stats], normalized=normalized)
    wanted = any(r.corrects_prior for r in rules)
    priors = scorer.priors(plan, shared.stats, normalized) if wanted else None
    out: dict[str, PCDResult[Any]] = {}
    for rule in rules:
        request = Request(text, shared.prompt, started, plan.branch_tokens, stats=shared.stats)
        request.fields = decide(plan, logprobs, priors, rule)
        request.validate_closed(plan)
        result = request.result(lambda value: value)
        if isinstance(result, PCDError):
            raise result
        out[rule.name] = result
    return out
