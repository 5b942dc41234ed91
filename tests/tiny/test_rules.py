"""The scoring rules (rules.py) on a tiny random Llama: option, option-unique, greedy, code, the
content-free prior and the cut trees, read from one packed pass where their trees agree."""

from __future__ import annotations

import math

import pytest
import torch

from pcd_engine import (
    PCDEngine,
)
from pcd_engine.rules import ContextualCalibration, GreedyRule, OptionRule
from pcd_engine.runner import PassStats
from tests.helpers import TEXTS, SupportTicket, Wide


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    return PCDEngine(tiny_model, tiny_tokenizer, rule="option")


def test_default_rule_is_option_with_contextual_calibration_and_bools_cut(tiny_model, tiny_tokenizer):
    engine = PCDEngine(tiny_model, tiny_tokenizer)
    first, second = engine.classify("text", SupportTicket), engine.classify("text", SupportTicket)
    assert first.fields["topic"].rule == first.fields["urgent"].rule == "option-boolcut-cc"
    topic, urgent, _ = engine.plan(SupportTicket).trees  # strings whole, yes/no cut after their word
    whole = PCDEngine(tiny_model, tiny_tokenizer, rule="option-cc").plan(SupportTicket).trees
    assert topic.paths == whole[0].paths
    assert [len(p) for p in urgent.paths] == [1, 1] < [len(p) for p in whole[1].paths]
    assert first.diagnostics.forward_calls == 2 + 3  # head, request, three content-free priors
    assert second.diagnostics.forward_calls == 1


def test_rules_share_one_pass_and_differ_where_they_should(engine):
    results = engine.compare_rules("the app crashes", SupportTicket, ["option", "option-mean", "option-cc"])
    assert list(results) == ["option", "option-mean", "option-cc"]
    option, mean, _ = (results[k].fields["topic"] for k in results)
    n_tokens = {v: option.log_scores[v] / mean.log_scores[v] for v in option.log_scores}
    assert all(n >= 1 - 1e-6 and abs(n - round(n)) < 1e-4 for n in n_tokens.values())
    (greedy,) = (
        r.fields["topic"] for r in engine.compare_rules("the app crashes", SupportTicket, ["greedy"]).values()
    )
    assert greedy.rule == "greedy" and math.isclose(sum(greedy.probabilities.values()), 1.0)
    single = engine.classify("the app crashes", SupportTicket, rule="greedy")
    assert single.fields["topic"].value == greedy.value
    with pytest.raises(ValueError, match="different trees"):  # greedy reads trees cut short
        engine.compare_rules("the app crashes", SupportTicket, ["option", "greedy"])


@pytest.mark.parametrize("rule", [GreedyRule(), ContextualCalibration(GreedyRule())])
def test_greedy_on_trees_cut_at_the_distinguishing_token_is_exact(engine, rule):
    whole = GreedyRule(until_unique=False)
    whole = ContextualCalibration(whole) if rule.corrects_prior else whole
    assert engine.plan(Wide, rule=rule).branch_tokens < engine.plan(Wide, rule=whole).branch_tokens
    for text in TEXTS:
        cut, full = engine.classify(text, Wide, rule=rule), engine.classify(text, Wide, rule=whole)
        assert cut.value == full.value
        for path, field in full.fields.items():
            for value, p in field.probabilities.items():
                assert cut.fields[path].probabilities[value] == pytest.approx(p, abs=1e-5)


def test_option_unique_sums_the_tokens_up_to_the_distinguishing_one(engine):
    from pcd_engine.rules import token_logprobs

    text = "refund me, the app crashes"
    plan = engine.plan(Wide, rule="option")
    prompt = engine.prompt.with_head(plan.head, text).ids
    (full,) = engine.scorer.score(plan, [prompt], [PassStats()], normalized=[True] * len(plan.trees))
    short = engine.classify(text, Wide, rule="option-unique")
    cut = engine.plan(Wide, rule="option-unique")
    lengths = [[len(path) for path in tree.paths] for tree in cut.trees]
    assert any(
        n < len(p)
        for tree, ns in zip(plan.trees, lengths, strict=True)
        for p, n in zip(tree.paths, ns, strict=True)
    )
    for dp, tree, logprobs, ns in zip(plan.scored_decisions, plan.trees, full, lengths, strict=True):
        per_token = token_logprobs(tree, logprobs)
        field = short.fields[dp.decision.path]
        for candidate, tokens, n in zip(dp.decision.candidates, per_token, ns, strict=True):
            assert field.log_scores[candidate.value] == pytest.approx(float(tokens[:n].sum()), abs=1e-4)


