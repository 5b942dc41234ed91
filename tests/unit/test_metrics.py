"""Accuracy, ECE and the other figures of an evaluation (metrics.py), on hand-checked cases."""

from __future__ import annotations

import pytest
import torch

from pcd_engine import metrics
from tests.helpers import synthetic


def test_ece_of_a_calibrated_predictor_is_near_zero_and_of_an_overconfident_one_is_not():
    z, labels = synthetic(20000, [0.0, 0.0, 0.0])
    calibrated = torch.softmax(z, dim=1).tolist()
    overconfident = torch.softmax(z * 4, dim=1).tolist()
    assert metrics.ece(calibrated, labels.tolist()) < 0.02
    assert metrics.ece(overconfident, labels.tolist()) > 0.1


def test_metrics_on_a_hand_checked_case():
    probs = [[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]]
    labels = [0, 1, 1, 0]
    assert metrics.accuracy(probs, labels) == 0.75
    # value 0: tp 2, fp 1, fn 0 -> 0.8; value 1: tp 1, fp 0, fn 1 -> 2/3
    assert metrics.macro_f1(probs, labels) == pytest.approx((0.8 + 2 / 3) / 2)
    assert metrics.confusion(probs, labels, 2) == [[2, 0], [1, 1]]
    assert metrics.majority_floor([0, 0, 1], labels) == 0.5
    curve = metrics.coverage_accuracy(probs, labels)
    assert curve[0] == {"threshold": 0.6, "coverage": 1.0, "accuracy": 0.75}
    assert curve[-1] == {"threshold": 0.9, "coverage": 0.25, "accuracy": 1.0}
