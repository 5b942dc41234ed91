"""Hidden states read from the packed pass equal a separate full forward's at the same positions:
one prompt (prefix cache cold and warm, microbatches), padded batched rows, and a cached prefix that
reaches into the text."""

from __future__ import annotations

import pytest
import torch

from pcd_engine import PCDEngine
from pcd_engine.hidden import HiddenCapture, middle_layer
from pcd_engine.runner import PassStats
from tests.helpers import TEXTS, Wide


def reference(model, prompt, tree):
    """(fork state, text means at the final and middle layer) from one ordinary forward over the
    prompt and the tree's shared chain, no cache, no mask; hidden_states[k + 1] is layer k's output."""
    ids = torch.tensor([[*prompt.ids, *tree.chain]])
    with torch.inference_mode():
        out = model.get_decoder()(input_ids=ids, output_hidden_states=True)
    start, end = len(prompt.head), len(prompt.head) + len(prompt.text)
    final, middle = out.last_hidden_state[0], out.hidden_states[middle_layer(model) + 1][0]
    return final[-1], final[start:end].mean(dim=0), middle[start:end].mean(dim=0)


def captured(engine: PCDEngine, texts, plan):
    prompts = [engine.prompt.with_head(plan.head, t) for t in texts]
    captures = [HiddenCapture(len(p.head), len(p.head) + len(p.text)) for p in prompts]
    engine.scorer.score(plan, [p.ids for p in prompts], [PassStats() for _ in prompts], capture=captures)
    return prompts, [c.states() for c in captures]


def assert_states_match(engine, plan, prompts, states):
    for prompt, got in zip(prompts, states, strict=True):
        assert got.fork.shape == (len(plan.trees), engine.model.config.hidden_size)
        for k, tree in enumerate(plan.trees):
            fork, text_last, text_middle = reference(engine.model, prompt, tree)
            torch.testing.assert_close(got.fork[k], fork, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.text_last, text_last, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.text_middle, text_middle, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("budget", [2048, 48])  # 48: the trees run in several microbatches
def test_one_prompt_cold_and_warm(tiny_model, tiny_tokenizer, cache, budget):
    engine = PCDEngine(tiny_model, tiny_tokenizer, prefix_cache=cache, max_tokens_per_forward=budget)
    plan = engine.plan(Wide)
    for text in TEXTS[:3]:  # the first call computes the head, the next ones reuse it
        prompts, states = captured(engine, [text], plan)
        assert_states_match(engine, plan, prompts, states)


@pytest.mark.parametrize("cache", [True, False])
def test_batched_rows_of_different_lengths(tiny_model, tiny_tokenizer, cache):
    engine = PCDEngine(tiny_model, tiny_tokenizer, prefix_cache=cache, max_tokens_per_forward=4096)
    plan = engine.plan(Wide)
    prompts, states = captured(engine, TEXTS, plan)  # left-padded rows in one or more calls
    assert_states_match(engine, plan, prompts, states)


def test_a_cached_prefix_that_covers_part_of_the_text_is_cropped(tiny_model, tiny_tokenizer):
    engine = PCDEngine(tiny_model, tiny_tokenizer)
    plan = engine.plan(Wide)
    prompt = engine.prompt.with_head(plan.head, TEXTS[4])
    assert engine.prefix_cache is not None
    engine.prefix_cache.store(
        prompt.ids[: len(prompt.head) + 5],
        engine.runner.prefill_head(prompt.ids[: len(prompt.head) + 5], PassStats()),
    )
    prompts, states = captured(engine, [TEXTS[4]], plan)
    assert_states_match(engine, plan, prompts, states)


def test_an_empty_text_pools_to_zeros(tiny_model, tiny_tokenizer):
    engine = PCDEngine(tiny_model, tiny_tokenizer, allow_empty_text=True)
    _, (states,) = captured(engine, [""], engine.plan(Wide))
    assert not states.text_last.any() and not states.text_middle.any()
