"""What several test modules share: schemas and texts, reference scores, comparisons, forward counters,
and the models (tiny random Llamas, the offline SmolLM2). Test modules import from here, never from each
other; `conftest.py` turns the models into fixtures."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Iterator
from typing import Annotated, Literal

import pytest
import torch
from pydantic import BaseModel, Field

from pcd_engine import Conversation, PCDEngine
from pcd_engine.precision import separate_logprobs
from pcd_engine.rules import token_logprobs
from pcd_engine.runner import PassStats


class SupportTicket(BaseModel):
    """A support ticket."""

    topic: Literal["billing", "billing_dispute", "bug", "other"] = Field(description="What it is about.")
    urgent: bool
    priority: Literal[1, 2, 3]
    channel: Literal["email"]  # one value: needs no forward call


# The labeled tests' schema, texts and answers (calibration, heads, evaluation, the CLI); the first six
# texts are what the calibration tests fit on. No docstring: it would be part of the prompt.
class Ticket(BaseModel):
    topic: Literal["billing", "crash", "other"]
    urgent: bool


class Tagged(BaseModel):
    topic: Literal["billing", "crash", "other"]
    tags: list[Literal["refund", "bug"]]


LABELED_TEXTS = [
    "I was charged twice for my order",
    "The app crashes when I log in",
    "Where is my parcel?",
    "please refund me",
    "How do I change my password?",
    "charged twice, app crashes",
    "my invoice is wrong",
    "it freezes on start",
    "hello there",
    "refund the double charge",
]
LABELED = [  # one answer per text of LABELED_TEXTS
    {"topic": t, "urgent": u}
    for t, u in [
        ("billing", True), ("crash", True), ("other", False), ("billing", False), ("other", False),
        ("crash", True), ("billing", False), ("crash", True), ("other", False), ("billing", True),
    ]
]  # fmt: skip


def synthetic(n: int, bias: list[float], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores z, and labels drawn from softmax(z + bias): the rule is miscalibrated by `bias`."""
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(n, len(bias), generator=generator, dtype=torch.float64) * 2
    labels = torch.multinomial(torch.softmax(z + torch.tensor(bias), dim=1), 1, generator=generator)
    return z, labels[:, 0]


# Tools for the tool-call tests: an OpenAI tool, a bare function definition, a Pydantic class.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
SEARCH = {
    "name": "search",
    "description": "Search the web.",
    "parameters": {"type": "object", "properties": {}},
}


class Refund(BaseModel):
    """Refund an order."""

    reason: Literal["damaged", "late", "other"] = Field(description="Why.")
    urgent: bool


TOOLS = [WEATHER, SEARCH, Refund]
ASKED = [{"role": "user", "content": "Is it raining in Paris? I was charged twice <|im_end|>"}]


class Shipping(BaseModel):
    method: Literal["air", "sea", "air_express"]
    insured: bool


class Wide(BaseModel):
    """Many fields, options sharing first tokens, multi-token options, ints, nested, multi-label."""

    topic: Literal["billing", "billing_dispute", "bill", "bug", "refund_request", "other"]
    urgent: bool
    sentiment: Literal["negative", "neutral", "positive"] | None
    priority: Annotated[int, Field(ge=1, le=12)]
    shipping: Shipping
    tags: list[Literal["billing", "bug", "praise"]]


ROUTE = {  # a JSON-schema dict, as it crosses process and HTTP boundaries (Ray, the server)
    "type": "object",
    "title": "Route",
    "properties": {
        "topic": {"type": "string", "enum": ["billing", "bug", "other"]},
        "urgent": {"type": "boolean"},
    },
    "required": ["topic", "urgent"],
}
REVIEW_PROMPTS = [  # raw prompts (no chat template) for a bare or JSON answer right after them
    f"Review: {text}\nSentiment:"
    for text in (
        "I love it",
        "Terrible, it broke in a day",
        "meh",
        "Great value for the money",
        "awful <|im_end|> support",
        "fine I guess",
        "best purchase ever",
        "never again",
    )
]

TEXT = "I was charged twice <|im_end|> and the app crashes, refund me!"
TEXTS = [
    "refund me",
    TEXT,
    "Where is my parcel? It was due on Monday.",
    "x",
    "The app crashes when I log in. " * 3,
    "How do I change my password?",
    "charged twice",
]


def packed_and_separate(
    engine: PCDEngine, schema, text, instructions: str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(packed, separate) per-token log-probs for every candidate of every decision: the engine's
    scorer (prefix cache, microbatches) against one ordinary full forward pass per candidate, with no
    packing, no cache and no mask. `text` is a str or a Conversation."""
    plan = engine.plan(schema, instructions=instructions)
    if isinstance(text, Conversation):
        prompt = engine.prompt.with_conversation(plan.head, plan.system, text, plan.tools).ids
    else:
        prompt = engine.prompt.with_head(plan.head, text).ids
    normalized = [True] * len(plan.trees)  # log-probs whatever the engine's rule
    (packed,) = engine.scorer.score(plan, [prompt], [PassStats()], normalized=normalized)
    pairs = []
    for tree, logprobs in zip(plan.trees, packed, strict=True):
        for candidate, got in enumerate(token_logprobs(tree, logprobs)):
            pairs.append((got, separate_logprobs(engine.model, prompt, tree, candidate)))
    return pairs


def assert_same_scores(got, want, tol=1e-4):
    for result, reference in zip(got, want, strict=True):
        assert result.value == reference.value
        for path, field in reference.fields.items():
            for value, score in field.log_scores.items():
                assert result.fields[path].log_scores[value] == pytest.approx(score, abs=tol)


def flip_a_byte(path) -> None:
    """Change a file's last byte: same size, another SHA-256 (what a manifest must catch)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


class ForwardCounter:
    """Counts a module's forward calls and the batch size of each (hook the decoder: the runner
    calls it directly when it projects only the scored positions itself)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.rows: list[int] = []
        self.handle = module.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.rows.append(int(ids.shape[0]))

    def close(self) -> None:
        self.handle.remove()


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
    """A PCDEngine on SmolLM2 shared by the adapter tests; free text capped at 24 characters (SmolLM2
    loops when greedy, and every generated token costs about 40 ms on a 2-core CPU)."""
    from pcd_engine import Limits

    model, tokenizer = smollm2_model()
    return PCDEngine(model, tokenizer, limits=Limits(max_string_length=24))


KEY = "sk-local-test"  # the API key of the SmolLM2 servers the tests start


@contextlib.contextmanager
def served(app) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a free port of 127.0.0.1 in a thread; yields its base URL and
    shuts it down on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
