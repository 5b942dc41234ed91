"""Fitting calibrations on labeled scores (fitting.py): known biases and temperatures recovered,
batch calibration, out-of-fold figures, labels read per decision."""

from __future__ import annotations

import pytest
import torch

from pcd_engine import CalibrationError
from pcd_engine.fitting import (
    decision_labels,
    fit_batch,
    fit_labeled,
    folds_of,
    out_of_fold,
)
from pcd_engine.schema import compile_schema
from tests.helpers import Tagged, synthetic

VALUES = ("a", "b", "c")


def test_a_known_bias_is_recovered():
    bias = [1.0, -0.5, -0.5]
    z, labels = synthetic(6000, bias)
    fitted = fit_labeled("bias", VALUES, z, labels)
    assert fitted.temperature == pytest.approx(1.0, abs=0.08)
    assert list(fitted.bias) == pytest.approx(bias, abs=0.12)  # centred, as the truth is


def test_a_known_temperature_is_recovered():
    z, labels = synthetic(6000, [0.0, 0.0, 0.0])
    fitted = fit_labeled("temperature", VALUES, z * 3.0, labels)  # the rule is 3x overconfident
    assert fitted.temperature == pytest.approx(3.0, rel=0.1)
    assert fitted.bias == ()


def test_batch_calibration_evens_out_a_value_favoured_for_every_input():
    z, _ = synthetic(3000, [0.0, 0.0, 0.0])
    favoured = z + torch.tensor([2.0, 0.0, 0.0])
    fitted = fit_batch(VALUES, favoured)
    before = torch.softmax(favoured, dim=1).argmax(dim=1).bincount(minlength=3) / 3000
    after = torch.softmax(fitted.logits(favoured), dim=1).argmax(dim=1).bincount(minlength=3) / 3000
    assert before[0] > 0.6
    # it divides by each value's mean probability: the favoured value loses most of its lead
    assert after[0] < 0.5 and (after - 1 / 3).abs().max() < (before - 1 / 3).abs().max() / 2


def test_out_of_fold_probabilities_never_come_from_a_map_fitted_on_their_own_row():
    """Uninformative scores and labels that differ by fold: a map fitted on a row's own fold would
    predict its label; fitted on the other folds only, it predicts the other folds' label."""
    n, folds = 40, 4
    fold = folds_of(n, folds)
    labels = torch.tensor([0 if k == 0 else 1 for k in fold])
    z = torch.zeros(n, 2, dtype=torch.float64)
    held = out_of_fold("bias", VALUES[:2], z, labels, fold)
    predicted = held.argmax(dim=1)
    assert all(int(predicted[i]) == 1 for i in range(n) if fold[i] == 0)
    assert sorted(fold.count(k) for k in range(folds)) == [10] * 4


def test_labels_are_read_per_decision_and_bad_ones_are_refused():
    compiled = compile_schema(Tagged)
    got = decision_labels(compiled, {"topic": "crash", "tags": ["bug"]}, 0)
    assert got == {"topic": "crash", "tags[refund]": False, "tags[bug]": True}
    assert decision_labels(compiled, {"topic": "other"}, 1) == {"topic": "other"}  # partial: fine
    with pytest.raises(CalibrationError, match=r"label #3: field 'topic' is 'refund'"):
        decision_labels(compiled, {"topic": "refund"}, 3)
    with pytest.raises(CalibrationError, match="label #0 must be an object"):
        decision_labels(compiled, "crash", 0)
