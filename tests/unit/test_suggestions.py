"""Which texts to label next (suggestions.py): the least certain answers, spread over the predicted
values, on hand-made field results."""

from __future__ import annotations

from pcd_engine.results import FieldResult
from pcd_engine.suggestions import pick_uncertain, uncertainty


def field(path: str, probs: dict, value=None) -> FieldResult:
    top = sorted(probs.values(), reverse=True)
    chosen = value if value is not None else max(probs, key=probs.__getitem__)
    return FieldResult(path, chosen, probs, {k: 0.0 for k in probs}, top[0] - top[1], "option")


def test_suggestions_take_the_least_certain_texts_spread_over_predicted_values():
    per_text = [
        {"t": field("t", {"a": 0.51, "b": 0.49})},  # 0: a, very unsure
        {"t": field("t", {"a": 0.55, "b": 0.45})},  # 1: a, unsure
        {"t": field("t", {"a": 0.60, "b": 0.40})},  # 2: a
        {"t": field("t", {"a": 0.30, "b": 0.70})},  # 3: b, surer than 0-2
        {"t": field("t", {"a": 0.99, "b": 0.01})},  # 4: a, sure
        None,  # 5: no answer, never picked
    ]
    picked = pick_uncertain(per_text, 3)
    assert [p.index for p in picked] == [0, 3, 1]  # b gets a slot before a's second
    assert pick_uncertain(per_text, 10)[-1].index == 4 and len(pick_uncertain(per_text, 10)) == 5
    assert uncertainty(per_text[0], "entropy")[1] > uncertainty(per_text[4], "entropy")[1]
