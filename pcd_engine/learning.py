"""What the engine learns from the user's texts: calibrations and heads fitted on them, their scored
fields and hidden states, and which texts to label next. `PCDEngine` inherits these methods; they run
the phases of its `pipeline` (pipeline.py, by composition), so this module does not import the engine.

    >>> cal = engine.calibrate(Ticket, texts, labels)  # doctest: +SKIP
    >>> engine.suggest_labels(Ticket, unlabeled, count=50).picked  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
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
from pcd_engine.request import Request, rendered
from pcd_engine.results import FieldResult
from pcd_engine.suggestions import SUGGESTION_SHARE, LabelSuggestions, Suggestion, check_suggest, pick


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
        items = self._phases(plan, texts, keep, calibration, (), chunk, progress)
        return [item if isinstance(item, PCDError) else (item.fields, item.hidden) for item in items]

    def score_variants(
        self,
        plan: SchemaPlan,
        texts: Sequence[Any],
        calibrations: Sequence[Calibration | None],
        *,
        chunk: int = 32,
        progress: Callable[[int], None] | None = None,
    ) -> list[list[dict[str, FieldResult]] | PCDError]:
        """Per text, its scored fields as a call with each of `calibrations` (None: uncalibrated)
        answers them, or the error it raised; from one scoring pass (`Pipeline.score`'s variants:
        the second pass scores every calibration's shortlist, the heads read the same calls' hidden
        states). An engine with an FP32 re-scorer (phase 3 changes fields after the shortlists)
        scores once per calibration instead, `progress` following the first."""
        identity = self.pipeline.model_identity
        for calibration in calibrations:
            if calibration is not None:
                calibration.check(plan, identity)
        if self.pipeline.rescorer is not None:
            runs = [
                self.score_fields(plan, texts, calibration=c, chunk=chunk, progress=None if k else progress)
                for k, c in enumerate(calibrations)
            ]
            return [
                first if isinstance(first, PCDError) else [run[i][0] for run in runs]  # type: ignore[index]
                for i, first in enumerate(runs[0])
            ]
        keep = any(c is not None and c.needs_hidden for c in calibrations)
        items = self._phases(plan, texts, keep, None, calibrations, chunk, progress)
        return [item if isinstance(item, PCDError) else item.variants for item in items]

    def _phases(
        self,
        plan: SchemaPlan,
        texts: Sequence[Any],
        keep_hidden: bool,
        calibration: Calibration | None,
        variants: Sequence[Calibration | None],
        chunk: int,
        progress: Callable[[int], None] | None,
    ) -> list[Request | PCDError]:
        """Phases 1 to 4 over the texts, `chunk` at a time (`progress(n)` after each)."""
        items = self.pipeline.render(plan, texts, return_exceptions=True)
        if progress is not None:  # inputs refused before any model work
            progress(sum(isinstance(item, PCDError) for item in items))
        requests = rendered(items)
        for start in range(0, len(requests), chunk):
            part = requests[start : start + chunk]
            self.pipeline.score(plan, part, keep_hidden, calibration, variants)
            self.pipeline.rescore(plan, part)
            self.pipeline.apply_calibration(plan, part, calibration)
            if progress is not None:
                progress(len(part))
        return items

    def suggest_labels(
        self,
        schema: Any,
        texts: Sequence[str | Conversation],
        count: int = 50,
        *,
        by: str = "margin",
        calibration: Calibration | None = None,
        labeled: Sequence[str | Conversation] = (),
        share: float = SUGGESTION_SHARE,
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
        **options: Unpack[PlanOptions],
    ) -> LabelSuggestions:
        """The `count` texts most worth labeling next (suggestions.py): a random `share` that keeps
        the labels a sample, the rest drawn by uncertainty (`by` "margin" or "entropy", under
        `calibration` if given) and by distance in the model's hidden states to the texts picked or
        already `labeled` (a text of `texts` that is in `labeled` is not suggested again). Each comes
        with its current best guess as a label to correct; a text that cannot be scored is in
        `errors` by its index. A round: calibrate on the labels so far, then suggest with that
        calibration and those texts as `labeled`.

            >>> picked = engine.suggest_labels(Ticket, unlabeled, count=50).picked  # doctest: +SKIP
            >>> picked[0].text, picked[0].label  # doctest: +SKIP
        """
        check_suggest(count, by, share)  # before any text is scored
        texts, options = with_system(texts, options)
        plan = self.pipeline.plan(schema, **options)
        done = {_key(t) for t in labeled}
        scored: list[tuple[dict[str, FieldResult], torch.Tensor | None] | PCDError] = []
        for start in range(0, len(texts), SUGGEST_CHUNK):  # only the feature is kept of the states
            part = texts[start : start + SUGGEST_CHUNK]
            found = self.score_fields(plan, part, hidden=True, calibration=calibration, progress=progress)
            scored += [s if isinstance(s, PCDError) else (s[0], _features(s[1])) for s in found]
        per_text = [
            None if isinstance(s, PCDError) or _key(t) in done else s[0]
            for s, t in zip(scored, texts, strict=True)
        ]
        features = [None if isinstance(s, PCDError) else s[1] for s in scored]
        seen = self.score_fields(plan, list(labeled), hidden=True) if labeled else []
        taken = [f for s in seen if not isinstance(s, PCDError) and (f := _features(s[1])) is not None]
        picked = []
        for p in pick(per_text, features, count, by=by, share=share, labeled=taken, seed=seed):
            fields = per_text[p.index]
            assert fields is not None
            label = plan.compiled.assemble(scored_values(fields))
            picked.append(Suggestion(texts[p.index], label, p.index, p.field, p.uncertainty, p.sampled))
        errors = {i: s for i, s in enumerate(scored) if isinstance(s, PCDError)}
        return LabelSuggestions(picked, errors)


SUGGEST_CHUNK = 1024  # texts scored at a time by `suggest_labels`, keeping one vector of their states


def _features(hidden: HiddenStates | None) -> torch.Tensor | None:
    """What suggestions measure distances in: the text's mean hidden state at the middle layer."""
    return None if hidden is None else hidden.text_middle


def _key(text: Any) -> str:
    return text if isinstance(text, str) else repr(text)


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
