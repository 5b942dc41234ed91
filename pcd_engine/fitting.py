"""Fitting calibrations from the user's texts, per (schema, field), never scored on what they were fitted on.

- "temperature": one temperature per field, from labels (does not change answers, only confidence);
- "bias": a bias per value and a temperature, from labels, the bias L2-regularised toward the batch
  calibration of the same texts (below), so that a value seen rarely or never in the labels falls
  back to the label-free estimate (on ../shared/data this beat a prior at 0: docs/benchmarks.md);
- "batch": no labels; the bias is minus the log of each value's mean probability over the given texts
  (batch calibration, Zhou et al., ICLR 2024): a value the model favours for every text is discounted;
- "none": the rule's own probabilities;
- "auto" (with labels): per field, the method with the lowest cross-validated log-loss.

With labels, the report's figures are out-of-fold: each text's calibrated probabilities come from a
map fitted on the other folds.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pcd_engine import metrics
from pcd_engine.calibration import Calibration, FieldCalibration, HeldOut, ModelIdentity, plan_rules
from pcd_engine.errors import CalibrationError
from pcd_engine.plan import SchemaPlan
from pcd_engine.results import FieldResult, json_key
from pcd_engine.schema import CompiledSchema, JSONScalar

METHODS = ("none", "temperature", "bias", "batch")
BIAS_L2 = 1.0  # a Gaussian prior on the bias: the loss adds BIAS_L2 * sum((bias - batch)**2) / rows


def fit_batch(values: tuple[str, ...], log_scores: torch.Tensor) -> FieldCalibration:
    """Batch calibration: bias = -log(mean probability of each value over the rows)."""
    mean = torch.softmax(log_scores.double(), dim=1).mean(dim=0)
    return FieldCalibration("batch", values, 1.0, tuple((-torch.log(mean.clamp_min(1e-12))).tolist()))


def fit_labeled(
    method: str, values: tuple[str, ...], log_scores: torch.Tensor, labels: torch.Tensor
) -> FieldCalibration:
    """Fit `method` on rows of log-scores and the index of each row's true value."""
    if method == "none":
        return FieldCalibration("none", values)
    if method == "batch":
        return fit_batch(values, log_scores)
    z = log_scores.double()
    inverse_t = torch.zeros((), dtype=torch.float64, requires_grad=True)  # log(1 / temperature)
    prior = torch.zeros(z.shape[1], dtype=torch.float64)
    if method == "bias":  # the label-free estimate from the same texts is where the bias starts
        prior = torch.tensor(fit_batch(values, z).bias, dtype=torch.float64)
    bias = prior.clone().requires_grad_(method == "bias")
    params = [inverse_t, bias] if method == "bias" else [inverse_t]
    optimizer = torch.optim.LBFGS(params, lr=0.5, max_iter=200, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        out = torch.nn.functional.cross_entropy(z * inverse_t.exp() + bias, labels)
        if method == "bias":
            out = out + BIAS_L2 * ((bias - prior) ** 2).sum() / len(labels)
        out.backward()
        return out

    optimizer.step(loss)
    temperature = float(torch.exp(-inverse_t.detach()))
    shift = bias.detach() - bias.detach().mean()  # a constant shift changes nothing; keep it centred
    return FieldCalibration(method, values, temperature, tuple(shift.tolist()) if method == "bias" else ())


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
    """Each row's calibrated probabilities from a map fitted on the other folds only."""
    out = torch.empty_like(z, dtype=torch.float64)
    tags = torch.tensor(fold)
    for k in sorted(set(fold)):
        train, test = tags != k, tags == k
        fitted = fit_labeled(method, values, z[train], labels[train])
        out[test] = torch.softmax(fitted.logits(z[test]), dim=1)
    return out


@dataclass
class FieldData:
    """One field's scores over the calibration texts: rows of log-scores, and labels where known."""

    values: tuple[str, ...]
    rows: list[list[float]] = field(default_factory=list)
    labels: list[int | None] = field(default_factory=list)


def collect(
    plan: SchemaPlan, per_text: Sequence[Mapping[str, FieldResult] | None], labels: Sequence[Any] | None
) -> dict[str, FieldData]:
    """Per scored field, the log-scores of every answered text (None: the text failed) and the index
    of its label (None where the label does not give that field)."""
    data: dict[str, FieldData] = {}
    for dp in plan.scored_decisions:
        data[dp.decision.path] = FieldData(tuple(json_key(c.value) for c in dp.decision.candidates))
    for i, fields in enumerate(per_text):
        if fields is None:
            continue
        truth = decision_labels(plan.compiled, labels[i], i) if labels is not None else {}
        for path, d in data.items():
            d.rows.append(list(fields[path].log_scores.values()))
            d.labels.append(d.values.index(json_key(truth[path])) if path in truth else None)
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


def fit(
    plan: SchemaPlan,
    model: ModelIdentity,
    per_text: Sequence[Mapping[str, FieldResult] | None],
    labels: Sequence[Any] | None,
    method: str = "auto",
    folds: int = 5,
    seed: int = 0,
) -> Calibration:
    """A Calibration of every scored field from the texts' raw field results (None: a text that got
    no answer) and, when given, their labels. With labels, the report's figures are out-of-fold."""
    if method not in (*METHODS, "auto"):
        raise CalibrationError(f"unknown method {method!r}; choose one of {[*METHODS, 'auto']}")
    if labels is None and method not in ("batch", "auto", "none"):
        raise CalibrationError(f"method {method!r} needs labels; without labels use 'batch'")
    data = collect(plan, per_text, labels)
    fitted, reports, held = {}, {}, {}
    for path, d in data.items():
        if labels is None:
            fitted[path], reports[path] = _fit_unlabeled(d, "batch" if method == "auto" else method)
            continue
        fitted[path], reports[path], out = _fit_labeled_field(d, method, folds, seed)
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


def _fit_labeled_field(
    d: FieldData, method: str, folds: int, seed: int
) -> tuple[FieldCalibration, dict[str, Any], HeldOut | None]:
    keep = [i for i, y in enumerate(d.labels) if y is not None]
    if len(keep) < 2:
        none = FieldCalibration("none", d.values)
        return none, {"method": "none", "n": len(keep), "reason": "fewer than 2 labels"}, None
    z = torch.tensor([d.rows[i] for i in keep], dtype=torch.float64)
    y = torch.tensor([d.labels[i] for i in keep])
    fold = folds_of(len(keep), min(folds, len(keep)), seed)
    tried = list(METHODS) if method == "auto" else [method]
    held_out = {m: out_of_fold(m, d.values, z, y, fold) for m in tried}
    losses = {m: metrics.log_loss(p.tolist(), y.tolist()) for m, p in held_out.items()}
    chosen = min(tried, key=lambda m: (losses[m], tried.index(m)))
    raw = torch.softmax(z, dim=1).tolist()
    majority = [_fold_majority(y.tolist(), fold, k) for k in range(len(keep))]
    report = {
        "method": chosen,
        "n": len(keep),
        "cv_log_loss": losses,
        "before": metrics.field_report(raw, y.tolist()),
        "after": metrics.field_report(held_out[chosen].tolist(), y.tolist()),
        "majority": sum(m == t for m, t in zip(majority, y.tolist(), strict=True)) / len(keep),
    }
    held = HeldOut(y.tolist(), raw, held_out[chosen].tolist())
    return fit_labeled(chosen, d.values, z, y), report, held


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


def _shares(values: tuple[str, ...], probabilities: torch.Tensor) -> dict[str, float]:
    counts = Counter(int(i) for i in probabilities.argmax(dim=1))
    return {v: counts.get(i, 0) / len(probabilities) for i, v in enumerate(values)}


def batch_maps(
    plan: SchemaPlan, per_text: Sequence[Mapping[str, FieldResult]]
) -> dict[str, FieldCalibration]:
    """Batch calibration fitted on the texts being answered (`classify_batch(calibrate="batch")`)."""
    data = collect(plan, per_text, None)
    return {path: fit_batch(d.values, torch.tensor(d.rows, dtype=torch.float64)) for path, d in data.items()}
