"""The forward calls (runner.py): many requests per call, rows within the token budget, left padding,
the OOM guard; all must give the scores of one-by-one calls (tiny random Llama, fp32)."""

from __future__ import annotations

import pytest
import torch

from pcd_engine import PCDEngine
from pcd_engine.packing import pack_inputs, pack_rows
from tests.helpers import TEXTS, ForwardCounter, Wide, assert_same_scores


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("budget", [4096, 300])
def test_batched_scores_equal_one_by_one_calls(tiny_tokenizer, tiny_model, cache, budget):
    engine = PCDEngine(tiny_model, tiny_tokenizer, max_tokens_per_forward=budget, prefix_cache=cache)
    plan = engine.plan(Wide)
    singles = [engine.classify(text, Wide) for text in TEXTS]
    counter = ForwardCounter(tiny_model.get_decoder())
    try:
        batched = engine.classify_batch(TEXTS, Wide)
    finally:
        counter.close()
    assert_same_scores(batched, singles)
    widths = [r.diagnostics.prompt_tokens - len(plan.head) + plan.branch_tokens for r in batched]
    if budget >= sum(widths) + len(TEXTS) * 20:  # everything fits one call (padding included)
        assert max(counter.rows) == len(TEXTS)
    else:
        assert 1 < max(counter.rows) < len(TEXTS)  # several rows per call, several calls
        assert all(rows * min(widths) <= budget or rows == 1 for rows in counter.rows)
    head_calls = 0 if cache else 1  # without a cache the head is computed once for the whole batch
    assert len(counter.rows) - head_calls < len(TEXTS)
    assert all(r.diagnostics.forward_calls == 1 for r in batched) or not cache


def test_a_request_too_long_for_the_budget_runs_alone_in_microbatches(tiny_tokenizer, tiny_model):
    engine = PCDEngine(tiny_model, tiny_tokenizer, max_tokens_per_forward=80)
    plan = engine.plan(Wide)
    assert plan.branch_tokens > 80  # every request must split its trees
    texts = TEXTS[:3]
    batched = engine.classify_batch(texts, Wide)
    assert all(r.diagnostics.forward_calls > 1 for r in batched)
    assert_same_scores(batched, [engine.classify(t, Wide) for t in texts])


def test_out_of_memory_halves_the_rows_and_retries(tiny_tokenizer, tiny_model):
    engine = PCDEngine(tiny_model, tiny_tokenizer)
    singles = [engine.classify(text, Wide) for text in TEXTS]
    tried: list[int] = []

    def fail_when_wide(module, args, kwargs):
        rows = int(kwargs["input_ids"].shape[0])
        tried.append(rows)
        if rows > 2:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")

    handle = tiny_model.get_decoder().register_forward_pre_hook(fail_when_wide, with_kwargs=True)
    try:
        batched = engine.classify_batch(TEXTS, Wide)
    finally:
        handle.remove()
    assert tried[0] == len(TEXTS) and max(r for r in tried if r <= 2) == 2
    assert_same_scores(batched, singles)


def test_out_of_memory_on_a_single_row_is_that_input_s_error(tiny_tokenizer, tiny_model):
    engine = PCDEngine(tiny_model, tiny_tokenizer)
    engine.classify("warm the cache", Wide)

    def always_fail(module, args, kwargs):
        raise torch.OutOfMemoryError("simulated: CUDA out of memory")

    handle = tiny_model.get_decoder().register_forward_pre_hook(always_fail, with_kwargs=True)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            engine.classify_batch(TEXTS[:3], Wide)
    finally:
        handle.remove()


def test_rows_are_left_padded_so_trees_share_offsets():
    from pcd_engine.branches import build_tree

    chars = lambda s: [ord(c) for c in s]  # noqa: E731
    trees = [build_tree(chars, "{", ["a", "b"])]
    ids, positions, mask, columns, last = pack_rows([[7, 8, 9], [5]], 2, trees)
    allowed = mask[:, 0]
    assert ids.tolist() == [[7, 8, 9, ord("{")], [0, 0, 5, ord("{")]]
    assert positions.tolist() == [[2, 3, 4, 5], [2, 2, 2, 3]]
    assert columns == [(3,)] and last == 2
    for row, prompt in enumerate([[7, 8, 9], [5]]):  # the real tokens see what pack_inputs says
        _, _, own, _, _ = pack_inputs(prompt, 2, trees)
        pad = 3 - len(prompt)
        assert torch.equal(allowed[row, pad:, :2], own[0, 0, :, :2])
        assert torch.equal(allowed[row, pad:, 2 + pad :], own[0, 0, :, 2:])
        assert not allowed[row, pad:, 2 : 2 + pad].any()  # nobody sees the padding
    assert allowed[1, 0].tolist() == [False, False, True, False, False, False]  # a pad sees itself
