"""Shortlists for many-valued fields (shortlist.py): cut trees first, the best values' whole trees second.

Tiny random Llama and the tiny BPE tokenizer; a field of 24 values that share long tails, so its cut
tree is much smaller than its whole tree and the CPU policy shortlists it.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Literal

import pytest
import torch
from pydantic import BaseModel

from pcd_engine import DEFAULT_RULE, CalibrationError, PCDEngine
from pcd_engine.branches import build_tree, cut_tree, rows_in, sub_tree
from pcd_engine.continuation import continuation_of
from pcd_engine.decisions import decide
from pcd_engine.precision import separate_logprobs
from pcd_engine.rules import token_logprobs
from pcd_engine.runner import PassStats
from pcd_engine.shortlist import ShortlistPolicy, best
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


def _passes(engine, plan, prompts, keep):
    """(fields, picks, counters of the first pass alone, counters of both) for prompts with the plan's
    head: the first pass, then the second, continuing the kept first calls when `keep`."""
    first = [PassStats() for _ in prompts]
    engine.scorer.score(plan, prompts, first)
    stats = [PassStats() for _ in prompts]
    kept = [] if keep else None
    runs = engine.scorer.score(plan, prompts, stats, kept=kept)
    priors = engine.scorer.priors(plan, PassStats())
    fields = [decide(plan, run, priors) for run in runs]
    picks = [best(f["queue"], plan.scored_decisions[0].keep) for f in fields]
    engine.scorer.finish_shortlists(plan, prompts, fields, stats, priors, kept)
    assert kept is None or len(kept) == len(prompts)
    return fields, picks, first, stats, kept


@pytest.mark.parametrize("count", [1, 3])
def test_the_second_pass_continues_the_first_calls_kv_and_feeds_only_the_tails(engines, count):
    """Kept: one more call per first call, feeding only each picked value's tokens past its cut; the
    scores equal the second pass that feeds the text and the whole continuations again."""
    shortlisted, _ = engines
    plan = shortlisted.plan(Routing)
    queue = plan.scored_decisions[0]
    prompts = [shortlisted.prompt.with_head(plan.head, t).ids for t in TEXTS[:count]]
    _passes(shortlisted, plan, prompts[:1], keep=False)  # the head cached
    got, picks, first, stats, kept = _passes(shortlisted, plan, prompts, keep=True)
    want, _, _, again, _ = _passes(shortlisted, plan, prompts, keep=False)
    assert all(k is not None for k in kept) and len({id(k[0]) for k in kept}) == 1  # one first call
    for g, w, pick, f, s, a, prompt in zip(got, want, picks, first, stats, again, prompts, strict=True):
        # float32 sums taken in another order (the calls' shapes differ, and so do the kernels' splits
        # by CPU: 1.1e-5 measured on an AVX512-FP16 Xeon); a tail fed at a wrong position or seeing a
        # wrong ancestor moves a score by orders of magnitude more
        assert g["queue"].log_scores == pytest.approx(w["queue"].log_scores, abs=1e-4)
        assert g["queue"].value == w["queue"].value
        tails = [continuation_of(queue.tree, queue.whole, c) for c in pick]
        assert s.forward_calls == a.forward_calls == f.forward_calls + 1  # one second call either way
        assert s.fed_tokens - f.fed_tokens == sum(len(t.fed) for t in tails if t is not None) > 0
        refed = len(prompt) - len(plan.head) + len(sub_tree(queue.whole, pick).tokens)
        assert a.fed_tokens - f.fed_tokens == refed > s.fed_tokens - f.fed_tokens


@pytest.mark.parametrize(
    ("options", "kept_calls"),
    [
        ({"prefix_cache": False}, [0, 0, 0, 0]),
        ({"max_tokens_per_forward": 16}, [None, None, None, None]),
        ({"max_tokens_per_forward": 150}, [0, 1, 0, 2]),
    ],
    ids=["no-prefix-cache", "microbatches", "several-calls"],
)
def test_the_second_pass_is_exact_whatever_the_first_call_kept(engines, options, kept_calls):
    """Without a prefix cache the first call keeps the model's own cache; in microbatches it keeps
    nothing and the second pass feeds the text again; under a small budget the rows take several
    calls and the long one runs alone (`kept_calls`: per text, which first call it continues).
    Every way, a batch's shortlisted values get the whole tree's scores."""
    _, whole = engines
    engine = PCDEngine(whole.model, whole.tokenizer, **options)
    texts = [*TEXTS[:3], " ".join(TEXTS)]  # the last one too long for a shared call of 150 tokens
    plan = engine.plan(Routing)
    kept = []
    prompts = [engine.prompt.with_head(plan.head, t).ids for t in texts]
    engine.scorer.score(plan, prompts, [PassStats() for _ in texts], kept=kept)
    calls = list(dict.fromkeys(id(k[0]) for k in kept if k is not None))
    assert [calls.index(id(k[0])) if k is not None else None for k in kept] == kept_calls
    alone = [(engine.classify(t, Routing), whole.classify(t, Routing)) for t in texts[:2]]
    together = zip(engine.classify_batch(texts, Routing), whole.classify_batch(texts, Routing), strict=True)
    for got, want in [*together, *alone]:  # one prompt alone: `run`'s own call is kept
        field, reference = got.fields["queue"], want.fields["queue"]
        exact = [v for v in VALUES if abs(field.log_scores[v] - reference.log_scores[v]) < 1e-4]
        assert len(exact) >= 8
        assert field.value == max(exact, key=reference.log_scores.__getitem__)


def test_continued_tokens_get_the_log_probs_of_separate_forward_passes(engines):
    """The second pass on a batch's kept call, row by row: each continued token's log-prob equals the
    one a separate forward pass over the prompt and the value's whole continuation gives it."""
    shortlisted, _ = engines
    plan = shortlisted.plan(Routing)
    queue = plan.scored_decisions[0]
    prompts = [shortlisted.prompt.with_head(plan.head, t).ids for t in TEXTS[:3]]
    kept = []
    shortlisted.scorer.score(plan, prompts, [PassStats() for _ in prompts], kept=kept)
    (call,) = {id(k[0]): k[0] for k in kept}.values()
    values = {0: [3, 11, 20], 1: [0, 23], 2: []}  # per prompt; a row may continue nothing
    per_row = [[] for _ in range(call.rows)]
    for i, chosen in values.items():
        per_row[kept[i][1]] = [(queue.tree, continuation_of(queue.tree, queue.whole, c)) for c in chosen]
    runs = shortlisted.runner.continue_call(call, per_row, [None] * call.rows)
    for i, chosen in values.items():
        assert len(runs[kept[i][1]]) == len(chosen)
        for c, got in zip(chosen, runs[kept[i][1]], strict=True):
            want = separate_logprobs(shortlisted.model, prompts[i], queue.whole, c)
            assert torch.allclose(got, want[len(queue.tree.paths[c]) :], atol=1e-4)


