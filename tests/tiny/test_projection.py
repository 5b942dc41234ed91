"""The LM head at the scored positions only (projection.py): onto the trees' own tokens, or the whole
vocabulary for a normaliser, and the full forward for models whose logits are not the plain head."""

from __future__ import annotations

import pytest
import torch

from pcd_engine import PCDEngine
from pcd_engine.rules import GreedyRule
from pcd_engine.runner import PassStats
from tests.helpers import (
    TEXT,
    TEXTS,
    ForwardCounter,
    Wide,
    assert_same_scores,
)


def test_rules_without_a_normaliser_compute_only_the_scored_lm_head_rows(tiny_tokenizer, tiny_model):
    engine = PCDEngine(tiny_model, tiny_tokenizer, rule="greedy")
    plan = engine.plan(Wide)
    assert plan.normalized == (False,) * len(plan.trees)
    engine.classify("warm up", Wide)
    calls = ForwardCounter(tiny_model.lm_head)
    try:
        result = engine.classify(TEXT, Wide)
        batched = engine.classify_batch(TEXTS, Wide)
    finally:
        calls.close()
    assert calls.rows == []  # the LM head module never ran: only its rows for the trees' tokens
    prompt = engine.prompt.with_head(plan.head, TEXT).ids
    full = engine.runner.run(prompt, plan.trees, PassStats(), normalized=[True] * len(plan.trees))
    rule = GreedyRule()
    for dp, logprobs in zip([d for d in plan.decisions if d.tree], full, strict=True):
        want = rule.score(dp.tree, logprobs)
        got = result.fields[dp.decision.path]
        assert got.value == dp.decision.candidates[want.chosen].value
        assert list(got.log_scores.values()) == pytest.approx(list(want.log_scores), abs=1e-4)
    singles = [engine.classify(text, Wide) for text in TEXTS]
    assert_same_scores(batched, singles)


def test_option_rule_sees_log_probs_normalised_over_the_whole_vocabulary(tiny_tokenizer, tiny_model):
    engine = PCDEngine(tiny_model, tiny_tokenizer, rule="option")
    plan = engine.plan(Wide)
    prompt = engine.prompt.with_head(plan.head, TEXT).ids
    (first, *_) = engine.runner.run(prompt, plan.trees, PassStats(), normalized=plan.normalized)
    assert first.shape == (len(plan.trees[0].scored), len(plan.trees[0].vocab))
    assert bool((first <= 0).all())  # log-probs, not logits
    assert len(plan.trees[0].vocab) < len(tiny_tokenizer)


@pytest.mark.parametrize("rule", ["option-cc", "greedy"])
def test_models_whose_logits_are_not_the_plain_lm_head_use_the_full_forward(tiny_tokenizer, tiny_model, rule):
    split = PCDEngine(tiny_model, tiny_tokenizer, rule=rule)
    whole = PCDEngine(tiny_model, tiny_tokenizer, rule=rule)
    whole.runner.projection.head_splits = False  # as if the model scaled or soft-capped its logits
    counter = ForwardCounter(tiny_model)
    try:
        want = whole.classify_batch(TEXTS, Wide)
    finally:
        counter.close()
    assert counter.rows  # the whole model's forward ran
    assert split.runner.projection.head_splits
    assert_same_scores(split.classify_batch(TEXTS, Wide), want)


def test_the_head_projects_all_trees_rows_together_in_chunks_that_cross_trees(
    tiny_tokenizer, tiny_model, monkeypatch
):
    from pcd_engine import projection

    engine = PCDEngine(tiny_model, tiny_tokenizer, rule="option")
    plan = engine.plan(Wide)
    rows = sum(len(t.scored) for t in plan.trees)
    hidden = torch.randn(2, rows, tiny_model.config.hidden_size)
    normalized = [True, False] * (len(plan.trees) // 2) + [True] * (len(plan.trees) % 2)
    whole = engine.runner.projection.project(hidden, plan.trees, normalized)
    vocab = tiny_model.config.vocab_size
    monkeypatch.setitem(projection.LOGITS_BYTES, "cpu", 4 * vocab * 3)  # chunks of 3 rows
    chunked = engine.runner.projection.project(hidden, plan.trees, normalized)
    head = tiny_model.get_output_embeddings()
    start = 0
    for tree, norm, got, again in zip(plan.trees, normalized, whole, chunked, strict=True):
        h = hidden[:, start : start + len(tree.scored)]
        start += len(tree.scored)
        logits = head(h).float()
        want = torch.log_softmax(logits, dim=-1) if norm else logits
        assert torch.allclose(got, want[..., list(tree.vocab)], atol=1e-5)
        assert torch.allclose(again, got, atol=1e-5)
