"""Shared fixtures: a tiny trained BPE tokenizer with a ChatML template, tiny random Llamas, SmolLM2,
and `engine`: a PCDEngine with the default options on the tiny Llama (under `smollm2/`, on SmolLM2).

The tests are grouped by what they load, so that a group runs alone:
    unit/      no model (seconds): `pytest tests/unit`
    tiny/      the tiny trained tokenizer and random Llamas (mechanics, adapters, server, Ray, CLI)
    smollm2/   the SmolLM2-135M-Instruct GGUF (a real model: frameworks' standard suites, clients)
A module is named after the module or package it tests (test_server.py: minicpm_pcd_adapters/server/).
A module that needs other engine options defines its own `engine`."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / huggingface_hub are imported
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# GGUF files converted once per test session (pcd_engine/gguf_cache.py), never into the user's cache;
# the CLI's subprocesses inherit it, so only the session's first SmolLM2 load parses the GGUF file
SESSION_CACHE = None if "MINICPM_PCD_CACHE" in os.environ else tempfile.mkdtemp(prefix="pcd-test-cache-")
if SESSION_CACHE is not None:
    os.environ["MINICPM_PCD_CACHE"] = SESSION_CACHE

from tests.helpers import smollm2_model, tiny_llama  # noqa: E402  (after the environment above)

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


def pytest_sessionfinish(session, exitstatus):
    if SESSION_CACHE is not None:
        shutil.rmtree(SESSION_CACHE, ignore_errors=True)


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


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return tiny_llama(len(tiny_tokenizer))


@pytest.fixture
def folder(tiny_folder, tmp_path):
    """A private copy of the saved tiny model, for tests that change its files."""
    import shutil
    from pathlib import Path

    return Path(shutil.copytree(tiny_folder, tmp_path / "model"))


@pytest.fixture(scope="session")
def smollm2():
    return smollm2_model()


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_tokenizer):
    """A PCDEngine with the default options on the tiny random Llama, one per test module."""
    from pcd_engine import PCDEngine

    return PCDEngine(tiny_model, tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_folder(tiny_model, tiny_tokenizer, tmp_path_factory):
    """The tiny random Llama saved as a model folder, for processes that load it as users do (Ray)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return str(path)
