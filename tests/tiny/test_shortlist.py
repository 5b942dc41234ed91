"""Shortlists for many-valued fields (shortlist.py): cut trees first, the best values' whole trees second.

Tiny random Llama and the tiny BPE tokenizer; a field of 24 values that share long tails, so its cut
tree is much smaller than its whole tree and the CPU policy shortlists it.
"""

from __future__ import annotations

import copy
import re
from typing import Literal

import pytest
import torch
from pydantic import BaseModel

from pcd_engine import DEFAULT_RULE, CalibrationError, PCDEngine
from pcd_engine.branches import build_tree, cut_tree, rows_in, sub_tree
from pcd_engine.precision import separate_logprobs
from pcd_engine.rules import token_logprobs
from pcd_engine.runner import PassStats
from pcd_engine.shortlist import ShortlistPolicy
from tests.helpers import TEXTS, assert_same_scores

WORDS = ["billing", "bug", "refund", "parcel", "password", "email", "order", "app"]
VALUES = tuple(f"{w}_{kind}_request" for w in WORDS for kind in ("urgent", "later", "other"))


class Routing(BaseModel):
    queue: Literal[VALUES]  # type: ignore[valid-type]
    urgent: bool


class Small(BaseModel):
    topic: Literal["billing", "bug", "other"]
    urgent: bool


@pytest.fixture(scope="module")
def engines(tiny_model, tiny_tokenizer):
    """(with the CPU shortlist, every field whole) on the same weights."""
    return PCDEngine(tiny_model, tiny_tokenizer), PCDEngine(tiny_model, tiny_tokenizer, shortlist=False)


def test_the_cpu_policy_shortlists_the_many_valued_field_only(engines):
    shortlisted, whole = engines
    plan = shortlisted.plan(Routing)
    queue, urgent = plan.scored_decisions
    assert queue.whole is not None and queue.keep == 8 and queue.rule_name == f"{DEFAULT_RULE}+top8"
    assert len(queue.tree.tokens) < len(queue.whole.tokens) // 2  # the first pass feeds the cut tree
    assert urgent.whole is None and urgent.rule_name == DEFAULT_RULE
    assert not shortlisted.plan(Small).shortlisted
    assert not whole.plan(Routing).shortlisted
    # a GPU counts a forward call as thousands of tokens: this field is not worth a second call
    gpu = PCDEngine(whole.model, whole.tokenizer, shortlist=ShortlistPolicy.for_device("cuda"))
    assert not gpu.plan(Routing).shortlisted
    with pytest.raises(ValueError, match="at least one value"):
        ShortlistPolicy(size=0)


def test_cut_and_sub_trees_are_parts_of_the_whole_tree(tiny_tokenizer):
    encode = lambda s: tiny_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    texts = [f'"{v}"}}' for v in VALUES]
    whole = build_tree(encode, '{"queue": ', texts)
    cut = cut_tree(whole)
    reference = build_tree(encode, '{"queue": ', texts, until_unique=True)
    assert (cut.tokens, cut.paths, cut.chain) == (reference.tokens, reference.paths, reference.chain)
    part = sub_tree(whole, [5, 0, 17])
    assert part.chain == whole.chain
    assert [part.continuation(j) for j in range(3)] == [whole.continuation(c) for c in (5, 0, 17)]


def test_cut_and_sub_tree_log_probs_equal_the_whole_tree_and_separate_passes(engines):
    _, engine = engines
    plan = engine.plan(Routing)
    whole = plan.trees[0]
    prompt = engine.prompt.with_head(plan.head, TEXTS[1]).ids
    cut, part = cut_tree(whole), sub_tree(whole, [3, 11, 20, 0])
    got = {}
    for name, tree in (("whole", whole), ("cut", cut), ("part", part)):
        (got[name],) = engine.scorer.score_trees(plan, prompt, [tree], PassStats())
    for name, tree in (("cut", cut), ("part", part)):
        rows, columns = rows_in(tree, whole)
        assert torch.allclose(got[name], got["whole"][rows][:, columns], atol=1e-5)
    for j, c in enumerate((3, 11, 20, 0)):
        packed = token_logprobs(part, got["part"])[j]
        assert torch.allclose(packed, separate_logprobs(engine.model, prompt, whole, c), atol=1e-4)


def test_shortlisted_values_are_scored_exactly_and_the_answer_is_one_of_them(engines):
    shortlisted, whole = engines
    shortlisted.classify(TEXTS[0], Routing)  # the head and the priors computed
    for text in TEXTS:
        got, want = shortlisted.classify(text, Routing), whole.classify(text, Routing)
        field, reference = got.fields["queue"], want.fields["queue"]
        assert field.rule == f"{DEFAULT_RULE}+top8" and reference.rule == DEFAULT_RULE
        first = shortlisted.plan(Routing)  # the values the second pass scored: the exact ones
        exact = [v for v in VALUES if abs(field.log_scores[v] - reference.log_scores[v]) < 1e-4]
        assert len(exact) >= first.scored_decisions[0].keep
        assert field.value in exact
        assert field.value == max(exact, key=reference.log_scores.__getitem__)
        lowest = min(field.log_scores[v] for v in exact)
        assert all(field.log_scores[v] <= lowest + 1e-9 for v in VALUES if v not in exact)
        assert sum(field.probabilities.values()) == pytest.approx(1.0)
        assert got.fields["urgent"].log_scores == pytest.approx(want.fields["urgent"].log_scores, abs=1e-4)
        assert got.diagnostics.forward_calls == 2  # the first pass, then the shortlist's
    shortlisted.classify(TEXTS[0], Small)  # its head and priors
    assert shortlisted.classify(TEXTS[2], Small).diagnostics.forward_calls == 1  # nothing added


def test_a_batch_equals_one_by_one_with_a_shortlist(engines):
    shortlisted, _ = engines
    assert_same_scores(
        shortlisted.classify_batch(TEXTS, Routing), [shortlisted.classify(t, Routing) for t in TEXTS]
    )


def test_a_calibration_knows_whether_it_was_fitted_with_a_shortlist(engines):
    shortlisted, whole = engines
    calibration = shortlisted.calibrate(Routing, TEXTS, method="batch")
    assert calibration.rules["queue"] == f"{DEFAULT_RULE}+top8"
    shortlisted.classify(TEXTS[0], Routing, calibration=calibration)
    with pytest.raises(CalibrationError, match=re.escape(f"{DEFAULT_RULE}+top8")):
        whole.classify(TEXTS[0], Routing, calibration=calibration)


def test_fp32_rescoring_of_a_shortlisted_field_gives_the_fp32_answer(engines):
    shortlisted, _ = engines
    bf16 = copy.deepcopy(shortlisted.model).to(torch.bfloat16)
    mixed = PCDEngine(bf16, shortlisted.tokenizer, reference_model=shortlisted.model, rescore_margin=1.0)
    for text in TEXTS[:3]:
        got, want = mixed.classify(text, Routing), shortlisted.classify(text, Routing)
        assert got.fields["queue"].rescored and got.fields["queue"].rule == f"{DEFAULT_RULE}+top8"
        assert got.fields["queue"].value == want.fields["queue"].value
        assert got.fields["queue"].log_scores == pytest.approx(want.fields["queue"].log_scores, abs=1e-4)
