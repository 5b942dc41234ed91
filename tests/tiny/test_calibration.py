"""Calibrations on the engine (calibration.py), on a tiny random Llama: applied, saved and loaded,
refused for another schema, rule, model or precision; batch calibration; abstention. The fitting
itself is in unit/test_fitting.py, examples in test_plan.py."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pcd_engine import DEFAULT_RULE, AbstentionError, Calibration, CalibrationError, PCDEngine
from pcd_engine.fitting import (
    LOG_LOSS_TIE,
)
from tests.helpers import LABELED, LABELED_TEXTS, Tagged, Ticket

TEXTS, LABELS = LABELED_TEXTS[:6], LABELED[:6]


def test_a_fitted_calibration_is_applied_and_survives_save_and_load(engine, tmp_path):
    cal = engine.calibrate(Ticket, TEXTS, LABELS, method="bias", folds=3)
    assert set(cal.fields) == {"topic", "urgent"}
    report = cal.report["fields"]["topic"]
    assert report["method"] == "bias" and report["n"] == 6
    assert set(report["before"]) == {"n", "accuracy", "macro_f1", "ece", "log_loss"}
    cal.save(tmp_path / "cal.json")
    loaded = Calibration.load(tmp_path / "cal.json")
    assert loaded == cal
    raw = engine.classify(TEXTS[0], Ticket)
    result = engine.classify(TEXTS[0], Ticket, calibration=loaded)
    for path, f in result.fields.items():
        assert f.calibration == "bias" and f.calibrated
        assert f.log_scores == raw.fields[path].log_scores  # the rule's scores stay available
        assert f.raw_probabilities == pytest.approx(raw.fields[path].probabilities)
        z = torch.tensor(list(f.log_scores.values()), dtype=torch.float64)
        want = torch.softmax(z / cal.fields[path].temperature + torch.tensor(cal.fields[path].bias), dim=0)
        assert list(f.probabilities.values()) == pytest.approx(want.tolist())
        assert f.value == max(f.probabilities, key=f.probabilities.__getitem__)
    assert result.value.topic == result.fields["topic"].value


def test_auto_picks_the_lowest_cross_validated_log_loss_that_keeps_accuracy(engine):
    cal = engine.calibrate(Ticket, TEXTS, LABELS, folds=3)
    for report in cal.report["fields"].values():
        cv = report["cv"]
        assert set(cv) == {"none", "temperature", "bias", "batch", "head"}  # every value labeled twice
        safe = [
            m
            for m, r in cv.items()
            if r["accuracy"] >= cv["none"]["accuracy"] and r["macro_f1"] >= cv["none"]["macro_f1"]
        ]
        assert report["method"] in safe
        assert cv[report["method"]]["log_loss"] <= min(cv[m]["log_loss"] for m in safe) + LOG_LOSS_TIE
        assert "not below none's" in report["reason"]


def test_a_calibration_is_refused_for_another_schema_rule_model_or_prompt(engine, tmp_path, tiny_tokenizer):
    from tests.helpers import tiny_llama

    cal = engine.calibrate(Ticket, TEXTS[:4], LABELS[:4], method="temperature", folds=2)
    with pytest.raises(CalibrationError, match="another schema or prompt"):
        engine.classify(TEXTS[0], Tagged, calibration=cal)
    with pytest.raises(CalibrationError, match="another schema or prompt"):
        engine.classify(TEXTS[0], Ticket, calibration=cal, instructions="Label the ticket.")
    fitted_with = f"'option', but the calibration was fitted with '{DEFAULT_RULE}'"
    with pytest.raises(CalibrationError, match=fitted_with):
        engine.classify(TEXTS[0], Ticket, calibration=cal, rule="option")
    other = PCDEngine(tiny_llama(len(tiny_tokenizer), seed=1), tiny_tokenizer)
    with pytest.raises(CalibrationError, match="fitted on model"):
        other.classify(TEXTS[0], Ticket, calibration=cal)
    (tmp_path / "broken.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CalibrationError, match="cannot load"):
        Calibration.load(tmp_path / "broken.json")


def test_the_same_weights_in_another_dtype_are_the_same_model_but_not_the_same_scores(
    engine, tiny_model, tmp_path
):
    import copy

    half = copy.deepcopy(tiny_model).to(torch.bfloat16)
    bf16 = PCDEngine(half, engine.tokenizer, self_check=False)
    assert engine.model_identity.matches(bf16.model_identity)
    assert (engine.precision, bf16.precision) == ("float32", "bfloat16")
    mixed = PCDEngine(half, engine.tokenizer, self_check=False, reference_model=tiny_model)
    assert mixed.precision == "bfloat16, fp32 re-scoring below 0.2"
    fitted = engine.calibrate(Ticket, TEXTS, method="batch")
    fitted.save(tmp_path / "fp32.json")
    loaded = Calibration.load(tmp_path / "fp32.json")
    assert loaded.model.precision == "float32"
    engine.classify(TEXTS[0], Ticket, calibration=loaded)
    for other in (bf16, mixed):
        with pytest.raises(
            CalibrationError,
            match=re.escape(f"computed in float32, and this engine computes them in {other.precision}"),
        ):
            other.classify(TEXTS[0], Ticket, calibration=loaded)
    bf16.classify(TEXTS[0], Ticket, calibration=bf16.calibrate(Ticket, TEXTS, method="batch"))
    from minicpm_pcd_adapters.server.calibrations import Calibrations  # pcd serve --calibration

    assert Calibrations(engine, [str(tmp_path / "fp32.json")]).by_name
    with pytest.raises(
        CalibrationError, match=re.escape("fp32.json was fitted on scores computed in float32")
    ):
        Calibrations(bf16, [str(tmp_path / "fp32.json")])


def test_batch_calibration_within_a_batch_equals_fitting_it_on_those_texts(engine):
    cal = engine.calibrate(Ticket, TEXTS, method="batch")
    batched = engine.classify_batch(TEXTS, Ticket, calibrate="batch")
    for result, text in zip(batched, TEXTS, strict=True):
        alone = engine.classify(text, Ticket, calibration=cal)
        for path, f in result.fields.items():
            assert f.calibration == "batch"
            # padded batch rows and a lone pass differ by float rounding only
            assert f.probabilities == pytest.approx(alone.fields[path].probabilities, abs=1e-5)
    with pytest.raises(CalibrationError, match="at least 2 texts"):
        engine.classify_batch(TEXTS[:1], Ticket, calibrate="batch")
    with pytest.raises(CalibrationError, match="either a calibration or"):
        engine.classify_batch(TEXTS, Ticket, calibrate="batch", calibration=cal)


def test_label_errors_come_before_any_model_work(engine):
    with pytest.raises(CalibrationError, match="2 texts but 1 labels"):
        engine.calibrate(Ticket, TEXTS[:2], LABELS[:1])
    with pytest.raises(CalibrationError, match=r"label #1: field 'urgent'"):
        engine.calibrate(Ticket, TEXTS[:2], [LABELS[0], {"topic": "other", "urgent": "maybe"}])
    with pytest.raises(CalibrationError, match="needs labels"):
        engine.calibrate(Ticket, TEXTS, method="bias")


def test_abstention_flags_fields_below_the_threshold_and_can_raise(engine):
    everything = engine.classify(TEXTS[0], Ticket, abstain_below=1.0)
    assert everything.abstained_fields == ["topic", "urgent"] and everything.needs_review
    assert everything.to_json()["needs_review"] is True
    nothing = engine.classify(TEXTS[0], Ticket, abstain_below=0.0)
    assert nothing.abstained_fields == [] and not nothing.needs_review
    threshold = everything.fields["topic"].confidence
    split = engine.classify(TEXTS[0], Ticket, abstain_below=threshold + 1e-9)
    assert "topic" in split.abstained_fields
    with pytest.raises(AbstentionError) as raised:
        engine.classify(TEXTS[0], Ticket, abstain_below=1.0, on_abstain="raise")
    assert raised.value.result.value == everything.value
    assert "'topic'" in str(raised.value)
    batch = engine.classify_batch(
        TEXTS[:3], Ticket, abstain_below=1.0, on_abstain="raise", return_exceptions=True
    )
    assert all(isinstance(item, AbstentionError) for item in batch)
    with pytest.raises(ValueError, match="abstain_below must be a probability"):
        engine.classify(TEXTS[0], Ticket, abstain_below=1.5)
    default = PCDEngine(engine.model, engine.tokenizer, abstain_below=1.0)
    assert default.classify(TEXTS[0], Ticket).needs_review
