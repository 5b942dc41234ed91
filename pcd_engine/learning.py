"""What the engine learns from the user's texts: calibrations and heads fitted on them, their scored
fields and hidden states, and which texts to label next. `PCDEngine` inherits these methods; they use
only the pipeline's phases (`Pipeline`), so this module does not import the engine.

>>> cal = engine.calibrate(Ticket, texts, labels)  # doctest: +SKIP
>>> engine.suggest_labels(Ticket, unlabeled, count=50).picked  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pcd_engine import fitting
from pcd_engine.calibration import Calibration, ModelIdentity
from pcd_engine.decisions import scored_values
from pcd_engine.errors import CalibrationError, PCDError
from pcd_engine.hidden import HiddenStates
from pcd_engine.plan import SchemaPlan
from pcd_engine.prompt import ChatPrompt, Conversation
from pcd_engine.request import Request, RequestOptions, render_all
from pcd_engine.results import FieldResult
from pcd_engine.schema import Limits
from pcd_engine.scoring import Rule
from pcd_engine.suggestions import LabelSuggestions, Suggestion, pick_uncertain


class Pipeline(Protocol):
    """The parts of `PCDEngine` these methods use."""

    prompt: ChatPrompt
    limits: Limits
    allow_empty_text: bool

    @property
    def model_identity(self) -> ModelIdentity: ...

    def plan(
        self,
        schema: Any,
        *,
        instructions: str | None = None,
        rule: str | Rule | None = None,
        allow_generation: bool | None = None,
        examples: Sequence[tuple[str, Any]] | None = None,
    ) -> SchemaPlan: ...

    def score_fields(
        self,
        plan: SchemaPlan,
        texts: Sequence[Any],
        *,
        hidden: bool = False,
        calibration: Calibration | None = None,
        chunk: int = 32,
        progress: Callable[[int], None] | None = None,
    ) -> list[tuple[dict[str, FieldResult], HiddenStates | None] | PCDError]: ...

    def _score_and_rescore(
        self, plan: SchemaPlan, requests: Sequence[Request], keep_hidden: bool
    ) -> None: ...

    def _calibrate(self, plan: SchemaPlan, requests: Sequence[Request], options: RequestOptions) -> None: ...


class LearningMixin:
    """`calibrate`, `score_fields` and `suggest_labels` of `PCDEngine`."""

    def calibrate(
        self: Pipeline,
        schema: Any,
        texts: Sequence[str | Conversation],
        labels: Sequence[Any] | None = None,
        *,
        method: str = "auto",
        folds: int = 5,
        instructions: str | None = None,
        rule: str | Rule | None = None,
        examples: Sequence[tuple[str, Any]] | None = None,
        progress: Callable[[int], None] | None = None,
        fit_progress: Callable[[str], None] | None = None,
    ) -> Calibration:
        """Fit a Calibration of the schema's scored fields on these texts (see calibration.py).

        With `labels` (one object per text, in the schema's JSON form or as instances; a field
        missing from a label is left out for that field) the maps are fitted per field and their
        report is cross-validated over `folds`; without labels, batch calibration. `method`:
        "auto" (per field, the best cross-validated method that does not lower accuracy), "head"
        (a linear head on the model's hidden states and the rule's scores), "bias",
        "temperature", "batch" or "none". Open fields are not generated. `progress(n)` is called as
        texts are scored, then `fit_progress(path)` as each field's fitting starts (with heads,
        the slow part).
        """
        plan = self.plan(schema, instructions=instructions, rule=rule, examples=examples)
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
        identity = self.model_identity
        return fitting.fit(
            plan, identity, per_text, labels, method, folds, hidden=hidden, progress=fit_progress
        )

    def score_fields(
        self: Pipeline,
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
            calibration.check(plan, self.model_identity)
        keep = hidden or (calibration is not None and calibration.needs_hidden)
        items = render_all(self.prompt, plan, texts, self.limits, False, True, self.allow_empty_text)
        if progress is not None:  # inputs refused before any model work
            progress(sum(isinstance(item, PCDError) for item in items))
        requests = [item for item in items if isinstance(item, Request)]
        for start in range(0, len(requests), chunk):
            part = requests[start : start + chunk]
            self._score_and_rescore(plan, part, keep)
            self._calibrate(plan, part, RequestOptions(calibration=calibration))
            if progress is not None:
                progress(len(part))
        return [item if isinstance(item, PCDError) else (item.fields, item.hidden) for item in items]

    def suggest_labels(
        self: Pipeline,
        schema: Any,
        texts: Sequence[str],
        count: int = 50,
        *,
        by: str = "margin",
        calibration: Calibration | None = None,
        instructions: str | None = None,
        rule: str | Rule | None = None,
        examples: Sequence[tuple[str, Any]] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> LabelSuggestions:
        """The `count` texts most worth labeling next: the least certain answers (`by` "margin" or
        "entropy", under `calibration` if given), spread over the predicted values (suggestions.py).
        Each comes with its current best guess as a label to correct; a text that cannot be scored
        is in `errors` by its index.

        >>> picked = engine.suggest_labels(Ticket, unlabeled, count=50).picked  # doctest: +SKIP
        >>> picked[0].text, picked[0].label  # doctest: +SKIP
        """
        plan = self.plan(schema, instructions=instructions, rule=rule, examples=examples)
        texts = list(texts)
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
