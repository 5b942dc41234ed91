"""Calibration, abstention and in-context examples: the math on synthetic scores, then the engine on
a tiny random Llama (what is applied, what is refused, what the head holds)."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest
import torch
from pydantic import BaseModel

from pcd_engine import DEFAULT_RULE, AbstentionError, Calibration, CalibrationError, PCDEngine, metrics
from pcd_engine.fitting import (
    LOG_LOSS_TIE,
    decision_labels,
    fit_batch,
    fit_labeled,
    folds_of,
    out_of_fold,
)
from pcd_engine.schema import compile_schema

VALUES = ("a", "b", "c")


class Ticket(BaseModel):
    topic: Literal["billing", "crash", "other"]
    urgent: bool


class Tagged(BaseModel):
    topic: Literal["billing", "crash", "other"]
    tags: list[Literal["refund", "bug"]]


TEXTS = [
    "I was charged twice for my order",
    "The app crashes when I log in",
    "Where is my parcel?",
    "please refund me",
    "How do I change my password?",
    "charged twice, app crashes",
]
LABELS = [
    {"topic": "billing", "urgent": True},
    {"topic": "crash", "urgent": True},
    {"topic": "other", "urgent": False},
    {"topic": "billing", "urgent": False},
    {"topic": "other", "urgent": False},
    {"topic": "crash", "urgent": True},
]


def synthetic(n: int, bias: list[float], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores z, and labels drawn from softmax(z + bias): the rule is miscalibrated by `bias`."""
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(n, len(bias), generator=generator, dtype=torch.float64) * 2
    labels = torch.multinomial(torch.softmax(z + torch.tensor(bias), dim=1), 1, generator=generator)
    return z, labels[:, 0]


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


def test_examples_sit_in_the_cached_head_and_cost_nothing_after_the_first_call(engine):
    examples = [(TEXTS[0], LABELS[0]), (TEXTS[1], Ticket(**LABELS[1]))]
    plan = engine.plan(Ticket, examples=examples)
    bare = engine.plan(Ticket)
    assert plan.head != bare.head and plan.fingerprint != bare.fingerprint
    # the head is exactly the chat template's rendering of the examples as earlier turns
    answer = json.dumps(LABELS[0])
    turns = [("system", plan.system), ("user", TEXTS[0]), ("assistant", answer)]
    turns += [("user", TEXTS[1]), ("assistant", json.dumps(LABELS[1])), ("user", "TEXT")]
    whole = engine.prompt.render_messages(turns)
    assert whole == [*plan.head, *engine.prompt.encode_text("TEXT"), *engine.prompt.tail]
    first = engine.classify(TEXTS[2], Ticket, examples=examples)
    second = engine.classify(TEXTS[3], Ticket, examples=examples)
    assert second.diagnostics.prefix_cache_hit
    assert second.diagnostics.cached_tokens >= len(plan.head)
    assert second.diagnostics.forward_calls == 1
    assert first.fields["topic"].log_scores != engine.classify(TEXTS[2], Ticket).fields["topic"].log_scores


def test_a_schema_can_carry_default_examples_and_bad_examples_are_input_errors(engine):
    from typing import ClassVar

    from pcd_engine import InputError

    class WithExamples(Ticket):
        pcd_examples: ClassVar[list[tuple[str, dict]]] = [(TEXTS[0], LABELS[0])]

    assert engine.plan(WithExamples).examples == ((TEXTS[0], json.dumps(LABELS[0])),)
    assert engine.plan(WithExamples, examples=[]).examples == ()
    with pytest.raises(InputError, match=r"example #0: the answer is not a valid Ticket"):
        engine.classify(TEXTS[0], Ticket, examples=[(TEXTS[0], {"topic": "nope", "urgent": True})])
    with pytest.raises(InputError, match="example #1 must be a"):
        engine.classify(TEXTS[0], Ticket, examples=[(TEXTS[0], LABELS[0]), "just text"])


def test_code_rule_examples_answer_with_codes(engine):
    plan = engine.plan(Ticket, rule="code", examples=[(TEXTS[0], LABELS[0])])
    assert plan.examples == ((TEXTS[0], '{"topic": "A", "urgent": true}'),)
    decoded = engine.tokenizer.decode(list(plan.head))
    assert '{"topic": "A", "urgent": true}' in decoded


def test_the_plain_wording_writes_field_lines_and_scores_labels_after_a_space(tiny_model, tiny_tokenizer):
    plain = PCDEngine(tiny_model, tiny_tokenizer, branch_wording="plain")
    plan = plain.plan(Tagged, examples=[(TEXTS[0], {"topic": "billing", "tags": ["refund"]})])
    decode = tiny_tokenizer.decode
    topic = plan.trees[0]
    assert [decode(list(topic.continuation(c))) for c in range(3)] == [" billing\n", " crash\n", " other\n"]
    assert plan.examples[0][1] == "topic: billing\ntags.refund: true\ntags.bug: false"
    assert "field: value" in plan.system
    json_plan = PCDEngine(tiny_model, tiny_tokenizer).plan(Tagged)
    assert decode(list(json_plan.trees[0].continuation(0))) == 'billing"}'  # the quote joins the prefix
    assert plan.fingerprint != json_plan.fingerprint
    result = plain.classify(TEXTS[0], Tagged)
    assert set(result.fields) == {"topic", "tags[refund]", "tags[bug]"}
    with pytest.raises(ValueError, match="unknown branch wording"):
        PCDEngine(tiny_model, tiny_tokenizer, branch_wording="yaml")


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
