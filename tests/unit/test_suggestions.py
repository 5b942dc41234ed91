"""Which texts to label next (suggestions.py): a random share, then uncertain texts unlike the ones
picked or labeled, on hand-made field results and features."""

from __future__ import annotations

import pytest
import torch

from pcd_engine.results import FieldResult
from pcd_engine.suggestions import check_suggest, pick, uncertainty


def field(path: str, probs: dict) -> FieldResult:
    top = sorted(probs.values(), reverse=True)
    chosen = max(probs, key=probs.__getitem__)
    return FieldResult(path, chosen, probs, {k: 0.0 for k in probs}, top[0] - top[1], "option")


def unsure(p: float = 0.5) -> dict[str, FieldResult]:
    return {"t": field("t", {"a": p, "b": 1 - p}), "u": field("u", {"x": 0.9, "y": 0.1})}


def test_uncertainty_is_the_mean_over_fields_and_names_the_least_certain():
    path, u = uncertainty(unsure(0.5))
    assert path == "t" and u == pytest.approx((1.0 + 0.2) / 2)
    assert uncertainty(unsure(0.5), "entropy")[1] > uncertainty(unsure(0.99), "entropy")[1]


def test_texts_that_say_the_same_thing_are_not_picked_together():
    # three copies of one text (features equal) and one other: two picks take one copy and the other
    per_text = [unsure(0.5), unsure(0.5), unsure(0.5), unsure(0.9), None]
    features = [torch.tensor([1.0, 0.0])] * 3 + [torch.tensor([0.0, 1.0]), torch.tensor([5.0, 5.0])]
    for seed in range(20):
        picked = pick(per_text, features, 2, share=0.0, seed=seed)
        assert sorted(p.index >= 3 for p in picked) == [False, True]  # never two copies, never the None
        assert not any(p.sampled for p in picked)


def test_a_round_looks_away_from_the_texts_already_labeled():
    per_text = [unsure(0.5), unsure(0.5), unsure(0.9)]
    features = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]
    labeled = [torch.tensor([1.0, 0.0])]  # the first two say what is labeled already
    assert {pick(per_text, features, 1, share=0.0, labeled=labeled, seed=s)[0].index for s in range(20)} == {
        2
    }


def test_the_more_uncertain_text_is_drawn_first_more_often_and_the_share_is_drawn_at_random():
    per_text = [unsure(0.55), unsure(0.99)]  # uncertainties 0.5 and 0.105
    features = [torch.tensor([0.0]), torch.tensor([1.0])]
    first = [pick(per_text, features, 1, share=0.0, seed=s)[0].index for s in range(400)]
    assert 0.75 < first.count(0) / 400 < 0.9  # 0.5 / 0.605 = 0.83
    picked = pick([unsure()] * 10, [torch.tensor([float(i)]) for i in range(10)], 10, share=0.3, seed=1)
    assert [p.sampled for p in picked] == [True] * 3 + [False] * 7
    assert sorted(p.index for p in picked) == list(range(10))  # never one text twice
    assert pick([unsure()] * 3, [torch.zeros(1)] * 3, 10, share=0.0)[2].index in (0, 1, 2)  # all copies


@pytest.mark.parametrize(
    ("count", "by", "share"), [(0, "margin", 0.3), (5, "vibes", 0.3), (5, "margin", 1.5)]
)
def test_bad_arguments_are_refused(count, by, share):
    with pytest.raises(ValueError):
        check_suggest(count, by, share)
