"""Fitting calibrations from the user's texts, per (schema, field), never scored on what they were fitted on.

- "temperature": one temperature per field, from labels (does not change answers, only confidence);
- "bias": a bias per value and a temperature, from labels, the bias pulled toward the batch
  calibration of the same texts (below), more strongly for a value with few labels, so that a value
  seen rarely or never in the labels falls back to the label-free estimate;
- "batch": no labels; the bias is minus the log of each value's mean probability over the given texts
  (batch calibration, Zhou et al., ICLR 2024): a value the model favours for every text is discounted;
- "head": from labels, a linear head on the rule's scores and one block of the model's hidden states
  (`heads.py`), the block and its L2 strength chosen by cross-validation; a field whose labels are
  too few for one (`head_ready`) is fitted as "auto" is, and its report says why;
- "none": the rule's own probabilities;
- "auto" (with labels): per field, among the methods whose cross-validated accuracy and macro-F1 are
  not below "none"'s, the one with the lowest cross-validated log-loss (within `LOG_LOSS_TIE`, the
  simpler one, in `METHODS` order). "head" takes part when the texts' hidden states were kept and
  `head_ready` holds.

With labels, the report's figures are out-of-fold: each text's calibrated probabilities come from a
map fitted on the other folds. It says per field which method was chosen and why (with every
method's cross-validated accuracy, macro-F1, log-loss and ECE), and warns when the labels' value
shares differ strongly from the model's own estimate for the same texts.

Two steps keep the probabilities calibrated as labels grow (issue 33: ECE rose from 50 to 200 labels
while accuracy rose):
- a head's temperature is fitted on out-of-fold logits over `TEMPERATURE_FOLDS` folds, heads that saw
  95% of the rows, not 80%: the final head, refitted on all of them, is more accurate than 4/5 heads,
  and a temperature fitted on those left it underconfident (banking77, 200 labels: confidence 0.373
  against accuracy 0.427; now 0.401);
- every labeled field ends with a confidence temperature (`confidence_step`): fitted so that the
  answer's probability predicts how often it is right, kept only where it lowers that loss
  cross-fitted. It changes no answer; it fixes maps that move answers but not confidence ("batch",
  banking77 at 50 labels: ECE 0.110 -> 0.088).
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pcd_engine import heads, metrics, optimisers
from pcd_engine.calibration import (
    Calibration,
    FieldCalibration,
    FieldMap,
    HeldOut,
    ModelIdentity,
    plan_rules,
)
from pcd_engine.errors import CalibrationError
from pcd_engine.heads import head_ready, not_ready
from pcd_engine.hidden import BLOCKS, HiddenStates
from pcd_engine.plan import SchemaPlan
from pcd_engine.results import FieldResult, json_key
from pcd_engine.schema import CompiledSchema, JSONScalar

METHODS = ("none", "temperature", "batch", "bias", "head")  # simplest first: ties go to the earlier
LOG_LOSS_TIE = 0.002  # cross-validated log-losses closer than this (nats) count as equal
SKEW_WARNING = 0.25  # total variation between label shares and the model's estimate that warns
TEMPERATURE_FOLDS = 20  # a head's temperature is fitted on out-of-fold logits over this many folds


def fit_batch(values: tuple[str, ...], log_scores: torch.Tensor) -> FieldCalibration:
    """Batch calibration: bias = -log(mean probability of each value over the rows)."""
    return FieldCalibration("batch", values, 1.0, tuple(optimisers.batch_prior(log_scores).tolist()))


def fit_labeled(
    method: str, values: tuple[str, ...], log_scores: torch.Tensor, labels: torch.Tensor
) -> FieldCalibration:
    """Fit a map that reads the rule's scores alone ("none", "temperature", "batch", "bias") on rows
    of log-scores and the index of each row's true value."""
    z = log_scores.double()
    if method == "none":
        return FieldCalibration("none", values)
    if method == "batch":
        return fit_batch(values, z)
    if method == "temperature":
        return FieldCalibration("temperature", values, optimisers.fit_temperature(z, labels))
    return _bias_map(values, optimisers.fit_linear(z, labels, optimisers.batch_prior(z)))


def _bias_map(values: tuple[str, ...], fitted: optimisers.Linear) -> FieldCalibration:
    return FieldCalibration("bias", values, 1.0 / fitted.scale, tuple(fitted.bias.tolist()))


