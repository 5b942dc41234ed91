"""Heads: a per-field linear classifier on the model's own features, fitted on the user's labels.

    logits = (scale * z + bias + W @ standardised(x)) / temperature -> softmax

`z` are the rule's log-scores of the field's values (what the model knows of the labels' meaning,
useful from zero labels); `x` is one block of hidden states from the same forward call
(`hidden.py`): the field's fork state, or the text's mean state at the final or the middle layer.
With W = 0 the head is the `bias` calibration map; the L2 penalty on W pulls it there, and the bias
is pulled toward the label-free (batch) estimate, more strongly for a value with few labels.

`fit_head` chooses the block and the L2 strength by cross-validated log-loss over the folds, then
fits a temperature on the chosen configuration's out-of-fold logits over finer folds (heads fitted
on nearly every row, as the final head is: a temperature fitted on heads that saw 4/5 of the rows
left the final head underconfident); each row's reported probabilities come from a head fitted
without that row.

    >>> head, oof = fit_head(values, z, features, labels, fold)  # doctest: +SKIP
    >>> head.probabilities(z_row, {"fork": fork_state})  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pcd_engine.hidden import BLOCKS, HiddenStates
from pcd_engine.optimisers import Linear, batch_prior, fit_linear, fit_temperature, standardiser
from pcd_engine.results import FieldResult

L2_GRID = (1.0, 0.1, 0.01, 0.001)  # penalty on W (mean cross-entropy + l2 * sum(W**2)), tried in turn


@dataclass(frozen=True, eq=False)
class FieldHead:
    """One field's fitted head (see the module). `tree` is the field's tree index in the plan (where
    its fork state is); `block` names the hidden-state block it reads."""

    values: tuple[str, ...]
    block: str
    tree: int
    scale: float
    bias: tuple[float, ...]
    weight: torch.Tensor  # (values, D)
    mean: torch.Tensor  # (D,) feature means of the fitting rows
    std: torch.Tensor  # (D,) and standard deviations (at least 1e-6)
    temperature: float = 1.0
    l2: float = 0.0
    method: str = "head"

    def logits(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Calibrated logits for rows of log-scores (..., K) and features (..., D)."""
        out = z.double() * self.scale + torch.tensor(self.bias, dtype=torch.float64)
        out = out + ((x.double() - self.mean) / self.std) @ self.weight.T
        return out / self.temperature

    def features(self, hidden: HiddenStates) -> torch.Tensor:
        return hidden.block(self.block, self.tree)

    def apply(self, result: FieldResult, hidden: HiddenStates | None = None) -> FieldResult:
        if result.source != "scored" or result.rule == "fixed":
            return result
        if hidden is None:
            raise ValueError(f"field {result.path!r} has a head but the request kept no hidden states")
        z = torch.tensor(list(result.log_scores.values()), dtype=torch.float64)
        return with_logits(result, self.logits(z, self.features(hidden).double()), "head")

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": self.weight, f"{prefix}.mean": self.mean, f"{prefix}.std": self.std}

    def to_json(self) -> dict[str, Any]:
        return {
            "method": "head",
            "values": list(self.values),
            "block": self.block,
            "tree": self.tree,
            "scale": self.scale,
            "bias": list(self.bias),
            "temperature": self.temperature,
            "l2": self.l2,
        }

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], prefix: str
    ) -> FieldHead:
        if data["block"] not in BLOCKS:
            raise ValueError(f"unknown feature block {data['block']!r}")
        weight, mean, std = (tensors[f"{prefix}.{name}"].double() for name in ("weight", "mean", "std"))
        if weight.shape != (len(data["values"]), mean.shape[0]) or std.shape != mean.shape:
            raise ValueError(f"the weights of field {prefix!r} do not fit its values")
        return cls(
            tuple(data["values"]),
            data["block"],
            int(data["tree"]),
            float(data["scale"]),
            tuple(float(b) for b in data["bias"]),
            weight,
            mean,
            std,
            float(data["temperature"]),
            float(data["l2"]),
        )


