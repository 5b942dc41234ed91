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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pcd_engine.hidden import BLOCKS, HiddenStates
from pcd_engine.optimisers import batch_prior, fit_linear, fit_temperature, standardiser
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
    mean, std = standardiser(x)
    scale, bias, weight = fit_linear(z, labels, batch_prior(z), (x - mean) / std, l2)
    assert weight is not None
    return FieldHead(values, block, tree, scale, tuple(bias.tolist()), weight, mean, std, 1.0, l2)


def out_of_fold_logits(
    values: tuple[str, ...],
    z: torch.Tensor,
    x: torch.Tensor,
    labels: torch.Tensor,
    fold: Sequence[int],
    block: str,
    tree: int,
    l2: float,
) -> torch.Tensor:
    """Each row's logits from a head fitted on the other folds only."""
    out = torch.empty_like(z, dtype=torch.float64)
    tags = torch.tensor(fold)
    for k in sorted(set(fold)):
        train, test = tags != k, tags == k
        head = fit_config(values, z[train], x[train], labels[train], block, tree, l2)
        out[test] = head.logits(z[test], x[test])
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
        for l2 in L2_GRID:
            logits = out_of_fold_logits(values, z, x, labels, fold, block, tree, l2)
            loss = float(torch.nn.functional.cross_entropy(logits, labels))
            tried[f"{block}/{l2:g}"] = loss
            if best is None or loss < best[0]:
                best = (loss, block, l2, logits)
    assert best is not None, "fit_head needs at least one feature block"
    _, block, l2, logits = best
    temperature = fit_temperature(logits, labels)
    compared = torch.softmax(logits / temperature, dim=1)
    if temperature_fold is not None and list(temperature_fold) != list(fold):
        logits = out_of_fold_logits(values, z, features[block], labels, temperature_fold, block, tree, l2)
        temperature = fit_temperature(logits, labels)
    head = fit_config(values, z, features[block], labels, block, tree, l2)
    head = dataclasses.replace(head, temperature=temperature)
    return HeadFit(head, torch.softmax(logits / temperature, dim=1), tried, compared)
