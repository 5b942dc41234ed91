"""The optimisers every calibration method shares: L-BFGS fits of a linear map of the rule's
log-scores (`fit_linear`: scale, per-value bias, optionally weights on features) and of a temperature
(`fit_temperature` on the log-loss, `fit_confidence_temperature` on the top answer's confidence).
`fitting.py` fits the bias and temperature maps with them, `heads.py` its heads.

    >>> import torch
    >>> round(fit_temperature(torch.tensor([[4.0, 0.0], [4.0, 0.0]]), torch.tensor([0, 1])), 1) > 1.0
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BIAS_L2 = 1.0  # a value's bias penalty is BIAS_L2 * (1 + (rows / values) / (its labels + 1)) / rows


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