def with_logits(result: FieldResult, logits: torch.Tensor, method: str) -> FieldResult:
    """`result` answered by the softmax of calibrated logits (one per value, in its order). A
    shortlisted field's values outside its shortlist are estimates: none is put above the lowest
    shortlisted value, so the answer stays one of the values scored exactly (shortlist.py)."""
    if result.shortlist is not None:
        values = list(result.log_scores)
        exact = torch.tensor([values.index(v) for v in result.shortlist])
        outside = torch.ones(len(values), dtype=torch.bool)
        outside[exact] = False
        logits = torch.where(outside, torch.clamp(logits, max=float(logits[exact].min())), logits)
    return with_probabilities(result, torch.softmax(logits, dim=0).tolist(), method)


def with_probabilities(result: FieldResult, probs: Sequence[float], method: str) -> FieldResult:
    """`result` answered by new probabilities (one per value, in its order)."""
    values = list(result.log_scores)
    chosen = max(range(len(probs)), key=probs.__getitem__)
    runner_up = max((p for i, p in enumerate(probs) if i != chosen), default=0.0)
    return dataclasses.replace(
        result,
        value=values[chosen],
        probabilities=dict(zip(values, probs, strict=True)),
        margin=probs[chosen] - runner_up,
        calibrated=method != "none",
        calibration=method,
    )


@dataclass(frozen=True)
class Basis:
    """The standardised features of a head's fitting rows, in an orthonormal basis of their span. A
    head's loss sees W only through `W @ x` of those rows and its L2 penalty is on every weight, so
    the fitted W lies in their span: fitted in this basis (at most one weight per row and value
    instead of one per hidden dimension, 576 for SmolLM2, 2304 for MiniCPM5-2B), it is the same head."""

    mean: torch.Tensor  # (D,)
    std: torch.Tensor  # (D,)
    directions: torch.Tensor  # (D, r) orthonormal columns, r <= rows

    @classmethod
    def of(cls, x: torch.Tensor) -> Basis:
        x = x.double()
        mean, std = standardiser(x)
        xs = (x - mean) / std
        # the span from the rows' Gram matrix (rows x rows, not D x D): x = U S V^T, V = x^T U / S
        eigenvalues, u = torch.linalg.eigh(xs @ xs.T)
        kept = eigenvalues > eigenvalues.max().clamp_min(0) * 1e-10
        directions = xs.T @ u[:, kept] / eigenvalues[kept].sqrt()
        return cls(mean, std, directions)

    def standardised(self, x: torch.Tensor) -> torch.Tensor:
        return (x.double() - self.mean) / self.std

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.standardised(x) @ self.directions

    def start(self, fitted: Linear) -> Linear:
        """A warm start in this basis from a fit on other (for example all) rows, its weights over
        the standardised features."""
        assert fitted.weight is not None
        return dataclasses.replace(fitted, weight=fitted.weight @ self.directions)

    def fit(
        self, z: torch.Tensor, x: torch.Tensor, labels: torch.Tensor, l2: float, start: Linear | None = None
    ) -> Linear:
        """`fit_linear` on rows already `project`ed; its weights back over the standardised features."""
        fitted = fit_linear(z, labels, batch_prior(z), x, l2, self.start(start) if start else None)
        assert fitted.weight is not None
        return dataclasses.replace(fitted, weight=fitted.weight @ self.directions.T)

    def head(self, values: tuple[str, ...], block: str, tree: int, fitted: Linear, l2: float) -> FieldHead:
        assert fitted.weight is not None
        bias = tuple(fitted.bias.tolist())
        return FieldHead(values, block, tree, fitted.scale, bias, fitted.weight, self.mean, self.std, 1.0, l2)


def fit_config(
    values: tuple[str, ...],
    z: torch.Tensor,
    x: torch.Tensor,
    labels: torch.Tensor,
    block: str,
    tree: int,
    l2: float,
) -> FieldHead:
    """One head on these rows (temperature 1)."""
    basis = Basis.of(x)
    return basis.head(values, block, tree, basis.fit(z, basis.project(x), labels, l2), l2)