def test_code_rule_lists_codes_and_falls_back_where_codes_do_not_apply(engine, tiny_tokenizer):
    plan = engine.plan(SupportTicket, rule="code")
    assert 'A = "billing"' in plan.system and 'B = "billing_dispute"' in plan.system
    rules = {dp.decision.path: dp.rule.name for dp in plan.decisions}
    assert rules["topic"] == "code" and rules["urgent"] == "option"
    result = engine.classify("refund", SupportTicket, rule="code")
    assert result.fields["topic"].rule == "code"
    assert result.fields["topic"].value in {"billing", "billing_dispute", "bug", "other"}


def test_greedy_rule_walks_the_trie_by_the_best_child():
    from pcd_engine.branches import build_tree

    tree = build_tree(lambda s: [ord(c) for c in s], "{", ['"neg"}', '"pos"}', '"pot"}'])
    logprobs = torch.full((len(tree.scored), 200), -20.0)
    rows = {fed: row for row, fed in enumerate(tree.scored)}

    def put(prefix: str, char: str, value: float) -> None:
        node = tree.root
        for c in prefix:
            node = tree.children(node)[ord(c)]
        logprobs[rows[node], ord(char)] = value

    put("", "p", -1.0)  # "p" beats "n" at the first step ...
    put("", "n", -1.5)
    put("p", "o", -0.1)
    put("po", "s", -9.0)  # ... but both "p" words are poor later on
    put("po", "t", -8.0)
    for word in ("neg", "pos", "pot"):
        for i, char in enumerate(word + '"}'):
            if word[:i] not in ("", "p", "po"):
                put(word[:i], char, -0.01)
    columns = logprobs[:, list(tree.vocab)]  # what the runner hands the rules: the tree's own tokens
    greedy, option = GreedyRule().score(tree, columns), OptionRule().score(tree, columns)
    assert greedy.chosen == 2  # p, o, then t beats s
    assert option.chosen == 0  # the whole "neg" sequence is far more likely
    # greedy probabilities are those of constrained decoding: they sum to 1 over the leaves
    assert math.isclose(sum(greedy.probabilities), 1.0)


def test_contextual_calibration_removes_the_content_free_prior(tiny_model, tiny_tokenizer, monkeypatch):
    import pcd_engine.scorer as scorer_module

    monkeypatch.setattr(scorer_module, "CONTENT_FREE_TEXTS", ("N/A",))
    engine = PCDEngine(tiny_model, tiny_tokenizer, rule="option-cc")
    neutral = engine.classify("N/A", SupportTicket)
    for path in ("topic", "urgent", "priority"):
        field = neutral.fields[path]
        assert field.rule == "option-cc"
        assert max(abs(s) for s in field.log_scores.values()) < 1e-4  # text == prior: nothing left
        assert max(field.probabilities.values()) == pytest.approx(1 / len(field.probabilities), abs=1e-4)
    first, second = engine.classify("refund me", SupportTicket), engine.classify("refund me", SupportTicket)
    assert first.diagnostics.forward_calls == second.diagnostics.forward_calls == 1  # prior cached
    plain = PCDEngine(tiny_model, tiny_tokenizer, rule="option").classify("refund me", SupportTicket)
    prior = PCDEngine(tiny_model, tiny_tokenizer, rule="option").classify("N/A", SupportTicket)
    for value, score in first.fields["topic"].log_scores.items():
        expected = plain.fields["topic"].log_scores[value] - prior.fields["topic"].log_scores[value]
        assert score == pytest.approx(expected, abs=1e-4)


def test_option_boolcut_cuts_yes_no_decisions_only(engine):
    whole, boolcut = (
        engine.plan(SupportTicket, rule="option"),
        engine.plan(SupportTicket, rule="option-boolcut"),
    )
    cut = engine.plan(SupportTicket, rule="option-unique")
    for a, b, c in zip(whole.scored_decisions, boolcut.scored_decisions, cut.scored_decisions, strict=True):
        assert b.tree is not None and c.tree is not None and a.tree is not None
        expected = c.tree if a.decision.path == "urgent" else a.tree
        assert b.tree.tokens == expected.tokens and b.tree.paths == expected.paths
    text = "the app crashes, refund me"
    got = engine.classify(text, SupportTicket, rule="option-boolcut").fields
    for path, reference in (("topic", "option"), ("priority", "option"), ("urgent", "option-unique")):
        want = engine.classify(text, SupportTicket, rule=reference).fields[path]
        assert got[path].log_scores == pytest.approx(want.log_scores, abs=1e-4)