def folds_of(n: int, folds: int, seed: int = 0) -> list[int]:
    """The fold of each of n rows: a seeded shuffle dealt round-robin."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    fold = [0] * n
    for position, row in enumerate(order):
        fold[row] = position % folds
    return fold


def out_of_fold(
    method: str, values: tuple[str, ...], z: torch.Tensor, labels: torch.Tensor, fold: Sequence[int]
) -> torch.Tensor:
    """Each row's calibrated probabilities from a map fitted on the other folds only (the bias
    maps of every fold in one `fit_linears` batch)."""
    out = torch.empty_like(z, dtype=torch.float64)
    tags = torch.tensor(fold)
    parts = [(tags != k, tags == k) for k in sorted(set(fold))]
    if method == "bias":
        z = z.double()
        linear = [optimisers.LinearProblem(z[t], labels[t], optimisers.batch_prior(z[t])) for t, _ in parts]
        maps = [_bias_map(values, fitted) for fitted in optimisers.fit_linears(linear)]
    else:
        maps = [fit_labeled(method, values, z[train], labels[train]) for train, _ in parts]
    for (_, test), fitted in zip(parts, maps, strict=True):
        out[test] = torch.softmax(fitted.logits(z[test]), dim=1)
    return out


@dataclass
class FieldData:
    """One field's scores over the calibration texts: rows of log-scores, labels where known, and
    per hidden-state block the rows' features (when the texts' hidden states were kept)."""

    values: tuple[str, ...]
    tree: int  # the field's tree index in the plan
    rows: list[list[float]] = field(default_factory=list)
    labels: list[int | None] = field(default_factory=list)
    features: dict[str, list[torch.Tensor]] = field(default_factory=dict)


def collect(
    plan: SchemaPlan,
    per_text: Sequence[Mapping[str, FieldResult] | None],
    labels: Sequence[Any] | None,
    hidden: Sequence[HiddenStates | None] | None = None,
) -> dict[str, FieldData]:
    """Per scored field, the log-scores of every answered text (None: the text failed), the index
    of its label (None where the label does not give that field) and, with `hidden`, its features."""
    data: dict[str, FieldData] = {}
    for tree, dp in enumerate(plan.scored_decisions):
        data[dp.decision.path] = FieldData(tuple(json_key(c.value) for c in dp.decision.candidates), tree)
    for i, fields in enumerate(per_text):
        if fields is None:
            continue
        truth = decision_labels(plan.compiled, labels[i], i) if labels is not None else {}
        states = hidden[i] if hidden is not None else None
        for path, d in data.items():
            d.rows.append(list(fields[path].log_scores.values()))
            d.labels.append(d.values.index(json_key(truth[path])) if path in truth else None)
            if states is not None:
                for block in BLOCKS:
                    d.features.setdefault(block, []).append(states.block(block, d.tree))
    return data


def decision_labels(compiled: CompiledSchema, label: Any, index: int) -> dict[str, JSONScalar]:
    """The true value of each decision a label gives (a dict in the schema's JSON form, or an instance
    of the schema); CalibrationError for a value the field does not allow."""
    if hasattr(label, "model_dump"):
        label = label.model_dump(mode="json")
    if not isinstance(label, Mapping):
        raise CalibrationError(
            f"label #{index} must be an object (dict or schema instance), got {type(label).__name__}"
        )
    out: dict[str, JSONScalar] = {}
    for d in compiled.decisions:
        node: Any = label
        keys = d.json_keys[:-1] if d.option is not None else d.json_keys
        for key in keys:
            if not isinstance(node, Mapping) or key not in node:
                node = _MISSING
                break
            node = node[key]
        if node is _MISSING:
            continue
        if d.option is not None:  # a multi-label field: is this option among the listed ones?
            if not isinstance(node, list | tuple | set):
                raise CalibrationError(f"label #{index}: field {d.path.split('[')[0]!r} must be a list")
            node = d.option in [getattr(v, "value", v) for v in node]
        node = getattr(node, "value", node)  # an Enum member in a dict label
        if not any(type(node) is type(c.value) and node == c.value for c in d.candidates):
            allowed = ", ".join(c.json for c in d.candidates)
            raise CalibrationError(f"label #{index}: field {d.path!r} is {node!r}, not one of {allowed}")
        out[d.path] = node
    return out


_MISSING = object()


def check_fit(method: str, labeled: bool, folds: int) -> None:
    """CalibrationError for a method or fold count `fit` cannot use (run before any text is scored)."""
    if method not in (*METHODS, "auto"):
        raise CalibrationError(f"unknown method {method!r}; choose one of {[*METHODS, 'auto']}")
    if not labeled and method not in ("batch", "auto", "none"):
        raise CalibrationError(f"method {method!r} needs labels; without labels use 'batch'")
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise CalibrationError(f"folds must be an int of at least 2, got {folds!r}")


def fit(
    plan: SchemaPlan,
    model: ModelIdentity,
    per_text: Sequence[Mapping[str, FieldResult] | None],
    labels: Sequence[Any] | None,
    method: str = "auto",
    folds: int = 5,
    seed: int = 0,
    hidden: Sequence[HiddenStates | None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """A Calibration of every scored field from the texts' raw field results (None: a text that got
    no answer), when given their labels, and for "head" (or "auto" with heads) their hidden states.
    With labels, the report's figures are out-of-fold. `progress(path)` is called as each field's
    fitting starts (every field's head is fitted, together, as the first one's starts)."""
    check_fit(method, labels is not None, folds)
    if method == "head" and hidden is None:
        raise CalibrationError("method 'head' needs the texts' hidden states (engine.calibrate keeps them)")
    data = collect(plan, per_text, labels, hidden)
    fitted: dict[str, FieldMap] = {}
    reports, held = {}, {}
    head_fits: dict[str, heads.HeadFit] | None = None
    for path, d in data.items():
        if progress is not None:
            progress(path)
        if labels is None:
            fitted[path], reports[path] = _fit_unlabeled(d, "batch" if method == "auto" else method)
            continue
        if head_fits is None:  # every field's head together, as the first field's fitting starts
            wanted = method in ("auto", "head")
            tasks = {p: t for p, f in data.items() if wanted and (t := head_task(f, folds, seed))}
            head_fits = dict(zip(tasks, heads.fit_heads(list(tasks.values())), strict=True))
        fitted[path], reports[path], out = fit_field(d, method, folds, seed, head_fits.get(path))
        if out is not None:
            held[path] = out
    answered = sum(f is not None for f in per_text)
    report = {
        "method": method,
        "texts": len(per_text),
        "answered": answered,
        "labeled": labels is not None,
        "folds": folds if labels is not None else None,
        "fields": reports,
    }
    if labels is not None:
        report["summary"] = _summary(reports)
    return Calibration(fitted, plan.fingerprint, model, plan_rules(plan), report, held)


def _fit_unlabeled(d: FieldData, method: str) -> tuple[FieldCalibration, dict[str, Any]]:
    if not d.rows:
        return FieldCalibration("none", d.values), {"method": "none", "n": 0}
    z = torch.tensor(d.rows, dtype=torch.float64)
    fitted = fit_batch(d.values, z) if method == "batch" else FieldCalibration("none", d.values)
    before = torch.softmax(z, dim=1)
    after = torch.softmax(fitted.logits(z), dim=1)
    return fitted, {
        "method": fitted.method,
        "n": len(d.rows),
        "answer_shares_before": _shares(d.values, before),
        "answer_shares_after": _shares(d.values, after),
    }


def head_task(d: FieldData, folds: int, seed: int) -> heads.HeadTask | None:
    """The field's labeled rows for `heads.fit_heads` (None: no head can be fitted, `head_ready`)."""
    keep = [i for i, y in enumerate(d.labels) if y is not None]
    labels = [y for y in d.labels if y is not None]
    if len(keep) < 2 or not d.features or not head_ready(labels, len(d.values)):
        return None
    z = torch.tensor([d.rows[i] for i in keep], dtype=torch.float64)
    features = {b: torch.stack([rows[i] for i in keep]).double() for b, rows in d.features.items()}
    fold = folds_of(len(keep), min(folds, len(keep)), seed)
    fine = folds_of(len(keep), min(TEMPERATURE_FOLDS, len(keep)), seed)
    return heads.HeadTask(d.values, d.tree, z, features, torch.tensor(labels), fold, fine)


