"""Attention that reads grouped key/value heads in place (grouped_attention.py): bit-identical to
transformers' `sdpa` where it applies, transformers' own path everywhere else, and engines that switch
only GQA models on a CPU, with the packed weights."""

from __future__ import annotations

import copy
import pickle
from typing import Literal

import torch
from pydantic import BaseModel
from transformers import DynamicCache

from pcd_engine import PCDEngine
from pcd_engine.grouped_attention import GROUPED_SDPA, applies, grouped_sdpa, use_grouped_attention
from tests.helpers import tiny_llama


class Ticket(BaseModel):
    topic: Literal["billing", "shipping", "login problem"]
    urgent: bool


TEXTS = ["I was charged twice for my order.", "Where is my parcel?", "The app crashes when I log in."]


def _scores(result) -> dict[str, dict]:
    return {path: field.log_scores for path, field in result.fields.items()}


def _branch_call(model, prefix: int = 9, fed: int = 6, rows: int = 2):
    """Logits of `fed` tokens after a cached prefix, under a mask where each fed token sees the prefix
    and only every other fed token before it (a branch mask, not a causal one)."""
    torch.manual_seed(1)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        head = model(input_ids=torch.randint(0, vocab, (rows, prefix)), use_cache=True).past_key_values
        cache = DynamicCache()
        for i, layer in enumerate(head.layers):
            cache.update(layer.keys, layer.values, i)
        mask = torch.full((rows, 1, fed, prefix + fed), float("-inf"))
        mask[..., :prefix] = 0
        for q in range(fed):
            mask[..., prefix + q] = 0
            mask[..., prefix + q % 2 : prefix + q : 2] = 0
        return model(
            input_ids=torch.randint(0, vocab, (rows, fed)),
            past_key_values=cache,
            attention_mask=mask,
            position_ids=torch.arange(prefix, prefix + fed).expand(rows, fed),
        ).logits


def test_grouped_heads_read_in_place_give_bit_identical_logits(tiny_tokenizer):
    model = tiny_llama(len(tiny_tokenizer), seed=5)
    want = _branch_call(model)
    assert applies(model) and use_grouped_attention(model)
    assert model.config._attn_implementation == GROUPED_SDPA
    assert torch.equal(_branch_call(model), want)
    assert not use_grouped_attention(model)  # once


def test_the_in_place_path_is_taken_only_with_a_mask_on_the_cpu_and_many_query_tokens(monkeypatch):
    import pcd_engine.grouped_attention as grouped

    delegated = []

    def sdpa(*args, **kwargs):
        delegated.append(1)
        return "sdpa", None

    monkeypatch.setattr(grouped, "sdpa_attention_forward", sdpa)
    module = torch.nn.Module()
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    mask = torch.zeros(1, 1, 3, 5)
    out, _ = grouped_sdpa(module, q, kv, kv, mask)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, kv.repeat_interleave(2, dim=1), kv.repeat_interleave(2, dim=1), attn_mask=mask
    )
    assert torch.equal(out, want.transpose(1, 2)) and not delegated
    assert grouped_sdpa(module, q, kv, kv, None)[0] == "sdpa"  # no mask: transformers decides causality
    assert grouped_sdpa(module, q[:, :, :1], kv, kv, mask[:, :, :1])[0] == "sdpa"  # one query token
    whole = kv.repeat(1, 2, 1, 1)
    assert grouped_sdpa(module, q, whole, whole, mask)[0] == "sdpa"  # not grouped
    assert grouped_sdpa(module, q, kv, kv, mask, position_bias=torch.zeros(1, 4, 3, 5))[0] == "sdpa"
    assert len(delegated) == 4


def test_engines_switch_gqa_models_on_the_cpu_with_the_packed_weights_only(tiny_tokenizer):
    gqa = tiny_llama(len(tiny_tokenizer), seed=3)
    want = PCDEngine(copy.deepcopy(gqa), tiny_tokenizer, pack_weights=False)
    assert want.model.config._attn_implementation == "sdpa"  # pack_weights=False: as given
    engine = PCDEngine(gqa, tiny_tokenizer)
    assert gqa.config._attn_implementation == GROUPED_SDPA
    got = [_scores(engine.classify(t, Ticket)) for t in TEXTS]
    gqa.set_attn_implementation("sdpa")
    assert [_scores(engine.classify(t, Ticket)) for t in TEXTS] == got  # bit-identical scores
    eager = tiny_llama(len(tiny_tokenizer), attn="eager")
    PCDEngine(eager, tiny_tokenizer)
    assert eager.config._attn_implementation == "eager"
    mha = tiny_llama(len(tiny_tokenizer))
    mha.config.num_key_value_heads = mha.config.num_attention_heads
    assert not applies(mha)


def test_a_switched_model_copies_pickles_and_generates(tiny_tokenizer):
    model = tiny_llama(len(tiny_tokenizer), seed=3)
    engine = PCDEngine(model, tiny_tokenizer)
    want = _scores(engine.classify(TEXTS[0], Ticket))
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert other.config._attn_implementation == GROUPED_SDPA
        assert _scores(PCDEngine(other, tiny_tokenizer).classify(TEXTS[0], Ticket)) == want
    asked = [{"role": "user", "content": TEXTS[1]}]
    greedy = engine.generate(asked, max_tokens=6, logprobs=2)
    model.set_attn_implementation("sdpa")
    assert engine.generate(asked, max_tokens=6, logprobs=2) == greedy
