"""Shared fixtures: a tiny trained BPE tokenizer with a ChatML template, tiny random Llamas, SmolLM2."""

from __future__ import annotations

import functools
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

CORPUS = [
    'Reply with one JSON object: {"topic": "billing", "urgent": true, "priority": 3}',
    '{"sentiment": "negative"} {"sentiment": "neutral"} {"sentiment": "positive"} null false true',
    "I was charged twice for my order, please refund me. The app crashes when I log in.",
    "Where is my parcel? It was due on Monday. How do I change my password and my email?",
    '{"tags": {"billing": true, "bug": false}} {"shipping": {"method": "air", "fast": false}}',
    "Classify the text in the user's message. Fields: One of: true or false. An integer from 1 to 5.",
] * 20


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def tiny_llama(vocab_size: int, attn: str = "sdpa", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random init is near-uniform; sharpen it so scores differ clearly
        model.lm_head.weight.mul_(20.0)
    return model


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return tiny_llama(len(tiny_tokenizer))


@functools.cache
def smollm2_model():
    """(model, tokenizer) of the offline SmolLM2-135M-Instruct GGUF, FP32 on CPU (loaded once)."""
    from minicpm_pcd_adapters import smollm2_gguf_path
    from pcd_engine.loading import load_model_and_tokenizer

    try:
        path = smollm2_gguf_path()
    except Exception as error:  # the package is installed by the README's test command
        pytest.fail(f"SmolLM2 is required for the slow tests: {error}")
    return load_model_and_tokenizer(path, device="cpu")


@functools.cache
def smollm2_engine():
    """A PCDEngine on SmolLM2 shared by the adapter tests; free text capped (SmolLM2 loops when greedy)."""
    from pcd_engine import Limits, PCDEngine

    model, tokenizer = smollm2_model()
    return PCDEngine(model, tokenizer, limits=Limits(max_string_length=48))


@pytest.fixture(scope="session")
def smollm2():
    return smollm2_model()
