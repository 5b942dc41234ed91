"""The packed branch pass equals separate full forward passes (tiny random Llama, fp32)."""

from __future__ import annotations

import pytest
import torch

from pcd_engine import PCDEngine
from pcd_engine.packing import fed_tokens, microbatches, pack_inputs
from pcd_engine.runner import PassStats
from tests.helpers import TEXT, Wide, packed_and_separate, tiny_llama


def assert_packed_equals_separate(engine: PCDEngine, longest: int = 3) -> None:
    for _ in range(2):  # a cold and, with the cache, a warm call
        pairs = packed_and_separate(engine, Wide, TEXT)
        assert len(pairs) > 30
        worst = max(float((got - want).abs().max()) for got, want in pairs)
        assert worst < 1e-4
        assert any(len(got) >= longest for got, _ in pairs)  # multi-token continuations were checked


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("budget", "cache"), [(4096, False), (4096, True), (40, False), (40, True)])
def test_packed_scores_equal_separate_forward_passes(tiny_tokenizer, attn, budget, cache):
    model = tiny_llama(len(tiny_tokenizer), attn=attn)
    engine = PCDEngine(model, tiny_tokenizer, max_tokens_per_forward=budget, prefix_cache=cache)
    assert_packed_equals_separate(engine)


@pytest.mark.parametrize("rule", ["option-unique-cc", "greedy"])
@pytest.mark.parametrize(("budget", "cache"), [(4096, True), (40, False)])
def test_trees_cut_at_the_distinguishing_token_equal_separate_passes(
    tiny_tokenizer, tiny_model, rule, budget, cache
):
    engine = PCDEngine(
        tiny_model, tiny_tokenizer, rule=rule, max_tokens_per_forward=budget, prefix_cache=cache
    )
    assert engine.plan(Wide).branch_tokens < PCDEngine(tiny_model, tiny_tokenizer).plan(Wide).branch_tokens
    assert_packed_equals_separate(engine, longest=2)


def test_microbatches_and_cache_really_change_the_calls(tiny_tokenizer, tiny_model):
    text = "refund me"
    one = PCDEngine(tiny_model, tiny_tokenizer, rule="greedy", prefix_cache=False).classify(text, Wide)
    split = PCDEngine(
        tiny_model, tiny_tokenizer, rule="greedy", max_tokens_per_forward=16, prefix_cache=False
    )
    many = split.classify(text, Wide)
    assert one.diagnostics.forward_calls == 1
    assert many.diagnostics.forward_calls > 3
    cached = PCDEngine(tiny_model, tiny_tokenizer, rule="greedy")  # no content-free prior passes
    cold, warm = cached.classify(text, Wide), cached.classify(text + "!", Wide)
    assert cold.diagnostics.forward_calls == 2 and warm.diagnostics.forward_calls == 1
    assert warm.diagnostics.cached_tokens == len(cached.plan(Wide).head) > 0
    assert cached.prefix_cache is not None and cached.prefix_cache.stats.hits == 1
    for result in (many, cold):
        for path, field in one.fields.items():
            for value, score in field.log_scores.items():
                assert result.fields[path].log_scores[value] == pytest.approx(score, abs=1e-4)


def test_mask_and_positions_of_a_packed_call(tiny_tokenizer):
    from pcd_engine.branches import build_tree

    chars = lambda s: [ord(c) for c in s]  # noqa: E731
    trees = [build_tree(chars, "{", ["a", "b"]), build_tree(chars, "[", ["xy", "xz"])]
    ids, positions, mask, columns, last = pack_inputs([7, 8, 9], 2, trees)
    allowed = mask[0, 0]
    assert ids.tolist() == [[7, 8, 9, ord("{"), ord("["), ord("x")]]
    assert positions.tolist() == [[2, 3, 4, 5, 5, 6]]
    assert columns == [(3,), (4, 5)] and last == 2
    assert allowed[0].tolist() == [True, True, True, False, False, False, False, False]
    assert allowed[3].tolist() == [True] * 5 + [True, False, False]  # "{": prompt + itself
    assert allowed[4].tolist() == [True] * 5 + [False, True, False]  # "[": not the other tree
    assert allowed[5].tolist() == [True] * 5 + [False, True, True]  # "x": its parent "["


