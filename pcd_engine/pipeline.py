"""The structured pipeline: a schema's plan, then phases 1 to 4 of its requests, as public methods.

    plan                 the schema's cached SchemaPlan                           plan.py
    1. render            every input checked and rendered (or its error)          request.py
    2. score             the closed fields in packed passes, decisions made       scorer.py, decisions.py
    3. rescore           close calls again on the FP32 reference model            precision.py
    4. apply_calibration the call's calibration (or the batch's own), abstention  calibration.py

`PCDEngine` builds one and runs these phases, then fills each answer (phase 5, filling.py) and returns
one result per input (phase 6); fitting a calibration (`calibrate`), `score_fields` and
`suggest_labels` (learning.py) run phases 1 to 4 alone, on the same object.

    >>> plan = engine.pipeline.plan(Ticket)  # doctest: +SKIP
    >>> requests = engine.pipeline.render(plan, ["I was charged twice"])  # doctest: +SKIP
    >>> engine.pipeline.score(plan, requests)  # doctest: +SKIP
    >>> requests[0].fields["topic"].probabilities  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from typing_extensions import Unpack

from pcd_engine import fitting, gates, packing, precision, shortlist
from pcd_engine.calibration import Calibration, ModelIdentity, abstain, apply_all
from pcd_engine.calibration import model_identity as identity_of
from pcd_engine.decisions import decide, decide_field
from pcd_engine.errors import PCDError
from pcd_engine.hidden import HiddenCapture, HiddenStates
from pcd_engine.options import PlanOptions, refuse_unknown
from pcd_engine.output_types import output_type
from pcd_engine.plan import PlanCache, SchemaPlan
from pcd_engine.prompt import ChatPrompt
from pcd_engine.request import Request, elapsed_ms, example_turns, rendered
from pcd_engine.results import FieldResult
from pcd_engine.rules import Rule, get_rule
from pcd_engine.runner import Kept
from pcd_engine.schema import Limits, compile_schema
from pcd_engine.scorer import Scorer


class Pipeline:
    """The phases of a structured request on one model (see the module). `rule`, `instructions` and
    `allow_generation` are the defaults a plan takes when a call leaves them out."""

    def __init__(
        self,
        scorer: Scorer,
        rescorer: precision.FP32Rescorer | None,
        plans: PlanCache,
        limits: Limits,
        rule: Rule,
        instructions: str | None,
        allow_generation: bool,
        allow_empty_text: bool,
    ) -> None:
        self.scorer = scorer
        self.rescorer = rescorer
        self.plans = plans
        self.limits = limits
        self.rule = rule
        self.instructions = instructions
        self.allow_generation = allow_generation
        self.allow_empty_text = allow_empty_text

    @property
    def prompt(self) -> ChatPrompt:
        return self.scorer.prompt

    @property
    def precision(self) -> str:
        """How scores are computed: the weights' dtype, and FP32 re-scoring of close calls if any."""
        return precision.describe(self.scorer.runner.dtype, self.rescorer)

    @cached_property
    def model_identity(self) -> ModelIdentity:
        """What calibrations fitted here record and check (configuration, weight probe, precision)."""
        return identity_of(self.scorer.runner.model, self.precision)

    def plan(
        self, schema: Any, *, layout: str = "chat", shortlisted: bool = True, **options: Unpack[PlanOptions]
    ) -> SchemaPlan:
        """The cached SchemaPlan for a schema (compiled on first use; schema errors raise here).
        `examples` default to the model's `pcd_examples`; `layout` "raw" or "raw-value" plans for
        `RawPrompt` inputs; `shortlisted=False` scores every field on its whole tree."""
        refuse_unknown(options, PlanOptions, "plan options")
        model = output_type(schema).model
        compiled = compile_schema(model, self.limits, allow_open=True)
        allowed = options.get("allow_generation")
        if compiled.open_fields and not (self.allow_generation if allowed is None else allowed):
            raise compiled.open_fields[0].error()
        rule = options.get("rule")
        chosen = self.rule if rule is None else get_rule(rule)
        instructions = options.get("instructions")
        text = self.instructions if instructions is None else instructions
        examples = options.get("examples")
        shots = examples if examples is not None else getattr(model, "pcd_examples", None) or ()
        turns = example_turns(model, shots)
        return self.plans.get(compiled, chosen, text, turns, layout, shortlisted)

    def render(
        self,
        plan: SchemaPlan,
        texts: Sequence[Any],
        single: bool = False,
        return_exceptions: bool = False,
        numbers: Sequence[int] | None = None,
    ) -> list[Request | PCDError]:
        """Phase 1: a request per input, before any model work; a bad input raises its InputError,
        or with `return_exceptions` takes its place. `single`: errors do not name an index;
        `numbers`: the index each input has in the caller's batch (default: its position here)."""
        items: list[Request | PCDError] = []
        for index, text in enumerate(texts):
            try:
                where = None if single else (index if numbers is None else numbers[index])
                items.append(
                    Request.render(self.prompt, plan, text, self.limits, where, self.allow_empty_text)
                )
            except PCDError as error:
                if not return_exceptions:
                    raise
                items.append(error)
        return items

    def score(
        self,
        plan: SchemaPlan,
        requests: Sequence[Request | PCDError],
        keep_hidden: bool = False,
        calibration: Calibration | None = None,
        variants: Sequence[Calibration | None] = (),
        gated: bool = False,
    ) -> None:
        """Phase 2: every request's scored fields, its decisions made (priors subtracted where the
        rule corrects them), several requests per forward call; with `keep_hidden`, the hidden
        states a head reads, from the same calls. A shortlisted field's exact values are those its
        first pass ranks best, through `calibration` where the call has one (phase 4 applies it).
        With `variants`, each request's `variants` are its fields as a call with each of these
        calibrations would answer them (calibrated: phases 2 and 4), from the same forward calls:
        the second pass scores every variant's shortlist. With `gated`, a plan's gated decisions (a
        tool's arguments) are scored only where their gate holds, in a call after the first
        (gates.py), where nothing else reads them. Errors in `requests` are skipped."""
        live = rendered(requests)
        if not live:
            return
        began = time.perf_counter()
        stats = [r.stats for r in live]
        capture = None
        if keep_hidden and plan.trees:
            capture = [
                HiddenCapture(len(r.prompt.head), len(r.prompt.head) + len(r.prompt.text)) for r in live
            ]
        ids = [r.prompt.ids for r in live]
        gated = gated and bool(plan.gates) and not variants and self.rescorer is None
        kept: list[Kept] | None = [] if plan.shortlisted or gated else None  # for the later calls
        only = plan.first_trees if gated else None
        runs = self.scorer.score(plan, ids, stats, capture=capture, kept=kept, only=only)
        scored = time.perf_counter()
        wanted = any(dp.rule.corrects_prior for dp in plan.decisions)
        priors = self.scorer.priors(plan, stats[0]) if wanted else None
        for k, (request, logprobs) in enumerate(zip(live, runs, strict=True)):
            request.fields = decide(plan, gates.first_pass(plan, logprobs) if gated else logprobs, priors)
            if capture is not None:
                request.hidden = capture[k].states()
        first = [dict(r.fields) for r in live]  # what every shortlist is chosen by, calibrated or not
        rankings = [
            first
            if c is None or not plan.shortlisted
            else [apply_all(c.fields, f, r.hidden) for f, r in zip(first, live, strict=True)]
            for c in (calibration, *variants)
        ]
        fields = [r.fields for r in live]
        exact = self.scorer.finish_shortlists(plan, ids, fields, stats, priors, kept, rankings=rankings)
        if gated and kept is not None:
            self._finish_gates(plan, live, kept, priors, calibration, capture)
        for k, request in enumerate(live):
            request.timings["forward"] = (scored - began) * 1e3 / len(live)
            request.timings["score"] = elapsed_ms(scored) / len(live)
            request.variants = [
                _variant(plan, first[k], exact[k], ranking[k], c, request.hidden)
                for c, ranking in zip(variants, rankings[1:], strict=True)
            ]

    def _finish_gates(
        self,
        plan: SchemaPlan,
        live: Sequence[Request],
        kept: Sequence[Kept],
        priors: Sequence[Any] | None,
        calibration: Calibration | None,
        capture: Sequence[HiddenCapture] | None,
    ) -> None:
        """The gated pass (gates.py): each request's open gated decisions scored and decided, its
        fields in plan order without the closed ones, its `branch_tokens` the tree tokens it fed;
        with `capture`, its hidden states with the gated trees' fork states too."""
        opened = [gates.open_paths(plan, r.fields, calibration, r.hidden) for r in live]
        wanted = [gates.wanted_trees(plan, o) for o in opened]
        ids, stats = [r.prompt.ids for r in live], [r.stats for r in live]
        runs = self.scorer.finish_gates(plan, ids, stats, kept, wanted, capture)
        first = packing.fed_tokens([plan.trees[k] for k in plan.first_trees])
        for k, (request, scores, o, own) in enumerate(zip(live, runs, opened, wanted, strict=True)):
            if capture is not None:
                request.hidden = capture[k].states()
            request.branch_tokens = first + packing.fed_tokens([plan.trees[t] for t in own])
            for t, logprobs in scores.items():
                dp = plan.scored_decisions[t]
                prior = priors[t] if priors is not None else None
                request.fields[dp.decision.path] = decide_field(dp, logprobs, prior, dp.rule)
            request.fields = gates.in_plan_order(plan, request.fields, o)

    def rescore(self, plan: SchemaPlan, requests: Sequence[Request | PCDError]) -> None:
        """Phase 3: the close calls of every request scored again in FP32 (with a reference model)."""
        if self.rescorer is not None:
            for request in rendered(requests):
                self.rescorer.rescore(plan, request)

    def apply_calibration(
        self,
        plan: SchemaPlan,
        requests: Sequence[Request | PCDError],
        calibration: Calibration | None = None,
        *,
        batch: bool = False,
        abstain_below: float | None = None,
    ) -> None:
        """Phase 4: every request's fields through `calibration` (or, with `batch`, maps fitted on
        these requests' own scores), then marked abstained below `abstain_below`."""
        live = rendered(requests)
        maps = calibration.fields if calibration is not None else {}
        if batch and live:
            maps = fitting.batch_maps(plan, [r.fields for r in live])
        for request in live:
            request.fields = apply_all(maps, request.fields, request.hidden)
            if abstain_below is not None:
                request.fields = abstain(request.fields, abstain_below)


def _variant(
    plan: SchemaPlan,
    first: dict[str, FieldResult],
    exact: dict[str, dict[int, float]],
    ranking: dict[str, FieldResult],
    calibration: Calibration | None,
    hidden: HiddenStates | None,
) -> dict[str, FieldResult]:
    """One request's fields as a call with `calibration` answers them (phases 2 and 4), from its
    first pass and the second pass's exact scores."""
    fields = dict(first)
    for dp in plan.scored_decisions:
        path = dp.decision.path
        if path in exact:
            fields[path] = shortlist.completed(first[path], exact[path], ranking[path], dp.keep, dp.rule_name)
    return apply_all(calibration.fields, fields, hidden) if calibration is not None else fields