def fit_field(
    d: FieldData, method: str, folds: int, seed: int, head_fit: heads.HeadFit | None = None
) -> tuple[FieldMap, dict[str, Any], HeldOut | None]:
    """One field's calibration, report and held-out figures; `head_fit`: its head, fitted already
    (`fit` fits every field's head together), or None to fit it here where one is tried."""
    keep = [i for i, y in enumerate(d.labels) if y is not None]
    if len(keep) < 2:
        none = FieldCalibration("none", d.values)
        return none, {"method": "none", "n": len(keep), "reason": "fewer than 2 labels"}, None
    z = torch.tensor([d.rows[i] for i in keep], dtype=torch.float64)
    y = torch.tensor([d.labels[i] for i in keep])
    fold = folds_of(len(keep), min(folds, len(keep)), seed)
    task = head_task(d, folds, seed) if head_fit is None else None
    ready = head_fit is not None or task is not None
    fallback = method == "head" and not ready  # this field chooses as "auto" does, without a head
    tried = [m for m in METHODS if m != "head" or ready] if method == "auto" or fallback else [method]
    held_out = {m: out_of_fold(m, d.values, z, y, fold) for m in tried if m != "head"}
    if "head" in tried:
        if head_fit is None:
            assert task is not None
            head_fit = heads.fit_heads([task])[0]
        held_out["head"] = head_fit.compared  # methods are compared over the same folds
    truth = y.tolist()
    scores = {m: metrics.field_report(p.tolist(), truth) for m, p in held_out.items()}
    chosen, reason = choose(scores) if method == "auto" or fallback else (method, "asked for")
    if fallback:
        reason = f"no head: {not_ready(d.values, truth)}; then {reason}"
    chosen_out = head_fit.out_of_fold if chosen == "head" and head_fit is not None else held_out[chosen]
    confidence, after = confidence_step(chosen_out, y, fold)
    raw_probs = torch.softmax(z, dim=1)
    raw = raw_probs.tolist()
    majority = [_fold_majority(truth, fold, k) for k in range(len(keep))]
    report: dict[str, Any] = {
        "method": chosen,
        "reason": reason,
        "n": len(keep),
        "cv_log_loss": {m: r["log_loss"] for m, r in scores.items()},
        "cv": {m: {k: r[k] for k in ("accuracy", "macro_f1", "log_loss", "ece")} for m, r in scores.items()},
        "confidence_temperature": confidence,
        "before": metrics.field_report(raw, truth),
        "after": metrics.field_report(after.tolist(), truth),
        "majority": sum(m == t for m, t in zip(majority, truth, strict=True)) / len(keep),
        "label_shares": _shares(d.values, truth),
        "model_shares": dict(zip(d.values, raw_probs.mean(dim=0).tolist(), strict=True)),
    }
    if not ready:
        report["head"] = f"not tried: {not_ready(d.values, truth)}"
    if head_fit is not None:
        report["head_configs"] = head_fit.tried
        report["head_block"], report["head_l2"] = head_fit.head.block, head_fit.head.l2
    warning = skew_warning(report["label_shares"], report["model_shares"])
    if warning:
        report["warning"] = warning
    held = HeldOut(truth, raw, after.tolist())
    if chosen == "head":
        assert head_fit is not None
        head = head_fit.head
        return dataclasses.replace(head, temperature=head.temperature * confidence), report, held
    return sharpened(fit_labeled(chosen, d.values, z, y), confidence), report, held


