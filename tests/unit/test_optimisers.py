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
