"""An engine measured on labeled texts (evaluation.py): every text counted, and re-calibrating the
kept scores equals classifying with the calibration."""

from __future__ import annotations

import pytest

from tests.helpers import LABELED, LABELED_TEXTS, Ticket

TEXTS, LABELS = LABELED_TEXTS[:6], LABELED[:6]


def test_evaluate_counts_every_text_and_recalibrating_equals_classifying_with_the_calibration(engine):
    from pcd_engine import evaluate

    texts = [*TEXTS, 42]  # a bad input gets an error record, not a silent drop
    labels = [*LABELS, LABELS[0]]
    evaluation = evaluate(engine, Ticket, texts, labels)
    summary = evaluation.summary
    assert summary["texts"] == 7 and summary["answered"] == 6 and summary["errors"] == 1
    assert evaluation.errors[0]["index"] == 6 and evaluation.errors[0]["type"] == "InputError"
    topic = evaluation.fields["topic"]
    assert len(topic.labels) == 6 and topic.report()["confusion"]["values"] == ["billing", "crash", "other"]
    cal = engine.calibrate(Ticket, TEXTS, LABELS, method="bias", folds=3)
    again = evaluation.recalibrated(cal)
    direct = engine.classify_batch(TEXTS, Ticket, calibration=cal)
    for probs, result in zip(again.fields["topic"].probabilities, direct, strict=True):
        assert probs == pytest.approx(list(result.fields["topic"].probabilities.values()), abs=1e-6)
    right = [r.fields["topic"].value == y["topic"] for r, y in zip(direct, LABELS, strict=True)]
    assert again.fields["topic"].report()["accuracy"] == pytest.approx(sum(right) / 6)


def test_evaluate_each_answers_each_calibration_as_evaluate_with_it_does(engine):
    from pcd_engine import evaluate, evaluate_each

    calibration = engine.calibrate(Ticket, TEXTS, LABELS, method="bias", folds=3)
    each = evaluate_each(
        engine, Ticket, [*TEXTS, 42], [*LABELS, LABELS[0]], {"none": None, "bias": calibration}
    )
    assert set(each) == {"none", "bias"} and each["bias"].errors[0]["index"] == 6
    for name, options in (("none", {}), ("bias", {"calibration": calibration})):
        direct = evaluate(engine, Ticket, TEXTS, LABELS, **options)
        for path, f in direct.fields.items():
            got = each[name].fields[path]
            assert got.labels == f.labels
            for mine, theirs in zip(got.probabilities, f.probabilities, strict=True):
                assert mine == pytest.approx(theirs, abs=1e-6)
    assert each["bias"].summary != each["none"].summary