def test_chain_tokens_that_trees_repeat_are_fed_once():
    from pcd_engine.branches import build_tree

    chars = lambda s: [ord(c) for c in s]  # noqa: E731
    trees = [
        build_tree(chars, "{a", ["x", "y"]),  # chain "{a"; "x" and "y" are only targets
        build_tree(chars, "{b", ["x", "y"]),  # chain "{b": shares "{"
        build_tree(chars, "{a", ["z", "w"]),  # chain "{a": shares "{a"
        build_tree(chars, "", ["p", "q"]),  # empty chain: its root is the prompt's last token
    ]
    packed = pack_inputs([7, 8], 1, trees)
    allowed = packed.allowed[0, 0]
    assert packed.ids.tolist() == [[7, 8, ord("{"), ord("a"), ord("b")]]
    assert packed.positions.tolist() == [[1, 2, 3, 4, 4]]
    assert packed.columns == [(2, 3), (2, 4), (2, 3), ()]
    assert packed.at(3, -1) == 1 and packed.at(1, 1) == 4
    assert allowed[4].tolist() == [True] * 3 + [True, False, True]  # "b": the shared "{", not "a"
    assert allowed[3].tolist() == [True] * 3 + [True, True, False]
    assert fed_tokens(trees) == 3 < sum(len(t.tokens) for t in trees)


def test_shared_chains_score_as_separate_passes_on_nested_fields(tiny_tokenizer, tiny_model):
    engine = PCDEngine(tiny_model, tiny_tokenizer)
    plan = engine.plan(Wide)  # every field's chain starts with '{"'; shipping.* share '{"shipping": {"'
    assert plan.branch_tokens < sum(len(t.tokens) for t in plan.trees) - len(plan.trees)
    for got, want in packed_and_separate(engine, Wide, "refund me"):
        assert torch.allclose(got, want, atol=1e-4)


def test_microbatch_grouping_respects_the_budget():
    from pcd_engine.branches import build_tree

    chars = lambda s: [ord(c) for c in s]  # noqa: E731
    trees = [build_tree(chars, "{" * n, ["a}", "b}"]) for n in (3, 3, 5, 1)]
    assert microbatches(trees, 100, 100) == [[0, 1, 2, 3]]
    groups = microbatches(trees, 4, 8)
    assert [i for g in groups for i in g] == [0, 1, 2, 3]
    assert groups[0] == [0]  # 4 tokens fit the first budget of 4, the next tree does not
    assert all(sum(len(trees[i].tokens) for i in g) <= 8 or len(g) == 1 for g in groups[1:])
    assert len(groups) > 1


def test_pass_stats_count_fed_tokens(tiny_tokenizer, tiny_model):
    engine = PCDEngine(tiny_model, tiny_tokenizer, prefix_cache=False)
    plan = engine.plan(Wide)
    prompt = engine.prompt.with_head(plan.head, "x").ids
    stats = PassStats()
    engine.runner.run(prompt, plan.trees, stats)
    assert stats.fed_tokens == len(prompt) + plan.branch_tokens


def test_additive_mask_is_zero_where_allowed_and_the_dtype_minimum_elsewhere():
    from pcd_engine.packing import additive_mask

    allowed = torch.tensor([[True, False], [True, True]])
    for dtype in (torch.float32, torch.bfloat16):
        mask = additive_mask(allowed, dtype)
        assert mask.dtype == dtype
        assert mask.tolist() == [[0.0, torch.finfo(dtype).min], [0.0, 0.0]]


def test_a_prompt_with_no_past_is_causal_and_trees_restart_after_it():
    from pcd_engine.branches import build_tree

    chars = lambda s: [ord(c) for c in s]  # noqa: E731
    tree = build_tree(chars, "{", ["ab", "ac"])  # fed: the chain "{a"; "b", "c" are only targets
    other = build_tree(chars, "[", ["ab", "ac"])  # "[a": no chain token in common with the first
    packed = pack_inputs([5, 6, 7], 0, [tree, other])
    allowed = packed.allowed[0, 0]
    assert allowed[:3, :3].tolist() == torch.ones(3, 3, dtype=torch.bool).tril().tolist()
    assert not allowed[:3, 3:].any()  # the prompt sees no branch
    assert packed.positions.tolist() == [[0, 1, 2, 3, 4, 3, 4]]  # both trees start at position 3
    assert packed.columns == [(3, 4), (5, 6)]
    assert allowed[5:, 3:5].sum() == 0  # the second tree sees nothing of the first
    assert pack_inputs([5, 6, 7], 0, [tree, tree]).columns == [(3, 4), (3, 4)]  # one chain, fed once