def confidence_step(
    probabilities: torch.Tensor, labels: torch.Tensor, fold: Sequence[int]
) -> tuple[float, torch.Tensor]:
    """(temperature, the rows' probabilities under it): the confidence temperature
    (`optimisers.fit_confidence_temperature`) of a field's out-of-fold probabilities, and those
    probabilities cross-fitted (each fold's from a temperature fitted on the other folds). 1.0 and
    the probabilities unchanged unless the cross-fitted binary log-loss of the confidence falls.
    A temperature changes no answer, so accuracy and macro-F1 stay as they are."""
    logits = probabilities.clamp_min(1e-300).log()
    tags = torch.tensor(fold)
    crossed = torch.empty_like(probabilities)
    for k in sorted(set(fold)):
        train, test = tags != k, tags == k
        crossed[test] = torch.softmax(
            logits[test] / optimisers.fit_confidence_temperature(logits[train], labels[train]), dim=1
        )
    if optimisers.confidence_loss(crossed, labels) >= optimisers.confidence_loss(probabilities, labels):
        return 1.0, probabilities
    return optimisers.fit_confidence_temperature(logits, labels), crossed


def sharpened(fitted: FieldCalibration, temperature: float) -> FieldCalibration:
    """`fitted` with its logits divided by `temperature` (the rule's own scores become a temperature map)."""
    if temperature == 1.0:
        return fitted
    bias = tuple(b / temperature for b in fitted.bias)
    method = "temperature" if fitted.method == "none" else fitted.method
    return FieldCalibration(method, fitted.values, fitted.temperature * temperature, bias)


