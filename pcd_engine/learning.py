"""What the engine learns from the user's texts: calibrations and heads fitted on them, their scored
fields and hidden states, and which texts to label next. `PCDEngine` inherits these methods; they run
the phases of its `pipeline` (pipeline.py, by composition), so this module does not import the engine.

    >>> cal = engine.calibrate(Ticket, texts, labels)  # doctest: +SKIP
    >>> engine.suggest_labels(Ticket, unlabeled, count=50).picked  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import Unpack

from pcd_engine import fitting
from pcd_engine.calibration import Calibration
from pcd_engine.conversation import Conversation, joined, system_texts
from pcd_engine.decisions import scored_values
from pcd_engine.errors import CalibrationError, InputError, PCDError
from pcd_engine.hidden import HiddenStates
from pcd_engine.options import PlanOptions
from pcd_engine.pipeline import Pipeline
from pcd_engine.plan import SchemaPlan
from pcd_engine.request import rendered
from pcd_engine.results import FieldResult
from pcd_engine.suggestions import LabelSuggestions, Suggestion, check_suggest, pick_uncertain


class LearningMixin:
    """`calibrate`, `score_fields` and `suggest_labels` of `PCDEngine`, on its `pipeline`."""

    pipeline: Pipeline

    def calibrate(
        self,
        schema: Any,
        texts: Sequence[str | Conversation],
        labels: Sequence[Any] | None = None,
        *,
        method: str = "auto",
        folds: int = 5,
        progress: Callable[[int], None] | None = None,
        fit_progress: Callable[[str], None] | None = None,
        **options: Unpack[PlanOptions],
    ) -> Calibration:
        """Fit a Calibration of the schema's scored fields on these texts (see calibration.py).

        With `labels` (one object per text, in the schema's JSON form or as instances; a field
        missing from a label is left out for that field) the maps are fitted per field and their
        report is cross-validated over `folds`; without labels, batch calibration. `method`:
        "auto" (per field, the best cross-validated method that does not lower accuracy), "head"
        (a linear head on the model's hidden states and the rule's scores), "bias",
        "temperature", "batch" or "none". Open fields are not generated. `progress(n)` is called as
        texts are scored, then `fit_progress(path)` as each field's fitting starts (with heads,
        the slow part). The plan options (`instructions`, `rule`, `examples`) must be those the
        calibration will be used with.
        """
        fitting.check_fit(method, labels is not None, folds)  # before any text is scored
        texts, options = with_system(texts, options)
        plan = self.pipeline.plan(schema, **options)
        if labels is not None:
            labels = list(labels)
            if len(labels) != len(texts):
                raise CalibrationError(f"{len(texts)} texts but {len(labels)} labels")
            for index, label in enumerate(labels):  # label errors before any model work
                fitting.decision_labels(plan.compiled, label, index)
        keep_hidden = labels is not None and method in ("auto", "head")
        scored = self.score_fields(plan, texts, hidden=keep_hidden, progress=progress)
        per_text = [None if isinstance(s, PCDError) else s[0] for s in scored]
        hidden = [None if isinstance(s, PCDError) else s[1] for s in scored] if keep_hidden else None
        identity = self.pipeline.model_identity
        return fitting.fit(
            plan, identity, per_text, labels, method, folds, hidden=hidden, progress=fit_progress
        )

    def score_fields(
        self,
        plan: SchemaPlan,
        texts: Sequence[Any],
        *,
        hidden: bool = False,
        calibration: Calibration | None = None,
        chunk: int = 32,
        progress: Callable[[int], None] | None = None,
    ) -> list[tuple[dict[str, FieldResult], HiddenStates | None] | PCDError]:
        """Per text, its scored fields (calibrated with `calibration` if given) and, with `hidden`,
        the hidden states a head reads; or the error it raised. No open field is generated. The
        texts go `chunk` at a time (`progress(n)` after each): what `calibrate`, `suggest_labels`
        and the label benchmarks build on."""
        if calibration is not None:
            calibration.check(plan, self.pipeline.model_identity)
        keep = hidden or (calibration is not None and calibration.needs_hidden)
        items = self.pipeline.render(plan, texts, return_exceptions=True)
        if progress is not None:  # inputs refused before any model work
            progress(sum(isinstance(item, PCDError) for item in items))
        requests = rendered(items)
        for start in range(0, len(requests), chunk):
            part = requests[start : start + chunk]
            self.pipeline.score(plan, part, keep, calibration)
            self.pipeline.rescore(plan, part)
            self.pipeline.apply_calibration(plan, part, calibration)
            if progress is not None:
                progress(len(part))
        return [item if isinstance(item, PCDError) else (item.fields, item.hidden) for item in items]

    def suggest_labels(
        self,
        schema: Any,
        texts: Sequence[str | Conversation],
        count: int = 50,
        *,
        by: str = "margin",
        calibration: Calibration | None = None,
        progress: Callable[[int], None] | None = None,
        **options: Unpack[PlanOptions],
    ) -> LabelSuggestions:
        """The `count` texts most worth labeling next: the least certain answers (`by` "margin" or
        "entropy", under `calibration` if given), spread over the predicted values (suggestions.py).
        Each comes with its current best guess as a label to correct; a text that cannot be scored
        is in `errors` by its index.

            >>> picked = engine.suggest_labels(Ticket, unlabeled, count=50).picked  # doctest: +SKIP
            >>> picked[0].text, picked[0].label  # doctest: +SKIP
        """
        check_suggest(count, by)  # before any text is scored
        texts, options = with_system(texts, options)
        plan = self.pipeline.plan(schema, **options)
        scored = self.score_fields(plan, texts, calibration=calibration, progress=progress)
        per_text = [None if isinstance(s, PCDError) else s[0] for s in scored]
        picked = []
        for u in pick_uncertain(per_text, count, by):
            fields = per_text[u.index]
            assert fields is not None
            label = plan.compiled.assemble(scored_values(fields))
            picked.append(Suggestion(texts[u.index], label, u.index, u.field, u.uncertainty))
        errors = {i: s for i, s in enumerate(scored) if isinstance(s, PCDError)}
        return LabelSuggestions(picked, errors)


def with_system(texts: Sequence[Any], options: PlanOptions) -> tuple[list[Any], PlanOptions]:
    """The texts as a list, and the plan options with the conversations' shared system text before
    the instructions (a calibration belongs to one prompt head). InputError for conversations with
    different system texts."""
    texts = list(texts)
    systems = set(system_texts(texts))
    if len(systems) > 1:
        raise InputError("the conversations have different system texts: calibrate (or suggest) each apart")
    (system,) = systems or {None}
    if system is None:
        return texts, options
    return texts, {**options, "instructions": joined(system, options.get("instructions"))}
