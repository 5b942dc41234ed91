"""Linear layers packed for oneDNN (packed_weights.py): the same function as `nn.Linear`, models that
answer as before (ties, identity, state dict, copies, pickles and conversions intact), and engines that pack
only where asked and where it applies."""

from __future__ import annotations

import copy
import pickle
from typing import Literal

import pytest
import torch
from pydantic import BaseModel

from pcd_engine import PCDEngine
from pcd_engine.calibration import model_identity
from pcd_engine.packed_weights import PackedLinear, applies, pack_linears, pays
from tests.helpers import tiny_llama

pytestmark = pytest.mark.skipif(not applies(torch.nn.Linear(2, 2)), reason="this PyTorch has no oneDNN")


class Ticket(BaseModel):
    topic: Literal["billing", "shipping", "login problem"]
    urgent: bool


TEXTS = ["I was charged twice for my order.", "Where is my parcel?", "The app crashes when I log in."]


def _tied(vocab_size: int):
    model = tiny_llama(vocab_size, seed=3)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("keep_weight", [True, False])
def test_a_packed_linear_computes_what_nn_linear_computes(bias, keep_weight):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias)
    want = copy.deepcopy(linear)
    packed = PackedLinear(linear, keep_weight=keep_weight)
    assert (packed.packed is not None) is keep_weight and packed.weight.is_mkldnn is not keep_weight
    for x in (torch.randn(5, 48), torch.randn(2, 7, 48), torch.randn(7, 2, 48).transpose(0, 1)):
        torch.testing.assert_close(packed(x), want(x), atol=1e-5, rtol=1e-5)
    assert packed(torch.randn(1, 0, 48)).shape == (1, 0, 80)
    bf16 = PackedLinear(copy.deepcopy(want).to(torch.bfloat16), keep_weight=keep_weight)
    x = torch.randn(6, 48).to(torch.bfloat16)
    torch.testing.assert_close(bf16(x).float(), want.to(torch.bfloat16)(x).float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("tied", [False, True])
def test_a_packed_model_gives_the_same_logits_and_keeps_its_ties_identity_and_state(tiny_tokenizer, tied):
    model = _tied(len(tiny_tokenizer)) if tied else tiny_llama(len(tiny_tokenizer), seed=3)
    plain = copy.deepcopy(model)
    identity, state = model_identity(plain), plain.state_dict()
    assert pack_linears(model) == 7 * 2 + 1  # q, k, v, o, gate, up, down in 2 layers; the LM head
    assert pack_linears(model) == 0  # once
    assert isinstance(model.lm_head, PackedLinear) and model.model.layers[0].mlp.up_proj.weight.is_mkldnn
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    ids = torch.tensor([[1, 5, 9, 30, 2, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=1e-4, rtol=1e-5)
    assert model_identity(model) == identity
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    packed_state = model.state_dict()
    assert packed_state.keys() == state.keys()
    assert all(torch.equal(packed_state[k], state[k]) for k in state)  # unpacked exactly
    fresh = tiny_llama(len(tiny_tokenizer), seed=9)
    pack_linears(fresh)
    fresh.load_state_dict(state)  # loaded into packed layers, packed again
    with torch.inference_mode():
        torch.testing.assert_close(fresh(ids).logits, plain(ids).logits, atol=1e-4, rtol=1e-5)
    pickled = pickle.loads(pickle.dumps(model))  # as torch.save and Ray pickle it
    assert pickled.model.layers[0].mlp.down_proj.weight.is_mkldnn
    assert (pickled.lm_head.weight is pickled.model.embed_tokens.weight) is tied
    with torch.inference_mode():
        torch.testing.assert_close(pickled(ids).logits, plain(ids).logits, atol=1e-4, rtol=1e-5)
    twin = copy.deepcopy(model).to(torch.bfloat16)  # copied, then converted: packed again in bf16
    assert twin.model.layers[1].self_attn.q_proj.weight.is_mkldnn
    assert twin.model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert (twin.lm_head.weight is twin.model.embed_tokens.weight) is tied
    with torch.inference_mode():
        got = twin(ids).logits.float()
        want = copy.deepcopy(plain).to(torch.bfloat16)(ids).logits.float()
    torch.testing.assert_close(got, want, atol=0.5, rtol=0.05)
    assert not applies(copy.deepcopy(model).half())  # float16: not packed, runs as nn.Linear
    half = copy.deepcopy(model).half()
    assert not half.model.layers[0].mlp.up_proj.weight.is_mkldnn


def test_an_engine_packs_its_model_when_told_to_and_answers_alike(tiny_tokenizer):
    model = tiny_llama(len(tiny_tokenizer), seed=5)
    plain = copy.deepcopy(model)
    packed_engine = PCDEngine(model, tiny_tokenizer, pack_weights=True)
    plain_engine = PCDEngine(plain, tiny_tokenizer, pack_weights=False)
    assert isinstance(model.model.layers[0].self_attn.o_proj, PackedLinear)
    assert type(plain.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    assert packed_engine.model_identity == plain_engine.model_identity  # calibrations carry over
    got = packed_engine.classify_batch(TEXTS, Ticket)
    want = plain_engine.classify_batch(TEXTS, Ticket)
    for a, b in zip(got, want, strict=True):
        assert a.value == b.value
        for path, field in a.fields.items():
            for value, p in field.probabilities.items():
                assert p == pytest.approx(b.fields[path].probabilities[value], abs=1e-5)
    asked = [{"role": "user", "content": TEXTS[0]}]
    assert packed_engine.generate(asked, max_tokens=8).text == plain_engine.generate(asked, max_tokens=8).text


@pytest.mark.parametrize("faster", [True, False])
def test_by_default_an_engine_packs_where_timing_says_packing_is_faster(tiny_tokenizer, monkeypatch, faster):
    import pcd_engine.engine

    model = tiny_llama(len(tiny_tokenizer), seed=5)
    timed = []
    monkeypatch.setattr(pcd_engine.engine, "pays", lambda m: timed.append(m) or faster)
    engine = PCDEngine(model, tiny_tokenizer)
    assert timed == [model] and isinstance(model.lm_head, PackedLinear) is faster
    assert engine._options["pack_weights"] is faster  # siblings (rendered_with) reuse the answer
    PCDEngine(tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, pack_weights=True)
    assert timed == [model]  # True packs without timing


def test_timing_packed_weights_leaves_the_model_as_it_is_and_answers_a_bool(tiny_tokenizer):
    model = tiny_llama(len(tiny_tokenizer), seed=5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert pays(model) in (True, False)
    assert all(type(m) is not PackedLinear for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert pays(model.to(torch.float16)) is False  # packing does not apply
