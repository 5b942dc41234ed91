"""Measure an engine (with or without a calibration) on labeled texts: what `pcd evaluate` reports.

Per scored field: accuracy, macro-F1, ECE, log-loss, the majority-answer floor (always answering the
field's most frequent label in these texts, so an optimistic floor), a confusion matrix, the
reliability bins and the coverage-accuracy curve. Over the whole object: the exact-match accuracy.
Every text gets an answer or counts as an error; nothing is dropped.

    >>> evaluation = evaluate(engine, Ticket, texts, labels)  # doctest: +SKIP
    >>> evaluation.summary["field_accuracy"]  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pcd_engine import metrics
from pcd_engine.calibration import Calibration
from pcd_engine.errors import CalibrationError, PCDError
from pcd_engine.fitting import decision_labels
from pcd_engine.learning import with_system
from pcd_engine.results import json_key


@dataclass
class FieldEvaluation:
    """One scored field over the answered texts that label it."""

    values: list[str]  # json_key of each allowed value
    labels: list[int] = field(default_factory=list)  # index of the true value
    probabilities: list[list[float]] = field(default_factory=list)  # the answer's probabilities
    texts: list[int] = field(default_factory=list)  # the index of the text each row comes from

    def report(self) -> dict[str, Any]:
        if not self.labels:
            return {"n": 0}
        out = metrics.field_report(self.probabilities, self.labels)
        out["majority"] = metrics.majority_floor(self.labels, self.labels)
        out["confusion"] = {
            "values": self.values,
            "counts": metrics.confusion(self.probabilities, self.labels, len(self.values)),
        }
        out["reliability"] = metrics.reliability(self.probabilities, self.labels)
        out["coverage_accuracy"] = metrics.coverage_accuracy(self.probabilities, self.labels)
        return out


@dataclass
class Evaluation:
    fields: dict[str, FieldEvaluation]
    texts: int
    errors: list[dict[str, Any]]  # {"index", "type", "message"} per text that got no answer
    exact: list[bool]  # per answered text: every labeled field right
    results: list[Any] = field(default_factory=list, repr=False)  # per text: its fields, or PCDError
    truth: list[dict[str, Any]] = field(default_factory=list, repr=False)  # per text: labeled values

    @classmethod
    def of(cls, values: dict[str, list[str]], results: list[Any], truth: list[dict[str, Any]]) -> Evaluation:
        """Compare per-text results (scored fields by path, or PCDError) with per-text true values by
        path; `values` lists each scored field's allowed values (json_key) in candidate order."""
        fields = {path: FieldEvaluation(list(v)) for path, v in values.items()}
        errors, exact = [], []
        for index, (result, known) in enumerate(zip(results, truth, strict=True)):
            if isinstance(result, PCDError):
                errors.append({"index": index, "type": type(result).__name__, "message": str(result)})
                continue
            right = True
            for path, f in fields.items():
                if path not in known:
                    continue
                scored = result[path]
                f.labels.append(f.values.index(json_key(known[path])))
                f.probabilities.append(list(scored.probabilities.values()))
                f.texts.append(index)
                right = right and json_key(scored.value) == json_key(known[path])
            exact.append(right)
        return cls(fields, len(results), errors, exact, results, truth)

    def recalibrated(self, calibration: Calibration) -> Evaluation:
        """The same answers with `calibration` applied to their fields (no model work): compare
        calibrations on one scoring pass. It must have been fitted for the same plan and model, and
        have no head (a head reads hidden states the results do not keep: evaluate with it)."""
        if calibration.needs_hidden:
            raise CalibrationError(
                "this calibration has heads, which read hidden states the answers do not keep; "
                "evaluate with calibration= instead"
            )
        results = [r if isinstance(r, PCDError) else calibration.apply(r) for r in self.results]
        return Evaluation.of({p: f.values for p, f in self.fields.items()}, results, self.truth)

    @property
    def summary(self) -> dict[str, Any]:
        reports = [f.report() for f in self.fields.values() if f.labels]
        mean = {k: sum(r[k] for r in reports) / len(reports) if reports else None for k in metrics.FIGURES}
        return {
            "texts": self.texts,
            "answered": self.texts - len(self.errors),
            "errors": len(self.errors),
            "exact_accuracy": sum(self.exact) / len(self.exact) if self.exact else None,
            **{f"field_{k}": v for k, v in mean.items()},
            "field_majority": sum(r["majority"] for r in reports) / len(reports) if reports else None,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary,
            "fields": {path: f.report() for path, f in self.fields.items()},
            "errors": self.errors,
        }


def evaluate(
    engine: Any,
    schema: Any,
    texts: Sequence[str],
    labels: Sequence[Any],
    *,
    progress: Callable[[int], None] | None = None,
    **options: Any,
) -> Evaluation:
    """Classify `texts` with `engine.classify_batch(..., **options)` and compare with `labels` (one
    object per text in the schema's JSON form; a field a label leaves out is not measured there).
    Label errors are raised before any model work."""
    plan, truth = _checked(engine, schema, texts, labels, options)
    results = engine.classify_batch(texts, schema, return_exceptions=True, progress=progress, **options)
    fields = [r if isinstance(r, PCDError) else r.fields for r in results]
    return Evaluation.of(_values(plan), fields, truth)


def evaluate_each(
    engine: Any,
    schema: Any,
    texts: Sequence[str],
    labels: Sequence[Any],
    calibrations: Mapping[str, Calibration | None],
    *,
    progress: Callable[[int], None] | None = None,
    **options: Any,
) -> dict[str, Evaluation]:
    """One Evaluation per named calibration (None: uncalibrated) of the same texts, each text scored
    once (`engine.score_variants`): every calibration's answers are those a call with it would
    give. Only the scored fields are measured, so no open field is generated. `options` are plan
    options (`instructions`, `rule`, `examples`); conversations' shared system text goes before the
    instructions, as in `calibrate`. Label errors are raised before any model work."""
    texts, options = with_system(texts, options)  # type: ignore[arg-type,assignment]
    plan, truth = _checked(engine, schema, texts, labels, options)
    names = list(calibrations)
    scored = engine.score_variants(plan, texts, [calibrations[n] for n in names], progress=progress)
    return {
        name: Evaluation.of(_values(plan), [s if isinstance(s, PCDError) else s[k] for s in scored], truth)
        for k, name in enumerate(names)
    }


def _checked(
    engine: Any, schema: Any, texts: Sequence[Any], labels: Sequence[Any], options: Mapping[str, Any]
) -> tuple[Any, list[dict[str, Any]]]:
    """(plan, per text its labeled values by path); CalibrationError for a label that does not fit."""
    if len(labels) != len(texts):
        raise CalibrationError(f"{len(texts)} texts but {len(labels)} labels")
    plan = engine.plan(
        schema,
        instructions=options.get("instructions"),
        rule=options.get("rule"),
        examples=options.get("examples"),
    )
    return plan, [decision_labels(plan.compiled, label, i) for i, label in enumerate(labels)]


def _values(plan: Any) -> dict[str, list[str]]:
    return {
        dp.decision.path: [json_key(c.value) for c in dp.decision.candidates] for dp in plan.scored_decisions
    }
