"""The per-call options declared once (options.py): every public call takes them as keyword arguments
and none writes them out again; the checked record holds exactly the declared options."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from pcd_engine import ClassifyOptions, PCDEngine, PlanOptions
from pcd_engine.options import RequestOptions


def test_the_options_are_declared_once_and_every_call_takes_them():
    assert set(PlanOptions.__optional_keys__) == {"instructions", "rule", "allow_generation", "examples"}
    assert set(ClassifyOptions.__optional_keys__) > set(PlanOptions.__optional_keys__)
    for method, options in [
        (PCDEngine.classify, ClassifyOptions),
        (PCDEngine.classify_batch, ClassifyOptions),
        (PCDEngine.plan, PlanOptions),
        (PCDEngine.calibrate, PlanOptions),
        (PCDEngine.suggest_labels, PlanOptions),
    ]:
        parameters = inspect.signature(method).parameters
        assert parameters["options"].kind is inspect.Parameter.VAR_KEYWORD
        assert options.__name__ in str(parameters["options"].annotation)
        assert not set(parameters) & set(options.__optional_keys__)  # not written out again


def test_the_checked_record_holds_exactly_the_declared_options():
    own = set(ClassifyOptions.__optional_keys__) - set(PlanOptions.__optional_keys__)
    fields = {f.name for f in dataclasses.fields(RequestOptions)}
    assert fields == own | {"plan", "batch_calibration"}
    checked = RequestOptions.of({"rule": "option", "logprobs": 2, "abstain_below": None}, 0.6)
    assert checked.plan == {"rule": "option"} and checked.logprobs == 2 and checked.abstain_below == 0.6
    with pytest.raises(ValueError, match="on_abstain"):
        RequestOptions.of({"on_abstain": "ignore"}, None)
