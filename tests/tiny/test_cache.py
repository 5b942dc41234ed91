"""The prefix cache (cache.py): the head's KV served from it, entries shared and never changed."""

from __future__ import annotations

import torch

from pcd_engine import PCDEngine
from tests.helpers import TEXT, TEXTS, Wide


def test_diagnostics_say_whether_the_prefix_cache_served_the_head(tiny_tokenizer, tiny_model):
    cached = PCDEngine(tiny_model, tiny_tokenizer, rule="greedy")
    assert cached.classify("a", Wide).diagnostics.prefix_cache_hit is False
    assert cached.classify("b", Wide).diagnostics.prefix_cache_hit is True
    assert all(r.diagnostics.prefix_cache_hit for r in cached.classify_batch(["c", "d"], Wide))
    assert cached.prefix_cache is not None and cached.prefix_cache.stats.misses == 1
    off = PCDEngine(tiny_model, tiny_tokenizer, rule="greedy", prefix_cache=False)
    assert off.classify("a", Wide).diagnostics.prefix_cache_hit is None


def test_cached_entries_share_tensors_and_are_never_changed(tiny_tokenizer, tiny_model):
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from pcd_engine.cache import can_freeze, freeze, frozen_view, kept_view, private_copy

    engine = PCDEngine(tiny_model, tiny_tokenizer)
    engine.classify("first", Wide)
    assert engine.prefix_cache is not None
    ((stored, _),) = list(engine.prefix_cache._entries.values())
    before = [(layer.keys.clone(), layer.values.clone()) for layer in stored.layers]
    engine.classify(TEXT, Wide)
    engine.classify_batch(TEXTS, Wide)
    for layer, (keys, values) in zip(stored.layers, before, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    length = stored.get_seq_length()
    copy_ = private_copy(stored)
    assert copy_.layers[0].keys.data_ptr() == stored.layers[0].keys.data_ptr()  # no tensor memory
    copy_.crop(-2)
    assert stored.get_seq_length() == length
    view = frozen_view(stored, rows=3)
    keys, _ = view.layers[0].update(torch.zeros(3, 2, 4, 16), torch.zeros(3, 2, 4, 16))
    assert keys.shape == (3, 2, length + 4, 16) and view.get_seq_length() == length
    assert frozen_view(object()) is None
    kept = kept_view(stored, rows=3)  # keeps a call's own tokens, per row, apart from the prefix
    kept.layers[0].update(torch.ones(3, 2, 4, 16), torch.ones(3, 2, 4, 16))
    assert kept.layers[0].keys.data_ptr() == stored.layers[0].keys.data_ptr()  # the prefix not copied
    assert kept.layers[0].get_seq_length() == length + 4
    later = freeze(kept, rows=3)  # the next call sees prefix and kept tokens, and keeps nothing
    keys, _ = later.layers[0].update(torch.zeros(3, 2, 1, 16), torch.zeros(3, 2, 1, 16))
    assert keys.shape == (3, 2, length + 5, 16) and torch.equal(
        keys[:, :, length : length + 4], torch.ones(3, 2, 4, 16)
    )
    assert later.layers[0].get_seq_length() == kept.layers[0].get_seq_length() == length + 4
    assert kept_view(object()) is None
    assert can_freeze(kept) and can_freeze(stored) and not can_freeze(object())
    sliding = private_copy(stored)  # a cache a model grew with sliding-window layers: not served again
    sliding.layers[0].__class__ = DynamicSlidingWindowLayer
    assert not can_freeze(sliding)