def test_a_calibrated_answer_is_always_one_of_the_values_scored_exactly(engines):
    """A bias calibration fitted on labels that all say a value the model ranks low: the shortlist is
    chosen by the calibrated first pass, so that value is scored exactly and answered; and no value
    outside a shortlist is put above the values in it, whatever the calibration says."""
    shortlisted, whole = engines
    plan = shortlisted.plan(Routing)
    uncalibrated = shortlisted.classify_batch(TEXTS, Routing)
    ranks = [sorted(VALUES, key=lambda v, r=r: -r.fields["queue"].log_scores[v]) for r in uncalibrated]
    target = max(VALUES, key=lambda v: min(rank.index(v) for rank in ranks))
    assert all(rank.index(target) >= plan.scored_decisions[0].keep for rank in ranks)  # never shortlisted
    labels = [{"queue": target, "urgent": False} for _ in TEXTS]
    calibration = shortlisted.calibrate(Routing, TEXTS, labels, method="bias", folds=2)
    for text, result in zip(
        TEXTS, shortlisted.classify_batch(TEXTS, Routing, calibration=calibration), strict=True
    ):
        field = result.fields["queue"]
        assert field.calibration == "bias" and field.value == target and target in field.shortlist
        reference = whole.classify(text, Routing).fields["queue"]
        assert field.log_scores[target] == pytest.approx(reference.log_scores[target], abs=1e-4)


