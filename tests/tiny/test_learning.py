"""What the engine learns from labeled texts (learning.py) on a tiny random Llama: heads applied,
saved, loaded and refused, per-field fallbacks, and the texts worth labeling next."""

from __future__ import annotations

import json

import pytest
import torch

from pcd_engine import DEFAULT_RULE, Calibration, CalibrationError, Conversation, FieldHead, PCDEngine
from pcd_engine.calibration import weights_path
from tests.helpers import LABELED, LABELED_TEXTS, ForwardCounter, Ticket

TEXTS, LABELS = LABELED_TEXTS, LABELED


def test_a_head_in_classify_equals_its_math_on_the_kept_hidden_states(engine):
    cal = engine.calibrate(Ticket, TEXTS, LABELS, method="head", folds=3)
    assert cal.needs_hidden and all(isinstance(f, FieldHead) for f in cal.fields.values())
    plan = engine.plan(Ticket)
    ((raw_fields, hidden),) = engine.score_fields(plan, [TEXTS[0]], hidden=True)
    result = engine.classify(TEXTS[0], Ticket, calibration=cal)
    for path, f in result.fields.items():
        head = cal.fields[path]
        assert isinstance(head, FieldHead)
        z = torch.tensor(list(raw_fields[path].log_scores.values()), dtype=torch.float64)
        want = torch.softmax(head.logits(z, head.features(hidden).double()), dim=0)
        assert list(f.probabilities.values()) == pytest.approx(want.tolist(), abs=1e-6)
        assert f.calibration == "head" and f.log_scores == pytest.approx(raw_fields[path].log_scores)
    batched = engine.classify_batch(TEXTS, Ticket, calibration=cal)  # padded rows: same answers
    for text, r in zip(TEXTS, batched, strict=True):
        alone = engine.classify(text, Ticket, calibration=cal)
        for path, f in r.fields.items():
            assert f.value == alone.fields[path].value
            assert list(f.probabilities.values()) == pytest.approx(
                list(alone.fields[path].probabilities.values()), abs=1e-4
            )


def test_heads_round_trip_through_safetensors_and_refuse_changed_weights(engine, tmp_path, tiny_tokenizer):
    cal = engine.calibrate(Ticket, TEXTS, LABELS, method="head", folds=3)
    path = tmp_path / "ticket.calibration.json"
    cal.save(path)
    assert (
        weights_path(path).exists()
        and json.loads(path.read_text())["weights"]["file"] == "ticket.calibration.safetensors"
    )
    loaded = Calibration.load(path)
    for text in TEXTS[:3]:
        a = engine.classify(text, Ticket, calibration=cal)
        b = engine.classify(text, Ticket, calibration=loaded)
        for p in a.fields:
            assert a.fields[p].probabilities == pytest.approx(b.fields[p].probabilities, abs=1e-9)
    blob = bytearray(weights_path(path).read_bytes())
    blob[-1] ^= 1
    weights_path(path).write_bytes(bytes(blob))
    with pytest.raises(CalibrationError, match="not the ones it was saved with"):
        Calibration.load(path)
    weights_path(path).unlink()
    with pytest.raises(CalibrationError, match="missing"):
        Calibration.load(path)
    # the checks of any calibration still hold: another schema, prompt, rule or model is refused
    with pytest.raises(CalibrationError, match="another schema or prompt"):
        engine.classify(TEXTS[0], Ticket, calibration=cal, instructions="Label it.")
    with pytest.raises(CalibrationError, match=f"fitted with '{DEFAULT_RULE}'"):
        engine.classify(TEXTS[0], Ticket, calibration=cal, rule="option")
    from tests.helpers import tiny_llama

    other = PCDEngine(tiny_llama(len(tiny_tokenizer), seed=1), tiny_tokenizer)
    with pytest.raises(CalibrationError, match="fitted on model"):
        other.classify(TEXTS[0], Ticket, calibration=cal)


def test_head_falls_back_per_field_when_the_labels_are_too_few(engine):
    labels = [dict(label, topic="billing") for label in LABELS]
    labels[0]["topic"] = "crash"  # crash labeled once, other never: only one value labeled twice
    cal = engine.calibrate(Ticket, TEXTS, labels, method="head", folds=3)
    assert (
        not isinstance(cal.fields["topic"], FieldHead)
        and "no head" in cal.report["fields"]["topic"]["reason"]
    )
    assert isinstance(cal.fields["urgent"], FieldHead)


def test_suggest_labels_gives_best_guesses_ready_to_label(engine):
    found = engine.suggest_labels(Ticket, [*TEXTS, ""], count=4)
    assert len(found.picked) == 4 and list(found.errors) == [len(TEXTS)]
    for s in found.picked:
        assert s.text == TEXTS[s.index]
        assert Ticket.model_validate(s.label)  # a valid answer, what `calibrate` reads
        assert s.label == engine.classify(s.text, Ticket).value.model_dump(mode="json")


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda e: e.calibrate(Ticket, LABELED_TEXTS, LABELED, method="bogus"), CalibrationError, "bogus"),
        (lambda e: e.calibrate(Ticket, LABELED_TEXTS, None, method="bias"), CalibrationError, "needs labels"),
        (lambda e: e.calibrate(Ticket, LABELED_TEXTS, LABELED, folds=1), CalibrationError, "folds"),
        (lambda e: e.suggest_labels(Ticket, LABELED_TEXTS, count=0), ValueError, "count"),
        (lambda e: e.suggest_labels(Ticket, LABELED_TEXTS, by="vibes"), ValueError, "by must be"),
    ],
)
def test_learning_arguments_are_checked_before_any_text_is_scored(engine, call, error, match):
    counter = ForwardCounter(engine.model.model)
    try:
        with pytest.raises(error, match=match):
            call(engine)
    finally:
        counter.close()
    assert counter.rows == []


def test_one_user_turn_is_the_plain_string_and_a_conversation_s_system_text_its_instructions(engine):
    text = LABELED_TEXTS[0]
    plain = engine.classify(text, Ticket, instructions="Route it.")
    asked = engine.classify(Conversation.of([("system", "Route it."), ("user", text)]), Ticket)
    assert asked.value == plain.value
    for path, field in plain.fields.items():
        assert asked.fields[path].log_scores == pytest.approx(field.log_scores, abs=1e-6)
    mixed = engine.classify_batch([text, Conversation.of([("system", "Route it."), ("user", text)])], Ticket)
    assert mixed[0].fields["topic"].log_scores == pytest.approx(
        engine.classify(text, Ticket).fields["topic"].log_scores, abs=1e-5
    )  # each input planned with its own system text, answered in order
    assert mixed[1].fields["topic"].log_scores == pytest.approx(plain.fields["topic"].log_scores, abs=1e-5)


def test_a_mixed_system_batch_names_each_bad_input_by_its_own_index_and_an_empty_batch_checks_the_schema(
    engine,
):
    from pcd_engine import InputError, UnsupportedSchemaError

    routed = Conversation.of([("system", "Route it."), ("user", LABELED_TEXTS[0])])
    answered = engine.classify_batch([routed, LABELED_TEXTS[1], "  "], Ticket, return_exceptions=True)
    assert isinstance(answered[2], InputError) and "text #2" in str(answered[2])
    assert not isinstance(answered[0], InputError) and not isinstance(answered[1], InputError)
    with pytest.raises(UnsupportedSchemaError):
        engine.classify_batch(
            [], {"type": "object", "properties": {"x": {"type": "array"}}}, allow_generation=False
        )