def out_of_fold_logits(
    z: torch.Tensor,
    x: torch.Tensor,
    labels: torch.Tensor,
    fold: Sequence[int],
    grid: Sequence[float],
    start: Linear | None = None,
    stop_rising: bool = False,
) -> dict[float, torch.Tensor]:
    """Per L2 strength of `grid`, each row's logits from a head fitted on the other folds only. The
    strengths go from the strongest penalty down, each fold's fit starting where its last one
    stopped (the first from `start`, a fit on every row, if given). With `stop_rising`,
    the path ends at the first strength whose cross-validated log-loss is above the one before it."""
    tags = torch.tensor(fold)
    parts = [(tags != k, tags == k, Basis.of(x[tags != k])) for k in sorted(set(fold))]
    rows = [basis.project(x[train]) for train, _, basis in parts]
    whole = Basis.of(x) if start is None else None
    x_whole = whole.project(x) if whole is not None else None
    out: dict[float, torch.Tensor] = {}
    last = math.inf
    for l2 in sorted(grid, reverse=True):
        if whole is not None and x_whole is not None:  # the fit on every row: each fold starts there
            start = whole.fit(z, x_whole, labels, l2, start)
        logits = torch.empty_like(z, dtype=torch.float64)
        for (train, test, basis), x_train in zip(parts, rows, strict=True):
            fitted = basis.fit(z[train], x_train, labels[train], l2, start)
            assert fitted.weight is not None
            x_test = basis.standardised(x[test])
            logits[test] = z[test].double() * fitted.scale + fitted.bias + x_test @ fitted.weight.T
        out[l2] = logits
        loss = float(torch.nn.functional.cross_entropy(logits, labels))
        if stop_rising and loss > last:
            break
        last = loss
    return out


@dataclass(frozen=True)
class HeadFit:
    head: FieldHead  # fitted on every row, with the out-of-fold temperature
    out_of_fold: torch.Tensor  # (rows, K) probabilities, each from a head fitted without its row
    tried: dict[str, float]  # "block/l2" -> cross-validated log-loss
    compared: torch.Tensor  # the same over `fold` (what other methods' out-of-fold figures are over)


def fit_head(
    values: tuple[str, ...],
    z: torch.Tensor,
    features: Mapping[str, torch.Tensor],
    labels: torch.Tensor,
    fold: Sequence[int],
    tree: int,
    temperature_fold: Sequence[int] | None = None,
) -> HeadFit:
    """Choose the feature block and L2 strength by out-of-fold log-loss over `fold`, fit a
    temperature on the chosen configuration's out-of-fold logits over `temperature_fold` (finer
    folds, default `fold`: heads fitted on nearly every row, as the final head is), and refit the
    head on every row."""
    tried: dict[str, float] = {}
    best: tuple[float, str, float, torch.Tensor] | None = None
    features = {block: x.double() for block, x in features.items()}
    for block, x in features.items():
        for l2, logits in out_of_fold_logits(z, x, labels, fold, L2_GRID, stop_rising=True).items():
            loss = float(torch.nn.functional.cross_entropy(logits, labels))
            tried[f"{block}/{l2:g}"] = loss
            if best is None or loss < best[0]:
                best = (loss, block, l2, logits)
    assert best is not None, "fit_head needs at least one feature block"
    _, block, l2, logits = best
    temperature = fit_temperature(logits, labels)
    compared = torch.softmax(logits / temperature, dim=1)
    basis = Basis.of(features[block])
    every = basis.fit(z, basis.project(features[block]), labels, l2)
    head = basis.head(values, block, tree, every, l2)
    if temperature_fold is not None and list(temperature_fold) != list(fold):
        logits = out_of_fold_logits(z, features[block], labels, temperature_fold, (l2,), every)[l2]
        temperature = fit_temperature(logits, labels)
    head = dataclasses.replace(head, temperature=temperature)
    return HeadFit(head, torch.softmax(logits / temperature, dim=1), tried, compared)