def test_no_estimated_value_is_put_above_the_shortlist():
    from pcd_engine.calibration import FieldCalibration
    from pcd_engine.results import FieldResult
    from pcd_engine.rules import from_scores

    scores = from_scores(torch.tensor([-1.0, -2.0, -3.0, -4.0], dtype=torch.float64))
    first = FieldResult.scored("x", ["a", "b", "c", "d"], scores, "option+top2")
    field = dataclasses.replace(first, shortlist=("a", "b"))
    favours_d = FieldCalibration("bias", ("a", "b", "c", "d"), 1.0, (0.0, 0.0, 0.0, 10.0))
    calibrated = favours_d.apply(field)
    assert calibrated.value == "a" and calibrated.probabilities["d"] == pytest.approx(
        calibrated.probabilities["b"]
    )
    assert favours_d.apply(first).value == "d"  # a field scored whole takes the calibration as it is


def test_a_many_tool_decision_is_shortlisted_and_exact(engines):
    """24 tools: the tool field takes the shortlist and its second call like any field, and the
    decision equals the one scored on whole trees."""
    shortlisted, whole = engines
    tools = [
        {"name": v, "description": v.replace("_", " "), "parameters": {"type": "object", "properties": {}}}
        for v in VALUES
    ]
    asked = [{"role": "user", "content": TEXTS[1]}]
    shortlisted.tools.call(asked, tools, tool_choice="required")  # the head and the priors
    got = shortlisted.tools.call(asked, tools, tool_choice="required")
    want = whole.tools.call(asked, tools, tool_choice="required")
    assert got.decision.rule == f"{DEFAULT_RULE}+top8" and got.scoring.diagnostics.forward_calls == 2
    assert got.tool == want.tool and got.tool in got.decision.shortlist
    for name in got.decision.shortlist:
        assert got.probabilities[name] > 0
        assert got.decision.log_scores[name] == pytest.approx(want.decision.log_scores[name], abs=1e-4)


def test_one_scoring_pass_answers_each_calibration_as_a_call_with_it_would(engines):
    """`score_variants` (what `pcd evaluate` compares calibrations with): uncalibrated, a bias
    calibration whose shortlist holds a value the model never ranks in its top 8, and a head, from
    the forward calls of one calibrated pass; each equal to `classify_batch` with that calibration."""
    shortlisted, _ = engines
    plan = shortlisted.plan(Routing)
    uncalibrated = shortlisted.classify_batch(TEXTS, Routing)
    ranks = [sorted(VALUES, key=lambda v, r=r: -r.fields["queue"].log_scores[v]) for r in uncalibrated]
    target = max(VALUES, key=lambda v: min(rank.index(v) for rank in ranks))
    labels = [{"queue": target, "urgent": False} for _ in TEXTS]
    bias = shortlisted.calibrate(Routing, TEXTS, labels, method="bias", folds=2)
    mixed = [{"queue": VALUES[k % 2], "urgent": k % 2 == 0} for k in range(len(TEXTS))]
    head = shortlisted.calibrate(Routing, TEXTS, mixed, method="head", folds=2)
    assert head.needs_hidden
    calibrations = [None, bias, head]
    calls = []
    hook = shortlisted.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        variants = shortlisted.score_variants(plan, TEXTS, calibrations)
        one_pass = len(calls)
        shortlisted.classify_batch(TEXTS, Routing, calibration=head)
    finally:
        hook.remove()
    assert one_pass == len(calls) - one_pass  # the forward calls of one call with the head
    for k, calibration in enumerate(calibrations):
        direct = shortlisted.classify_batch(TEXTS, Routing, calibration=calibration)
        for per_text, result in zip(variants, direct, strict=True):
            for path, field in result.fields.items():
                got = per_text[k][path]
                assert (got.value, got.shortlist, got.calibration) == (
                    field.value,
                    field.shortlist,
                    field.calibration,
                )
                assert list(got.probabilities.values()) == pytest.approx(
                    list(field.probabilities.values()), abs=1e-5
                )
    assert any(v[1]["queue"].value == target != v[0]["queue"].value for v in variants)
