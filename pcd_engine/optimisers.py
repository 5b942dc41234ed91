"""The optimisers every calibration method shares: L-BFGS fits of a linear map of the rule's
log-scores (`fit_linear`: scale, per-value bias, optionally weights on features; `fit_linears`:
many such fits at once, `batched_lbfgs`) and Newton fits of a temperature (`fit_temperature` on the
log-loss, `fit_confidence_temperature` on the top answer's confidence). `fitting.py` fits the bias
and temperature maps with them, `heads.py` its heads.

    >>> import torch
    >>> round(fit_temperature(torch.tensor([[4.0, 0.0], [4.0, 0.0]]), torch.tensor([0, 1])), 1) > 1.0
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

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
    start (a fit of the same rows with another `l2`, or of nearly the same rows)."""
    return fit_linears([LinearProblem(z, labels, prior, x, l2, start)])[0]


@dataclass(frozen=True)
class LinearProblem:
    """One `fit_linear` fit: rows of log-scores (n, K), their labels, the bias's label-free prior,
    optionally features (n, D) with their L2 strength, and a warm start."""

    z: torch.Tensor
    labels: torch.Tensor
    prior: torch.Tensor
    x: torch.Tensor | None = None
    l2: float = 0.0
    start: Linear | None = None


def fit_linears(problems: Sequence[LinearProblem]) -> list[Linear]:
    """`fit_linear` for many problems at once, each its own fit: the problems with the same number
    of values (and features, or none) are padded to one batch and solved by `batched_lbfgs`, so a
    head's hundreds of small fits (folds, blocks, fields) cost a few dozen steps of a few batched
    losses instead of a few dozen steps each."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, p in enumerate(problems):
        groups.setdefault((p.z.shape[1], p.x is None), []).append(i)
    out: dict[int, Linear] = {}
    for members in groups.values():
        out.update(zip(members, _fit_alike([problems[i] for i in members]), strict=True))
    return [out[i] for i in range(len(problems))]


def _fit_alike(problems: Sequence[LinearProblem]) -> list[Linear]:
    """`fit_linears` for problems with the same number of values, all with features or none."""
    k = problems[0].z.shape[1]
    batch, n = len(problems), max(p.z.shape[0] for p in problems)
    dims = [0 if p.x is None else p.x.shape[1] for p in problems]
    d = max(dims)
    z = torch.zeros(batch, n, k, dtype=torch.float64)
    onehot = torch.zeros(batch, n, k, dtype=torch.float64)
    x = torch.zeros(batch, n, d, dtype=torch.float64)
    rows = torch.tensor([p.z.shape[0] for p in problems], dtype=torch.float64)
    prior = torch.stack([p.prior.double() for p in problems])
    pull = torch.stack([value_penalty(p.labels, k) for p in problems])
    l2 = torch.tensor([p.l2 for p in problems], dtype=torch.float64)
    theta = torch.zeros(batch, 1 + k + k * d, dtype=torch.float64)
    for b, p in enumerate(problems):  # padded rows have no label (they weigh nothing), padded
        m = p.z.shape[0]  # features are 0 (their weights stay 0)
        z[b, :m] = p.z.double()
        onehot[b, :m] = torch.nn.functional.one_hot(p.labels, k).double()
        if p.x is not None:
            x[b, :m, : dims[b]] = p.x.double()
        theta[b, 1 : 1 + k] = p.prior.double()
        if p.start is not None:
            theta[b, 0] = p.start.log_scale
            theta[b, 1 : 1 + k] = p.start.raw_bias.double()
            if p.start.weight is not None and p.x is not None:
                weight = torch.zeros(k, d, dtype=torch.float64)
                weight[:, : dims[b]] = p.start.weight.double()
                theta[b, 1 + k :] = weight.flatten()
    real = onehot.sum(dim=2, keepdim=True)  # 1 on a problem's own rows, 0 on padding
    loss = SoftmaxLoss(z, onehot, real, x, rows, prior, pull, l2)
    theta = batched_lbfgs(loss, theta)
    out = []
    for b, p in enumerate(problems):
        fitted = theta[b, 1 + k :].view(k, d)[:, : dims[b]].clone() if p.x is not None else None
        out.append(Linear(float(theta[b, 0]), theta[b, 1 : 1 + k].clone(), fitted))
    return out


@dataclass(frozen=True)
class SoftmaxLoss:
    """`_fit_alike`'s batched loss: per problem, the mean cross-entropy of `scale * z + bias + x W^T`
    over its own rows, the bias's pull and W's L2 penalty, with the gradient written out (the
    softmax cross-entropy's) instead of autograd. Parameters per problem: log-scale, bias (K), W
    (K x D) flattened. `subset` keeps some problems (to stop computing those that converged)."""

    z: torch.Tensor  # (B, n, K), padded rows 0
    onehot: torch.Tensor  # (B, n, K), padded rows 0
    real: torch.Tensor  # (B, n, 1): 1 on a problem's own rows
    x: torch.Tensor  # (B, n, D), padded rows and dimensions 0
    rows: torch.Tensor  # (B,) rows per problem
    prior: torch.Tensor  # (B, K)
    pull: torch.Tensor  # (B, K)
    l2: torch.Tensor  # (B,)

    def subset(self, keep: torch.Tensor) -> SoftmaxLoss:
        return SoftmaxLoss(*(getattr(self, f.name)[keep] for f in dataclasses.fields(self)))

    def __call__(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, k, d = self.z.shape[0], self.z.shape[2], self.x.shape[2]
        z, onehot, x, rows = self.z, self.onehot, self.x, self.rows
        log_scale, bias = theta[:, 0], theta[:, 1 : 1 + k]
        weight = theta[:, 1 + k :].view(batch, k, d)
        scale = log_scale.exp()
        logits = z * scale[:, None, None] + bias[:, None, :]
        if d:
            logits = logits + torch.bmm(x, weight.transpose(1, 2))
        log_p = torch.log_softmax(logits, dim=2)
        drift = bias - self.prior
        out = (-(log_p * onehot).sum(dim=(1, 2)) + (self.pull * drift**2).sum(dim=1)) / rows
        out = out + self.l2 * (weight**2).sum(dim=(1, 2))
        residual = (log_p.exp() * self.real - onehot) / rows[:, None, None]  # d(mean CE) / d(logits)
        grad = torch.empty_like(theta)
        grad[:, 0] = (residual * z).sum(dim=(1, 2)) * scale
        grad[:, 1 : 1 + k] = residual.sum(dim=1) + 2 * self.pull * drift / rows[:, None]
        if d:
            penalty = 2 * self.l2[:, None, None] * weight
            grad[:, 1 + k :] = (torch.bmm(residual.transpose(1, 2), x) + penalty).flatten(1)
        return out, grad


class BatchedLoss(Protocol):
    """Per problem, the loss (B,) and its gradient (B, P) at parameters (B, P); `subset(keep)`: the
    same for the problems `keep` marks."""

    def __call__(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def subset(self, keep: torch.Tensor) -> BatchedLoss: ...


def batched_lbfgs(
    loss: BatchedLoss,
    theta: torch.Tensor,
    max_iter: int = 100,
    tolerance_grad: float = 1e-4,
    tolerance_change: float = 1e-6,
    history: int = 10,
) -> torch.Tensor:
    """Minimise B independent smooth problems at once: `loss(theta)` maps parameters (B, P) to each
    problem's loss (B,) and gradient (B, P). Each problem has its own L-BFGS memory (`history`
    pairs), its own backtracking (Armijo) step and its own stopping test, as `torch.optim.LBFGS`
    would fit it alone (a gradient of at most `tolerance_grad`, or a step or loss change under
    `tolerance_change`); a problem that stopped keeps its parameters while the others go on. One
    `torch.optim.LBFGS` over all problems' parameters would share one line search and one curvature
    estimate, and take ten times the steps. Once a quarter of the problems still running have
    stopped, the batch keeps only the others (`loss.subset`): the slowest few do not make every
    step cost the whole batch."""
    out, index = theta.clone(), torch.arange(theta.shape[0])  # index: each row's problem in `out`
    f, g = loss(theta)
    done = g.abs().amax(dim=1) <= tolerance_grad
    steps_s: list[torch.Tensor] = []
    steps_y: list[torch.Tensor] = []
    rho: list[torch.Tensor] = []
    gamma = torch.ones_like(f)
    for iteration in range(max_iter):
        if bool(done.all()):
            break
        if 4 * int(done.sum()) >= len(done):  # a quarter stopped: keep only the others
            out[index[done]] = theta[done]
            keep = ~done
            index, theta, f, g, gamma, done = (
                index[keep],
                theta[keep],
                f[keep],
                g[keep],
                gamma[keep],
                done[keep],
            )
            steps_s, steps_y, rho = (
                [s[keep] for s in steps_s],
                [y[keep] for y in steps_y],
                [r[keep] for r in rho],
            )
            loss = loss.subset(keep)
        q = g.clone()
        alpha = []
        for s, y, r in zip(reversed(steps_s), reversed(steps_y), reversed(rho), strict=True):
            a = r * (s * q).sum(dim=1)
            q -= a[:, None] * y
            alpha.append(a)
        direction = q * gamma[:, None]
        for s, y, r, a in zip(steps_s, steps_y, rho, reversed(alpha), strict=True):
            b = r * (y * direction).sum(dim=1)
            direction += (a - b)[:, None] * s
        direction = -direction
        slope = (g * direction).sum(dim=1)
        uphill = slope >= 0  # lost curvature: start that problem over along its gradient
        direction = torch.where(uphill[:, None], -g, direction)
        slope = torch.where(uphill, -(g * g).sum(dim=1), slope)
        # a first step along the gradient is scaled as torch.optim.LBFGS scales it, later ones are 1
        cautious = (1.0 / g.abs().sum(dim=1).clamp_min(1e-300)).clamp(max=1.0)
        step = torch.where(uphill | (iteration == 0), cautious, torch.ones_like(f))
        step = torch.where(done, torch.zeros_like(step), step)
        new_f, new_g, new_theta = f.clone(), g.clone(), theta.clone()
        accepted = done.clone()
        for _ in range(30):
            trial = theta + step[:, None] * direction
            trial_f, trial_g = loss(trial)
            ok = ~accepted & (trial_f <= f + 1e-4 * step * slope)
            new_f = torch.where(ok, trial_f, new_f)
            new_g = torch.where(ok[:, None], trial_g, new_g)
            new_theta = torch.where(ok[:, None], trial, new_theta)
            accepted |= ok
            if bool(accepted.all()):
                break
            step = torch.where(accepted, step, step / 2)
        stalled = ~accepted  # no step lowered the loss: at the optimum within float precision
        moved = ~done & accepted
        s, y = new_theta - theta, new_g - g
        ys = (y * s).sum(dim=1)
        useful = moved & (ys > 1e-10)
        if bool(useful.any()):
            steps_s.append(torch.where(useful[:, None], s, torch.zeros_like(s)))
            steps_y.append(torch.where(useful[:, None], y, torch.zeros_like(y)))
            rho.append(torch.where(useful, 1.0 / ys.clamp_min(1e-10), torch.zeros_like(ys)))
            gamma = torch.where(useful, ys / (y * y).sum(dim=1).clamp_min(1e-300), gamma)
            if len(steps_s) > history:
                steps_s.pop(0), steps_y.pop(0), rho.pop(0)
        small = (step[:, None] * direction).abs().amax(dim=1) <= tolerance_change
        flat = (new_f - f).abs() < tolerance_change
        done = done | stalled | (moved & ((new_g.abs().amax(dim=1) <= tolerance_grad) | small | flat))
        theta, f, g = new_theta, new_f, new_g
    out[index] = theta
    return out


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
    """The temperature T minimising `loss_of(logits / T)`: Newton's method on u = log(1 / T), its
    first and second derivatives by autograd, each step halved until the loss does not rise (a
    gradient step where the curvature is not positive); it stops at a step under 1e-9."""

    def at(u: torch.Tensor) -> torch.Tensor:
        return loss_of(logits * u.exp())

    u = torch.zeros((), dtype=torch.float64)
    for _ in range(100):
        point = u.clone().requires_grad_(True)
        value = at(point)
        (slope,) = torch.autograd.grad(value, point, create_graph=True)
        (curvature,) = torch.autograd.grad(slope, point, allow_unused=True)
        with torch.no_grad():
            newton = curvature is not None and float(curvature) > 1e-12
            step = (-slope / curvature if newton else -slope).clamp(-1.0, 1.0)
            for _ in range(40):
                if float(at(u + step)) <= float(value):
                    break
                step = step / 2
            else:
                break
            u = u + step
            if abs(float(step)) < 1e-9:
                break
    return float(torch.exp(-u))