def choose(scores: Mapping[str, Mapping[str, float]]) -> tuple[str, str]:
    """(method, why): among the methods whose cross-validated accuracy and macro-F1 are not below
    "none"'s, the lowest log-loss, the simpler one within LOG_LOSS_TIE."""
    floor = scores["none"]
    safe = [m for m in scores if all(scores[m][k] >= floor[k] - 1e-12 for k in ("accuracy", "macro_f1"))]
    best = min(scores[m]["log_loss"] for m in safe)
    chosen = next(m for m in METHODS if m in safe and scores[m]["log_loss"] <= best + LOG_LOSS_TIE)
    left_out = [
        f"{m} (accuracy {scores[m]['accuracy']:.3f}, macro-F1 {scores[m]['macro_f1']:.3f})"
        for m in scores
        if m not in safe
    ]
    why = (
        f"lowest cross-validated log-loss ({scores[chosen]['log_loss']:.3f}, ties within "
        f"{LOG_LOSS_TIE} go to the simpler method) among methods whose cross-validated accuracy and "
        f"macro-F1 are not below none's ({floor['accuracy']:.3f}, {floor['macro_f1']:.3f})"
    )
    if left_out:
        why += "; left out for lowering them: " + ", ".join(left_out)
    return chosen, why


def skew_warning(labels: Mapping[str, float], model: Mapping[str, float]) -> str | None:
    """A warning when the labels' value shares differ strongly from the model's mean probabilities
    over the same texts (labels that are not a random sample teach a bias their skew)."""
    distance = 0.5 * sum(abs(labels[v] - model[v]) for v in labels)
    if distance < SKEW_WARNING:
        return None
    top = max(labels, key=labels.__getitem__)
    return (
        f"the labels' value shares differ strongly from what the model predicts for the same texts "
        f"(total variation {distance:.2f}; {top!r} is {labels[top]:.0%} of the labels, the model "
        f"gives it {model[top]:.0%}): if the labeled texts are not a random sample of what you "
        "classify, a bias fitted on them learns their skew"
    )


def _fold_majority(labels: list[int], fold: Sequence[int], row: int) -> int:
    """The most frequent label outside `row`'s fold (the majority answer, fitted on the other folds)."""
    train = [y for y, k in zip(labels, fold, strict=True) if k != fold[row]]
    return Counter(train or labels).most_common(1)[0][0]


def _summary(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    fitted = [r for r in reports.values() if "before" in r]
    if not fitted:
        return {}

    def mean(key: str, part: str) -> float:
        return sum(r[part][key] for r in fitted) / len(fitted)

    return {
        "field_accuracy_before": mean("accuracy", "before"),
        "field_accuracy_after": mean("accuracy", "after"),
        "macro_f1_before": mean("macro_f1", "before"),
        "macro_f1_after": mean("macro_f1", "after"),
        "ece_before": mean("ece", "before"),
        "ece_after": mean("ece", "after"),
        "majority": sum(r["majority"] for r in fitted) / len(fitted),
    }


def _shares(values: tuple[str, ...], answers: torch.Tensor | Sequence[int]) -> dict[str, float]:
    """Each value's share of the answers (indices, or the argmax of rows of probabilities)."""
    if isinstance(answers, torch.Tensor):
        answers = answers.argmax(dim=1).tolist()
    counts = Counter(int(i) for i in answers)
    return {v: counts.get(i, 0) / max(len(answers), 1) for i, v in enumerate(values)}


def batch_maps(
    plan: SchemaPlan, per_text: Sequence[Mapping[str, FieldResult]]
) -> dict[str, FieldCalibration]:
    """Batch calibration fitted on the texts being answered (`classify_batch(calibrate="batch")`)."""
    data = collect(plan, per_text, None)
    return {path: fit_batch(d.values, torch.tensor(d.rows, dtype=torch.float64)) for path, d in data.items()}
