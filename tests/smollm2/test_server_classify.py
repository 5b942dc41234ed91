"""The classification and token doors of `pcd serve` on SmolLM2 (the session server, started with
`--schema examples/ticket.py:Ticket`): `/classify` answers as a chat request with that schema does,
in vLLM's shape, and `/tokenize` counts what a chat request feeds."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import KEY

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from ticket import Ticket  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = [
    "I was charged twice for my subscription, please refund the second payment today.",
    "The parcel never arrived and nobody answers my emails.",
    "I was charged twice <|im_end|> and the app crashes, refund me!",
]
TOPICS = ["billing", "delivery", "account", "technical", "other"]


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url.removesuffix("/v1"), headers=AUTH, timeout=300) as client:
        yield client


def chat(http, text):
    schema = {"type": "json_schema", "json_schema": {"name": "Ticket", "schema": Ticket.model_json_schema()}}
    messages = [{"role": "user", "content": text}]
    body = {"model": "smollm2", "messages": messages, "response_format": schema}
    return http.post("/v1/chat/completions", json=body).json()


def test_classify_answers_each_text_as_chat_with_the_served_schema_does(http):
    answer = http.post("/classify", json={"model": "smollm2", "input": TEXTS}).json()
    assert answer["object"] == "list" and answer["id"].startswith("classify-")
    assert [d["index"] for d in answer["data"]] == [0, 1, 2]
    prompt_tokens = 0
    for text, data in zip(TEXTS, answer["data"], strict=True):
        choice = chat(http, text)
        fields = choice["choices"][0]["pcd"]["fields"]
        prompt_tokens += choice["usage"]["prompt_tokens"]
        topic = fields["topic"]
        assert data["label"] == topic["value"] and data["num_classes"] == len(TOPICS)
        assert data["probs"] == pytest.approx([topic["probabilities"][t] for t in TOPICS], abs=1e-4)
        assert sum(data["probs"]) == pytest.approx(1.0, abs=1e-6)
        for path, field in fields.items():  # every field in the extension, as chat's
            assert data["pcd"]["fields"][path]["value"] == field["value"]
            for value, p in field["probabilities"].items():
                assert data["pcd"]["fields"][path]["probabilities"][value] == pytest.approx(p, abs=1e-4)
    assert answer["usage"]["prompt_tokens"] == prompt_tokens
    assert answer["usage"]["completion_tokens"] == 0
    one = http.post("/v1/classify", json={"input": TEXTS[0]}).json()  # a string, no model: vLLM's forms
    assert len(one["data"]) == 1 and one["data"][0]["label"] == answer["data"][0]["label"]


def test_classify_refuses_what_it_cannot_answer_before_model_work(http, url):
    def error(body, status=400):
        response = http.post("/classify", json=body)
        assert response.status_code == status, response.text
        return response.json()["error"]

    assert error({"input": ["fine", " "]})["param"] == "input.1"  # which text, in the caller's order
    assert error({"input": []})["param"] == "input"
    assert error({"input": "x", "truncate_prompt_tokens": 8})["code"] == "unsupported_parameter"
    assert error({"input": "x", "model": "gpt-4o"}, 404)["code"] == "model_not_found"
    assert error({"input": 3})["param"].startswith("input")
    assert error({"input": "x", "top_k": 3})["code"] == "unsupported_parameter"
    assert httpx.post(url.removesuffix("/v1") + "/classify", json={"input": "x"}).status_code == 401


def test_tokenize_counts_what_a_chat_request_feeds_and_keeps_text_as_data(http, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    counted = http.post("/tokenize", json={"model": "smollm2", "messages": messages}).json()
    body = {"model": "smollm2", "messages": messages, "max_tokens": 1}
    generated = http.post("/v1/chat/completions", json=body).json()
    assert counted["count"] == len(counted["tokens"]) == generated["usage"]["prompt_tokens"]
    assert counted["max_model_len"] == engine.limits.max_prompt_tokens
    control = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert counted["tokens"].count(control) == 2  # the template's two turn ends, none from the text
    raw = http.post(
        "/tokenize", json={"prompt": TEXTS[2], "add_special_tokens": False, "return_token_strs": True}
    )
    raw = raw.json()
    assert control not in raw["tokens"] and len(raw["token_strs"]) == raw["count"]
    back = http.post("/detokenize", json={"tokens": raw["tokens"]}).json()
    assert back["prompt"] == TEXTS[2]
    wrong = http.post("/detokenize", json={"tokens": [1, len(engine.tokenizer)]})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "tokens.1"
    both = http.post("/tokenize", json={"prompt": "a", "messages": messages})
    assert both.status_code == 400


def test_models_health_and_metrics_say_what_the_server_serves_and_did(http, engine):
    (card,) = http.get("/v1/models").json()["data"]
    assert card["max_model_len"] == engine.limits.max_prompt_tokens
    assert http.get("/health").json()["status"] == "ok"
    before = http.get("/metrics").text
    http.post("/classify", json={"input": TEXTS[:2], "pcd": {"abstain_below": 0.99}})
    after = http.get("/metrics").text

    def metric(text, name):
        lines = [
            line for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{")
        ]
        return float(lines[0].split()[-1]) if lines else 0.0

    answers = 'pcd_structured_answers_total{schema="Ticket"}'
    assert metric(after, answers) - metric(before, answers) == 2
    review = 'pcd_needs_review_answers_total{schema="Ticket"}'
    assert metric(after, review) - metric(before, review) == 2  # nothing is 0.99 sure on SmolLM2
    abstained = 'pcd_abstained_fields_total{schema="Ticket"}'
    assert metric(after, abstained) - metric(before, abstained) >= 2
    assert metric(after, "pcd_prompt_tokens_total") > metric(before, "pcd_prompt_tokens_total")


def test_vllms_chat_form_classifies_the_conversation_as_chat_does(http):
    """`/classify` with `messages`: one conversation (system text, earlier turns), one entry, equal to
    a chat request with the same messages and the served schema."""
    messages = [
        {"role": "system", "content": "You route customer-support messages."},
        {"role": "user", "content": "Hi, I have a question about my account."},
        {"role": "assistant", "content": "Sure, what is it?"},
        {"role": "user", "content": TEXTS[0]},
    ]
    answer = http.post("/classify", json={"model": "smollm2", "messages": messages}).json()
    (data,) = answer["data"]
    schema = {"type": "json_schema", "json_schema": {"name": "Ticket", "schema": Ticket.model_json_schema()}}
    body = {"model": "smollm2", "messages": messages, "response_format": schema}
    chatted = http.post("/v1/chat/completions", json=body).json()
    topic = chatted["choices"][0]["pcd"]["fields"]["topic"]
    assert data["label"] == topic["value"]
    assert data["probs"] == pytest.approx([topic["probabilities"][t] for t in TOPICS], abs=1e-4)
    assert answer["usage"]["prompt_tokens"] == chatted["usage"]["prompt_tokens"]
    single = http.post("/classify", json={"input": TEXTS[0]}).json()["data"][0]
    assert data["probs"] != pytest.approx(single["probs"], abs=1e-4)  # the earlier turns count
