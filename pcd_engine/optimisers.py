"""The optimisers every calibration method shares: L-BFGS fits of a linear map of the rule's
log-scores (`fit_linear`: scale, per-value bias, optionally weights on features) and of a temperature
(`fit_temperature` on the log-loss, `fit_confidence_temperature` on the top answer's confidence).
`fitting.py` fits the bias and temperature maps with them, `heads.py` its heads.

    >>> import torch
    >>> round(fit_temperature(torch.tensor([[4.0, 0.0], [4.0, 0.0]]), torch.tensor([0, 1])), 1) > 1.0
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

BIAS_L2 = 1.0  # a value's bias penalty is BIAS_L2 * (1 + (rows / values) / (its labels + 1)) / rows


def value_penalty(labels: torch.Tensor, values: int) -> torch.Tensor:
    """Per value, the weight of its bias's pull toward the label-free estimate: stronger for a value
    with few labels (a value never labeled weighs 1 + rows / values times a balanced one's base)."""
    counts = torch.bincount(labels, minlength=values).double()
    return BIAS_L2 * (1.0 + (len(labels) / values) / (counts + 1.0))


@dataclass(frozen=True)
class Linear:
    """A fitted linear map of log-scores: `scale * z + bias (+ x @ weight.T)`. `log_scale` and the
    uncentred `raw_bias` are where the optimiser stopped: a warm start for a nearby fit."""

    log_scale: float
    raw_bias: torch.Tensor  # (K,)
    weight: torch.Tensor | None  # (K, D)

    @property
    def scale(self) -> float:
        return math.exp(self.log_scale)

    @property
    def bias(self) -> torch.Tensor:
        """The bias, centred (a constant shift changes no probability)."""
        return self.raw_bias - self.raw_bias.mean()


def fit_linear(
    z: torch.Tensor,
    labels: torch.Tensor,
    prior: torch.Tensor,
    x: torch.Tensor | None = None,
    l2: float = 0.0,
    start: Linear | None = None,
) -> Linear:
    """The map minimising the mean cross-entropy of `scale * z + bias (+ W x)` plus the bias pull
    toward `prior` (`value_penalty`) and `l2 * sum(W**2)`; x already standardised. `start`: a warm
    start (a fit of the same rows with another `l2`, or of nearly the same rows). L-BFGS on the
    gradient written out (the softmax cross-entropy's), without autograd: these fits are small and
    many (a head's cross-validation runs hundreds), so the per-step overhead is what they cost."""
    n, k = z.shape
    z, prior = z.double(), prior.double()
    onehot = torch.nn.functional.one_hot(labels, k).double()
    pull = value_penalty(labels, k)
    log_scale = torch.tensor(0.0 if start is None else start.log_scale, dtype=torch.float64)
    bias = (prior if start is None else start.raw_bias).clone().double()
    params = [log_scale, bias]
    weight = None
    if x is not None:
        x = x.double()
        weight = torch.zeros(k, x.shape[1], dtype=torch.float64)
        if start is not None and start.weight is not None:
            weight = start.weight.clone().double()
        params.append(weight)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.LBFGS(
        params,
        lr=1.0,
        max_iter=100,
        tolerance_grad=1e-4,  # hundreds of fits per head: 1e-5 / 1e-7 took a third more steps
        tolerance_change=1e-6,  # for the same answers (docs/benchmarks.md)
        history_size=10,
        line_search_fn="strong_wolfe",
    )

    def loss() -> torch.Tensor:
        scale = log_scale.exp()
        logits = z * scale + bias
        if weight is not None and x is not None:
            logits = logits + x @ weight.T
        log_p = torch.log_softmax(logits, dim=1)
        out = -(log_p * onehot).sum() / n + (pull * (bias - prior) ** 2).sum() / n
        residual = (log_p.exp() - onehot) / n  # d(mean cross-entropy) / d(logits)
        assert log_scale.grad is not None and bias.grad is not None
        log_scale.grad.copy_((residual * z).sum() * scale)
        bias.grad.copy_(residual.sum(dim=0) + 2 * pull * (bias - prior) / n)
        if weight is not None and x is not None:
            out = out + l2 * (weight**2).sum()
            assert weight.grad is not None
            weight.grad.copy_(residual.T @ x + 2 * l2 * weight)
        return out

    with torch.no_grad():
        optimizer.step(loss)
    return Linear(float(log_scale), bias, weight)


def standardiser(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.mean(dim=0), x.std(dim=0, unbiased=False).clamp_min(1e-6)


def batch_prior(z: torch.Tensor) -> torch.Tensor:
    """The label-free bias: minus the log of each value's mean probability over the rows."""
    mean = torch.softmax(z.double(), dim=1).mean(dim=0)
    return -torch.log(mean.clamp_min(1e-12))


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
