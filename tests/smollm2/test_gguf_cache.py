"""GGUF files converted once (pcd_engine/gguf_cache.py): a load from SmolLM2's GGUF file keeps its
conversion (one checked against a manifest does not), and the model read from the converted folder is
the file's model (weights, logits, identity) and tokenizer."""

from __future__ import annotations

import torch
from transformers import modeling_gguf_pytorch_utils as gguf_utils

from minicpm_pcd_adapters import smollm2_gguf_path
from pcd_engine import gguf_cache
from pcd_engine.calibration import model_identity
from pcd_engine.loading import load_model_and_tokenizer
from pcd_engine.manifest import create_manifest
from tests.helpers import smollm2_engine

TEXTS = ["Hello <|im_start|>system\nYou are a pirate<|im_end|>", "Ünïcode, émojis 🙂 and  spaces\n\tTabs"]


def test_a_converted_gguf_loads_as_the_same_model_and_tokenizer(tmp_path, monkeypatch):
    path = smollm2_gguf_path()
    smollm2_engine()  # the session's SmolLM2, loaded once from the file: its conversion was kept
    assert gguf_cache.converted(path) is not None
    monkeypatch.setenv("MINICPM_PCD_CACHE", str(tmp_path))  # an empty cache from here on
    parsed: list[object] = []
    with monkeypatch.context() as patched:  # a manifest's checked file is read, and not kept
        patched.setattr(gguf_utils, "load_gguf_checkpoint", _counted(parsed))
        model, tokenizer = load_model_and_tokenizer(path, device="cpu", manifest=create_manifest(path.parent))
    assert parsed and gguf_cache.converted(path) is None
    folder = gguf_cache.keep(path, model, tokenizer)  # what a load from the file does after parsing it
    assert folder == gguf_cache.converted(path) == tmp_path / "gguf" / gguf_cache.digest(path)
    with monkeypatch.context() as patched:  # the file is not parsed again: the folder is read
        patched.setattr(gguf_utils, "load_gguf_checkpoint", _not_called)
        again, again_tokenizer = load_model_and_tokenizer(path, device="cpu")
    assert again.name_or_path == model.name_or_path == str(path.parent)  # named by the file's folder

    weights, kept = model.state_dict(), again.state_dict()
    assert weights.keys() == kept.keys()
    assert all(torch.equal(weights[name], kept[name]) for name in weights)
    ids = torch.tensor([tokenizer("Where is my parcel?")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)
    assert model_identity(model) == model_identity(again)  # calibrations fitted on one apply to the other

    assert again_tokenizer.chat_template == tokenizer.chat_template
    assert again_tokenizer.all_special_tokens == tokenizer.all_special_tokens
    assert again_tokenizer.get_added_vocab() == tokenizer.get_added_vocab()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]}]
    render = {"tokenize": False, "add_generation_prompt": True}
    assert again_tokenizer.apply_chat_template(messages, **render) == tokenizer.apply_chat_template(
        messages, **render
    )
    for text in TEXTS:
        for split in (False, True):
            want = tokenizer(text, add_special_tokens=False, split_special_tokens=split)["input_ids"]
            assert (
                again_tokenizer(text, add_special_tokens=False, split_special_tokens=split)["input_ids"]
                == want
            )

    monkeypatch.setenv("MINICPM_PCD_CACHE", "off")
    assert gguf_cache.converted(path) is None and gguf_cache.cache_root() is None


def _not_called(*args, **kwargs):
    raise AssertionError("the GGUF file was parsed again")


def _counted(calls):
    parse = gguf_utils.load_gguf_checkpoint

    def counted(*args, **kwargs):
        calls.append(args)
        return parse(*args, **kwargs)

    return counted
