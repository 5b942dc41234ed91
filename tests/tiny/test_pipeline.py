"""The pipeline's phases as public methods (pipeline.py): called one by one they give what `classify`
gives; every phase skips the inputs that failed to render; an unknown option is refused before any
model work (the options themselves: unit/test_options.py)."""

from __future__ import annotations

import pytest

from pcd_engine import InputError, PCDEngine
from pcd_engine.request import Request
from tests.helpers import Ticket

TEXTS = ["I was charged twice", "The app crashes when I log in", "hello"]


def test_the_phases_by_hand_give_classify_s_fields(engine):
    pipeline = engine.pipeline
    plan = pipeline.plan(Ticket)
    requests = pipeline.render(plan, TEXTS)
    pipeline.score(plan, requests)
    pipeline.rescore(plan, requests)
    pipeline.apply_calibration(plan, requests, abstain_below=0.9)
    for text, request in zip(TEXTS, requests, strict=True):
        assert isinstance(request, Request)
        result = engine.classify(text, Ticket, abstain_below=0.9)
        for path, field in result.fields.items():
            assert request.fields[path].value == field.value
            assert request.fields[path].abstained == field.abstained
            for value, p in field.probabilities.items():
                assert request.fields[path].probabilities[value] == pytest.approx(p, abs=1e-6)


def test_a_calibration_fitted_on_the_batch_is_phase_four_s(engine):
    plan = engine.pipeline.plan(Ticket)
    requests = engine.pipeline.render(plan, TEXTS)
    engine.pipeline.score(plan, requests)
    engine.pipeline.apply_calibration(plan, requests, batch=True)
    batched = engine.classify_batch(TEXTS, Ticket, calibrate="batch")
    for request, result in zip(requests, batched, strict=True):
        assert isinstance(request, Request) and not isinstance(result, Exception)
        by_hand = {path: f.value for path, f in request.fields.items()}
        assert by_hand == {path: f.value for path, f in result.fields.items()}
        assert all(f.calibration == "batch" for f in request.fields.values())


def test_every_phase_skips_an_input_that_failed_to_render(engine):
    plan = engine.pipeline.plan(Ticket)
    items = engine.pipeline.render(plan, [TEXTS[0], "   ", TEXTS[1]], return_exceptions=True)
    assert isinstance(items[1], InputError) and "text #1" in str(items[1])
    engine.pipeline.score(plan, items)
    engine.pipeline.rescore(plan, items)
    engine.pipeline.apply_calibration(plan, items, abstain_below=0.5)
    assert all(isinstance(items[k], Request) and items[k].fields for k in (0, 2))
    with pytest.raises(InputError):
        engine.pipeline.render(plan, ["   "])


def test_an_unknown_option_is_refused_before_any_model_work(tiny_model, tiny_tokenizer):
    engine = PCDEngine(tiny_model, tiny_tokenizer)
    with pytest.raises(TypeError, match=r"'abstain_belo'.*abstain_below"):
        engine.classify(TEXTS[0], Ticket, abstain_belo=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'temperature'"):
        engine.classify_batch(TEXTS, Ticket, temperature=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"'rules'.*plan options"):
        engine.calibrate(Ticket, TEXTS, rules="option")  # type: ignore[call-arg]
    assert engine.prefix_cache is not None and engine.prefix_cache.stats.misses == 0
