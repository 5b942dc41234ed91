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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pcd_engine.hidden import BLOCKS, HiddenStates
from pcd_engine.results import FieldResult

L2_GRID = (1.0, 0.1, 0.01, 0.001)  # penalty on W (mean cross-entropy + l2 * sum(W**2)), tried in turn
BIAS_L2 = 1.0  # a value's bias penalty is BIAS_L2 * (1 + (rows / values) / (its labels + 1)) / rows


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
        probs = torch.softmax(self.logits(z, self.features(hidden).double()), dim=0).tolist()
        return with_probabilities(result, probs, "head")

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


def value_penalty(labels: torch.Tensor, values: int) -> torch.Tensor:
    """Per value, the weight of its bias's pull toward the label-free estimate: stronger for a value
    with few labels (a value never labeled weighs 1 + rows / values times a balanced one's base)."""
    counts = torch.bincount(labels, minlength=values).double()
    return BIAS_L2 * (1.0 + (len(labels) / values) / (counts + 1.0))


def fit_linear(
    z: torch.Tensor,
    labels: torch.Tensor,
    prior: torch.Tensor,
    x: torch.Tensor | None = None,
    l2: float = 0.0,
) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """(scale, bias, W) minimising the mean cross-entropy of `scale * z + bias (+ W x)` plus the bias
    pull toward `prior` (`value_penalty`) and `l2 * sum(W**2)`; x already standardised."""
    n, k = z.shape
    log_scale = torch.zeros((), dtype=torch.float64, requires_grad=True)
    bias = prior.clone().double().requires_grad_(True)
    params = [log_scale, bias]
    weight = None
    if x is not None:
        weight = torch.zeros(k, x.shape[1], dtype=torch.float64, requires_grad=True)
        params.append(weight)
    pull = value_penalty(labels, k)
    optimizer = torch.optim.LBFGS(
        params,
        lr=0.5,
        max_iter=100,
        tolerance_grad=1e-5,
        tolerance_change=1e-7,
        line_search_fn="strong_wolfe",
    )

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        logits = z * log_scale.exp() + bias
        if weight is not None and x is not None:
            logits = logits + x @ weight.T
        out = torch.nn.functional.cross_entropy(logits, labels)
        out = out + (pull * (bias - prior) ** 2).sum() / n
        if weight is not None:
            out = out + l2 * (weight**2).sum()
        out.backward()
        return out

    optimizer.step(loss)
    shift = bias.detach() - bias.detach().mean()  # a constant shift changes nothing; keep it centred
    return float(log_scale.detach().exp()), shift, None if weight is None else weight.detach()


def standardiser(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.mean(dim=0), x.std(dim=0, unbiased=False).clamp_min(1e-6)


def batch_prior(z: torch.Tensor) -> torch.Tensor:
    """The label-free bias: minus the log of each value's mean probability over the rows."""
    mean = torch.softmax(z.double(), dim=1).mean(dim=0)
    return -torch.log(mean.clamp_min(1e-12))


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


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The temperature that minimises the cross-entropy of softmax(logits / T) on `labels`."""
    return _temperature(logits, lambda scaled: torch.nn.functional.cross_entropy(scaled, labels))


def fit_confidence_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The temperature whose softmax's top probability best predicts whether the top value is right
    (`confidence_loss`): what ECE and abstention read. Answers unchanged."""
    return _temperature(logits, lambda scaled: confidence_loss(torch.softmax(scaled, dim=1), labels))


def confidence_loss(probabilities: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The binary log-loss of each row's top probability as the chance that its answer is right."""
    top, answer = probabilities.max(dim=1)
    right = (answer == labels).double()
    return torch.nn.functional.binary_cross_entropy(top.clamp(1e-12, 1 - 1e-12), right)


def _temperature(logits: torch.Tensor, loss_of: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """The temperature T minimising `loss_of(logits / T)` (L-BFGS on log(1 / T))."""
    inverse_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([inverse_t], lr=0.5, max_iter=100, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        out = loss_of(logits * inverse_t.exp())
        out.backward()
        return out

    optimizer.step(loss)
    return float(torch.exp(-inverse_t.detach()))


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
