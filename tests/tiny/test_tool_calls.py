"""Tool calls on the engine (tool_calls.py, `engine.tools`) on a tiny random Llama: one packed pass decides
the tool and its closed arguments, text answers, forced tools, calibration and abstention on the
decision, and the result's JSON."""

from __future__ import annotations

import enum
import json
import math

import pytest
from pydantic import BaseModel

from pcd_engine import InputError, PCDEngine
from tests.helpers import ASKED, SEARCH, TOOLS, ForwardCounter, Refund


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_tokenizer):
    return PCDEngine(tiny_model, tiny_tokenizer, rule="option")


def test_one_packed_pass_decides_the_tool_and_its_closed_arguments(engine):
    engine.tools.call(ASKED, TOOLS, tool_choice="required")  # the head and priors, computed once
    counter = ForwardCounter(engine.model.model)
    try:
        result = engine.tools.call(ASKED, TOOLS, tool_choice="required")
    finally:
        counter.close()
    assert result.scoring is not None and result.scoring.diagnostics.forward_calls == 1
    assert result.tool in {"get_weather", "search", "Refund"}
    assert set(result.probabilities) == {"get_weather", "search", "Refund"}  # no text answer allowed
    assert math.isclose(sum(result.probabilities.values()), 1.0, abs_tol=1e-9)
    scored = {p for p, f in result.fields.items() if f.source == "scored"}
    want = {"get_weather": {"unit"}, "search": set(), "Refund": {"reason", "urgent"}}[result.tool]
    assert scored == want
    if result.tool == "get_weather":  # the open argument was generated after the decision
        assert set(result.arguments) == {"city", "unit"} and len(counter.rows) > 1
    else:
        assert len(counter.rows) == 1


def test_auto_allows_a_text_answer_and_none_forbids_every_tool(engine):
    auto = engine.tools.call(ASKED, TOOLS, max_tokens=3)
    assert None in auto.probabilities
    if auto.tool is None:
        assert auto.text is not None and auto.arguments is None
    none = engine.tools.call(ASKED, TOOLS, tool_choice="none", max_tokens=3)
    assert none.tool is None and none.decision is None and none.text is not None
    assert none.finish_reason in ("stop", "length")


def test_a_named_or_single_required_tool_is_that_tools_structured_output(engine):
    named = engine.tools.call(ASKED, TOOLS, tool_choice={"type": "function", "function": {"name": "Refund"}})
    direct = engine.classify(ASKED[0]["content"], Refund)
    assert named.tool == "Refund" and named.decision.rule == "fixed"
    assert named.arguments == direct.value.model_dump()
    assert named.fields["reason"].probabilities == pytest.approx(direct.fields["reason"].probabilities)
    single = engine.tools.call(ASKED, [SEARCH], tool_choice="any")
    assert single.tool == "search" and single.arguments == {}


def test_scored_arguments_come_back_as_json_values(engine):
    class Speed(enum.Enum):
        FAST = "fast"
        SLOW = "slow"

    class Ship(BaseModel):
        """Ship an order."""

        speed: Speed

    result = engine.tools.call(ASKED, [Ship, SEARCH], tool_choice="required")
    assert result.tool == "Ship"  # the tiny model's seeded choice: the closed-only path
    assert result.arguments in ({"speed": "fast"}, {"speed": "slow"})  # the Enum's value, not its member
    json.dumps(result.arguments)  # what every adapter does with them
    forced = engine.tools.call(ASKED, [Ship, SEARCH], tool_choice="Ship")
    assert json.loads(json.dumps(forced.arguments)) == forced.arguments


def test_calibration_and_abstention_apply_to_the_decision(engine):
    texts = ["refund my damaged order", "weather in Rome", "hello there", "search cats"] * 3
    labels = [{"tool": "Refund", "arguments": {"reason": "damaged"}}, "get_weather", None, "search"] * 3
    calibration = engine.tools.calibrate(TOOLS, texts, labels, method="bias")
    assert set(calibration.fields) >= {"tool", "tool_2.reason"}
    result = engine.tools.call(ASKED, TOOLS, calibration=calibration, max_tokens=2)
    assert result.decision.calibration == "bias" and result.decision.calibrated
    flagged = engine.tools.call(ASKED, TOOLS, abstain_below=1.0, max_tokens=2)
    assert flagged.needs_review and "tool" in flagged.abstained_fields
    with pytest.raises(InputError, match="neither an allowed tool"):
        engine.tools.calibrate(TOOLS, ["x"], ["nope"])
    with pytest.raises(InputError, match="no decision to calibrate"):
        engine.tools.calibrate(TOOLS, ["x"], ["search"], tool_choice="search")


def test_result_json_carries_the_decision_and_arguments(engine):
    result = engine.tools.call(ASKED, TOOLS, tool_choice="required")
    data = result.to_json()
    assert data["tool"] == result.tool
    assert set(data["decision"]["probabilities"]) == {"get_weather", "search", "Refund"}
    assert data["forward_calls"] >= 1 and data["needs_review"] is False


def test_unknown_options_are_refused_by_name_before_model_work(engine):
    counter = ForwardCounter(engine.model.model)
    try:
        with pytest.raises(TypeError, match=r"'toolchoice'; the options are abstain_below, .*tool_choice"):
            engine.tools.call(ASKED, TOOLS, toolchoice="required")  # type: ignore[call-arg]
        with pytest.raises(
            TypeError, match="'abstain_below'; the options are instructions, rule, tool_choice"
        ):
            engine.tools.calibrate(TOOLS, [ASKED], ["search"], abstain_below=0.5)  # type: ignore[call-arg]
        with pytest.raises(
            InputError, match="unknown sampling option 'typical_p'; the options are grammar, "
        ):
            engine.generate(ASKED, typical_p=0.9)  # type: ignore[call-arg]
    finally:
        counter.close()
    assert counter.rows == []
