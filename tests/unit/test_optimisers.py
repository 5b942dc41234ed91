"""The L-BFGS fits every calibration method shares (optimisers.py): a value with few labels keeps its
bias near the label-free estimate."""

from __future__ import annotations

import pytest
import torch


def test_a_value_with_few_labels_keeps_its_bias_near_the_label_free_estimate():
    from pcd_engine.optimisers import batch_prior, fit_linear, value_penalty

    labels = torch.tensor([0] * 30 + [1] * 30 + [2] * 1)
    pull = value_penalty(labels, 3)
    assert pull[2] > pull[0] == pull[1]
    z = torch.zeros(61, 3, dtype=torch.float64)
    bias = fit_linear(z, labels, batch_prior(z)).bias
    # without the pull a value seen once in 61 labels would get a bias of log(1/30) below the others
    assert float(bias[0] - bias[2]) < 0.6 * float(torch.log(torch.tensor(30.0)))


def test_a_known_temperature_is_recovered_and_the_confidence_fit_keeps_every_answer():
    from pcd_engine.optimisers import fit_confidence_temperature, fit_temperature

    generator = torch.Generator().manual_seed(0)
    true_logits = torch.randn(4000, 4, generator=generator, dtype=torch.float64) * 2
    labels = torch.multinomial(torch.softmax(true_logits, dim=1), 1, generator=generator).squeeze(1)
    assert fit_temperature(true_logits * 3, labels) == pytest.approx(3.0, rel=0.1)
    t = fit_confidence_temperature(true_logits * 3, labels)
    assert t > 1.5  # overconfident logits are softened
    assert torch.equal((true_logits * 3 / t).argmax(dim=1), true_logits.argmax(dim=1))


def _reference_fit(problem, l2: float):
    """The same objective minimised by torch.optim.LBFGS with autograd, to a tight tolerance."""
    k = problem.z.shape[1]
    from pcd_engine.optimisers import value_penalty

    pull = value_penalty(problem.labels, k)
    log_scale = torch.zeros((), dtype=torch.float64, requires_grad=True)
    bias = problem.prior.clone().requires_grad_(True)
    weight = torch.zeros(k, problem.x.shape[1], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [log_scale, bias, weight], max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
        line_search_fn="strong_wolfe",
    )  # fmt: skip

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        logits = problem.z * log_scale.exp() + bias + problem.x @ weight.T
        n = len(problem.labels)
        out = torch.nn.functional.cross_entropy(logits, problem.labels)
        out = out + (pull * (bias - problem.prior) ** 2).sum() / n + l2 * (weight**2).sum()
        out.backward()
        return out

    optimizer.step(loss)
    return log_scale.detach(), bias.detach(), weight.detach()


def test_a_batch_of_fits_of_different_sizes_gives_each_problem_its_own_optimum():
    from pcd_engine.optimisers import LinearProblem, batch_prior, fit_linears

    generator = torch.Generator().manual_seed(3)
    problems = []
    for rows, dims, l2 in ((30, 12, 0.1), (45, 20, 0.01), (24, 5, 1.0), (45, 20, 0.001)):  # padded to 45 x 20
        labels = torch.arange(rows) % 3
        x = torch.randn(rows, dims, generator=generator, dtype=torch.float64)
        x[:, 0] += labels.double()
        z = torch.randn(rows, 3, generator=generator, dtype=torch.float64)
        problems.append(LinearProblem(z, labels, batch_prior(z), x, l2))
    fitted = fit_linears(problems)
    for problem, fit in zip(problems, fitted, strict=True):
        assert fit.weight is not None and fit.weight.shape == (3, problem.x.shape[1])
        log_scale, bias, weight = _reference_fit(problem, problem.l2)
        ours = torch.softmax(problem.z * fit.scale + fit.raw_bias + problem.x @ fit.weight.T, dim=1)
        best = torch.softmax(problem.z * log_scale.exp() + bias + problem.x @ weight.T, dim=1)
        assert torch.allclose(ours, best, atol=2e-3)  # the gradient tolerance (1e-4)
        assert torch.allclose(fit.raw_bias - fit.raw_bias.mean(), bias - bias.mean(), atol=2e-2)
    alone = fit_linears(problems[2:3])[0]
    assert torch.allclose(alone.raw_bias, fitted[2].raw_bias, atol=1e-3)
