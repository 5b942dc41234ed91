"""Template switches per request: `PCDEngine.rendered_with`, and every door of `pcd serve` that takes
them (chat's `chat_template_kwargs`, `/classify`'s chat form, `/tokenize`, Ollama's `think`), on the
tiny model with a template that reads `enable_thinking` (served off, as MiniCPM5's default)."""

from __future__ import annotations

import json

import httpx
import pytest

from minicpm_pcd_adapters.server.app import create_app
from minicpm_pcd_adapters.server.settings import ServerSettings
from pcd_engine import InputError, PCDEngine
from pcd_engine.engine import MAX_RENDERINGS
from tests.conftest import CHATML
from tests.helpers import ROUTE, served

# Off: an empty thinking block; on: the generation prompt opens the thinking (as MiniCPM5 and Qwen3).
THINKING = CHATML + (
    "{% if add_generation_prompt %}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
ASKED = [
    {"role": "system", "content": "Route the ticket."},
    {"role": "user", "content": "I was charged twice"},
]
ON, OFF = {"enable_thinking": True}, {"enable_thinking": False}


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinking-tokenizer")
    tiny_tokenizer.save_pretrained(folder)
    tokenizer = tiny_tokenizer.__class__.from_pretrained(folder)
    tokenizer.chat_template = THINKING
    return PCDEngine(tiny_model, tokenizer, chat_template_kwargs=OFF)


@pytest.fixture(scope="module")
def url(engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("route")
    (folder / "schema.json").write_text(json.dumps(ROUTE))
    texts = [f"{t} #{i}" for i, t in enumerate(["refund me", "the app crashes", "hello there"] * 3)]
    labels = [{"topic": t, "urgent": u} for t, u in [("billing", True), ("bug", True), ("other", False)] * 3]
    fitted = engine.calibrate(
        ROUTE, texts, labels, method="temperature", folds=2, instructions=ASKED[0]["content"]
    )
    fitted.save(folder / "route.json")  # for requests with ASKED's system text, rendered as served
    settings = ServerSettings(
        model_name="tiny", schema=str(folder / "schema.json"), calibrations=(str(folder / "route.json"),)
    )
    with served(create_app(engine, settings)) as base:
        yield base


def probabilities(result):
    return {path: field.probabilities for path, field in result.fields.items()}


def flat(fields) -> dict[str, float]:
    """Per-field probabilities as one mapping of `path=value` (values written as JSON keys are)."""
    label = lambda v: v if isinstance(v, str) else json.dumps(v)  # noqa: E731
    return {f"{path}={label(v)}": p for path, probs in fields.items() for v, p in probs.items()}


def test_a_sibling_renders_with_the_switches_and_shares_the_model_and_prefix_cache(engine, tiny_model):
    on = engine.rendered_with(ON)
    assert on is not engine and on.model is engine.model and on.prefix_cache is engine.prefix_cache
    assert on.prompt.template_kwargs == ON and engine.prompt.template_kwargs == OFF
    assert engine.tokenizer.decode(on.prompt.tail).endswith("assistant\n<think>\n")
    assert engine.rendered_with(ON) is on and on.rendered_with(OFF) is engine  # kept; back to the root
    assert engine.rendered_with(OFF) is engine and engine.rendered_with({"unread": 1}) is engine
    alone = PCDEngine(tiny_model, engine.tokenizer, chat_template_kwargs=ON)
    for text in ("I was charged twice", "The app crashes"):
        got, want = on.classify(text, ROUTE), alone.classify(text, ROUTE)
        assert got.value == want.value
        assert flat(probabilities(got)) == pytest.approx(flat(probabilities(want)), abs=1e-6)
    assert probabilities(on.classify("I was charged twice", ROUTE)) != probabilities(
        engine.classify("I was charged twice", ROUTE)
    )
    with pytest.raises(InputError, match="renderer sets this variable itself"):
        engine.rendered_with({"add_generation_prompt": False})


def test_a_sibling_of_a_bf16_engine_shares_its_fp32_reference_and_check(engine, tiny_model):
    import copy

    import torch

    lower = copy.deepcopy(tiny_model).to(torch.bfloat16)
    mixed = PCDEngine(lower, engine.tokenizer, reference_model=tiny_model, chat_template_kwargs=OFF)
    on = mixed.rendered_with(ON)
    assert on.model is lower and on.precision_check is mixed.precision_check is not None
    assert on.rescorer is not None and mixed.rescorer is not None
    assert on.rescorer.runner.model is tiny_model
    assert on.rescorer.scorer.prefix_cache is mixed.rescorer.scorer.prefix_cache


def test_siblings_are_bounded(engine):
    for effort in range(MAX_RENDERINGS + 3):
        engine.rendered_with({"enable_thinking": effort})  # numbers are switches too
    size, bound = engine.cache_sizes()["renderings"]
    assert size == bound == MAX_RENDERINGS


def post(url, path, body):
    return httpx.post(url + path, json={"model": "tiny", **body}, timeout=120)


def test_chat_template_kwargs_are_honoured_at_every_door(url, engine):
    on = engine.rendered_with(ON)
    schema = {"type": "json_schema", "json_schema": {"name": "Route", "schema": ROUTE}}
    chat = {"messages": ASKED, "response_format": schema}
    answered = post(url, "/v1/chat/completions", chat | {"chat_template_kwargs": ON}).json()
    want = probabilities(on.classify(_conversation(), ROUTE))
    fields = answered["choices"][0]["pcd"]["fields"]
    assert flat({p: f["probabilities"] for p, f in fields.items()}) == pytest.approx(flat(want), abs=1e-4)
    served_off = post(url, "/v1/chat/completions", chat).json()
    assert served_off["usage"]["prompt_tokens"] != answered["usage"]["prompt_tokens"]
    # the served calibration was fitted with thinking off: a request that turns it on goes without
    assert served_off["choices"][0]["pcd"]["calibration"]["name"] == "route"
    assert answered["choices"][0]["pcd"]["calibration"] is None

    classified = post(url, "/classify", {"messages": ASKED, "chat_template_kwargs": ON}).json()["data"]
    assert len(classified) == 1 and classified[0]["pcd"]["calibration"] is None
    assert (
        post(url, "/classify", {"messages": ASKED}).json()["data"][0]["pcd"]["calibration"]["name"] == "route"
    )
    assert classified[0]["probs"] == pytest.approx([want["topic"][v] for v in ("billing", "bug", "other")])

    plain = {"messages": ASKED, "max_tokens": 4}
    generated = post(url, "/v1/chat/completions", plain | {"chat_template_kwargs": ON}).json()
    assert generated["choices"][0]["message"]["content"] == on.generate(ASKED, max_tokens=4).text
    for switches, answer in ((ON, generated), (None, post(url, "/v1/chat/completions", plain).json())):
        tokens = post(url, "/tokenize", {"messages": ASKED, "chat_template_kwargs": switches}).json()
        assert tokens["count"] == answer["usage"]["prompt_tokens"]

    refused = post(url, "/v1/chat/completions", chat | {"chat_template_kwargs": {"tools": []}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs.tools"
    both = post(url, "/classify", {"input": "hi", "messages": ASKED})
    assert both.status_code == 400 and "either input or messages" in both.json()["error"]["message"]


def test_ollama_think_renders_with_thinking_on_and_answers_in_thinking(url, engine):
    on = engine.rendered_with(ON)
    body = {"messages": ASKED[1:], "think": True, "stream": False, "options": {"num_predict": 5}}
    answer = httpx.post(url + "/api/chat", json={"model": "tiny", **body}, timeout=120).json()
    text = on.generate(ASKED[1:], max_tokens=5).text
    # the prompt opened the thinking and a random model never closes it: all of it is thinking
    assert answer["message"]["thinking"] == text.lstrip() and answer["message"]["content"] == ""
    assert answer["prompt_eval_count"] == len(on.prompt.render_conversation(None, _conversation(ASKED[1:])))
    streamed = httpx.post(url + "/api/chat", json={"model": "tiny", **body, "stream": True}, timeout=120)
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert "".join(line["message"].get("thinking", "") for line in lines) == text.lstrip()
    off = httpx.post(url + "/api/chat", json={"model": "tiny", **body, "think": False}, timeout=120).json()
    assert (
        "thinking" not in off["message"]
        and off["message"]["content"] == engine.generate(ASKED[1:], max_tokens=5).text
    )
    show = httpx.post(url + "/api/show", json={"model": "tiny"}).json()
    assert "thinking" in show["capabilities"]


def test_ollama_think_on_a_model_without_the_switch_is_refused_as_ollama_does(tiny_model, tiny_tokenizer):
    app = create_app(PCDEngine(tiny_model, tiny_tokenizer), ServerSettings(model_name="tiny"))
    with served(app) as base:
        body = {"model": "tiny", "messages": ASKED, "think": True, "stream": False}
        refused = httpx.post(base + "/api/chat", json=body, timeout=60)
        assert refused.status_code == 400 and refused.json() == {"error": '"tiny" does not support thinking'}
        body["think"] = False  # off: nothing to switch, answered
        assert httpx.post(
            base + "/api/chat", json=body | {"options": {"num_predict": 2}}, timeout=60
        ).is_success


def _conversation(messages=ASKED):
    from pcd_engine import Conversation

    return Conversation.of(messages)
