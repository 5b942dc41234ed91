"""Ollama's API on `pcd serve` (the session server on SmolLM2), driven by Ollama's own clients: the
`ollama` Python client, LangChain's `ChatOllama` and LlamaIndex's `Ollama`, unchanged but for the
address (and the server's key, in a header). Answers equal the in-process engine's; streams are NDJSON
ending with `done`; errors are Ollama's `{"error": ...}`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import ollama
import pytest
from langchain_ollama import ChatOllama
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.ollama import Ollama

from pcd_engine import Sampling
from tests.helpers import KEY

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from ticket import Ticket  # noqa: E402

TEXT = "I was charged twice for my subscription, please refund the second payment today."
HEADERS = {"Authorization": f"Bearer {KEY}"}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "Find an order by its id.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"],
        },
    },
}


@pytest.fixture(scope="module")
def base(url):
    return url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(base):
    return ollama.Client(host=base, headers=HEADERS)


def test_the_ollama_client_lists_shows_and_answers_a_schema_as_the_engine_does(client, base, engine):
    (listed,) = client.list().models
    assert listed.model == "smollm2:latest"
    shown = client.show("smollm2")
    assert shown.modelinfo["llama.context_length"] == engine.limits.max_prompt_tokens
    assert client.show("smollm2:latest").template == engine.tokenizer.chat_template
    reference = engine.classify(TEXT, Ticket)
    for model in ("smollm2", "smollm2:latest"):
        answer = client.chat(
            model=model,
            messages=[{"role": "user", "content": TEXT}],
            format=Ticket.model_json_schema(),
            stream=False,
        )
        assert Ticket.model_validate_json(answer.message.content) == reference.value
        assert answer.done and answer.done_reason == "stop"
        assert answer.prompt_eval_count == reference.diagnostics.prompt_tokens and answer.eval_count == 0
        # a scored answer is one packed forward call: prompt evaluation, nothing decoded
        assert 0 < answer.prompt_eval_duration < answer.total_duration and answer.eval_duration == 0
    raw = httpx.post(
        base + "/api/chat",
        json={
            "model": "smollm2",
            "messages": [{"role": "user", "content": TEXT}],
            "format": Ticket.model_json_schema(),
        },
        headers=HEADERS,
        timeout=300,
    )  # `stream` left out: Ollama streams by default
    lines = [json.loads(line) for line in raw.text.splitlines()]
    assert raw.headers["content-type"].startswith("application/x-ndjson")
    assert [line["done"] for line in lines] == [False, True]
    assert json.loads(lines[0]["message"]["content"]) == reference.to_json()["value"]
    topic = lines[1]["pcd"]["fields"]["topic"]["probabilities"]
    for value, p in reference.fields["topic"].to_json()["probabilities"].items():
        assert topic[value] == pytest.approx(p, abs=1e-4)
    assert httpx.get(base + "/api/version", headers=HEADERS).json()["version"]


def test_chat_and_generate_stream_what_the_engine_generates(client, engine):
    asked = [{"role": "user", "content": "Say hello to the support team."}]
    options = {"num_predict": 12, "temperature": 0.7, "seed": 3, "top_k": 20, "repeat_penalty": 1.1}
    parts = list(client.chat(model="smollm2", messages=asked, stream=True, options=options))
    sampling = Sampling(temperature=0.7, seed=3, top_k=20, repetition_penalty=1.1)
    want = engine.generate(asked, max_tokens=12, sampling=sampling)
    assert "".join(p.message.content for p in parts) == want.text
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert (
        parts[-1].eval_count == want.completion_tokens and parts[-1].prompt_eval_count == want.prompt_tokens
    )
    phases = parts[-1].prompt_eval_duration, parts[-1].eval_duration
    assert all(phases) and sum(phases) <= parts[-1].total_duration
    generated = client.generate(
        model="smollm2", prompt="Say hello to the support team.", options={"num_predict": 6}
    )
    assert generated.response == engine.generate(asked, max_tokens=6).text
    assert generated.prompt_eval_duration > 0 and generated.eval_duration > 0  # not streamed
    system = client.generate(
        model="smollm2", prompt="Hi", system="Answer in French.", options={"num_predict": 5}
    )
    with_system = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    assert system.response == engine.generate(with_system, max_tokens=5).text
    json_mode = client.chat(model="smollm2", messages=asked, format="json", options={"num_predict": 30})
    assert json_mode.message.content == engine.generate(asked, max_tokens=30, json_object=True).text
    loaded = client.generate(model="smollm2", prompt="")
    assert loaded.done and loaded.done_reason == "load"


def test_tools_are_a_scored_decision(client, engine):
    asked = [{"role": "user", "content": "Where is my order A123?"}]
    answer = client.chat(model="smollm2", messages=asked, tools=[LOOKUP])
    want = engine.tools.call(asked, [LOOKUP])
    assert want.tool == "lookup_order"
    (call,) = answer.message.tool_calls
    assert call.function.name == want.tool and call.function.arguments == want.arguments
    assert answer.prompt_eval_duration > 0 and answer.eval_duration > 0  # scored, then `order_id` generated


def test_langchain_chat_ollama_structured_output_and_tools(base, engine):
    llm = ChatOllama(model="smollm2", base_url=base, client_kwargs={"headers": HEADERS})
    assert (
        llm.with_structured_output(Ticket, method="json_schema").invoke(TEXT)
        == engine.classify(TEXT, Ticket).value
    )
    called = llm.bind_tools([LOOKUP]).invoke("Where is my order A123?")
    assert called.tool_calls[0]["name"] == "lookup_order" and called.tool_calls[0]["args"] == {
        "order_id": "A123"
    }
    short = ChatOllama(model="smollm2", base_url=base, num_predict=8, client_kwargs={"headers": HEADERS})
    streamed = "".join(str(chunk.content) for chunk in short.stream("Hi"))
    assert streamed == engine.generate([{"role": "user", "content": "Hi"}], max_tokens=8).text


def test_llama_index_ollama_structured_predict_and_chat(base, engine):
    llm = Ollama(model="smollm2", base_url=base, request_timeout=300, headers=HEADERS, context_window=4096)
    predicted = llm.structured_predict(Ticket, PromptTemplate("{text}"), text=TEXT)
    assert predicted == engine.classify(TEXT, Ticket).value
    short = Ollama(
        model="smollm2",
        base_url=base,
        headers=HEADERS,
        context_window=4096,
        additional_kwargs={"num_predict": 6},
    )
    said = short.chat([ChatMessage(role="user", content="Hi")])
    assert said.message.content == engine.generate([{"role": "user", "content": "Hi"}], max_tokens=6).text


def test_errors_are_ollamas_and_name_the_cause(base):
    def error(path, body, status):
        answer = httpx.post(base + path, json=body, headers=HEADERS, timeout=60)
        assert answer.status_code == status, answer.text
        return answer.json()["error"]

    hi = [{"role": "user", "content": "hi"}]
    assert error("/api/chat", {"model": "llama3", "messages": hi}, 404) == "model 'llama3' not found"
    thinking = error("/api/chat", {"model": "smollm2", "messages": hi, "think": True}, 400)
    assert thinking == '"smollm2" does not support thinking'  # SmolLM2's template has no switch
    assert "images" in error(
        "/api/chat", {"model": "smollm2", "messages": [hi[0] | {"images": ["aGk="]}]}, 400
    )
    assert "template" in error(
        "/api/generate", {"model": "smollm2", "prompt": "x", "template": "{{ .Prompt }}"}, 400
    )
    assert "format" in error(
        "/api/chat", {"model": "smollm2", "messages": hi, "tools": [LOOKUP], "format": "json"}, 400
    )
    with pytest.raises(ollama.ResponseError) as raised:
        ollama.Client(host=base, headers=HEADERS).chat(model="other", messages=hi)
    assert raised.value.status_code == 404
    assert (
        httpx.post(base + "/api/chat", json={"model": "smollm2", "messages": hi}).status_code == 401
    )  # the key
