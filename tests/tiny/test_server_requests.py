"""The requests clients migrating from vLLM, SGLang and llama.cpp send, against `pcd serve` on the
tiny model (uvicorn on 127.0.0.1): sampling fields honoured, llama.cpp's and SGLang's schema forms, a
root-enum schema answered as a choice, `{}` as any JSON object, one schema sent twice, template
switches the template does not read ignored (those it reads: test_server_template.py), and vLLM's
refusals (tool_choice without tools, empty tools, a constraint-less `structured_outputs`) with a 400
naming the field. Plus `/health` before start and after stop, and a server without `--schema`
refusing `/classify`."""

from __future__ import annotations

import json

import httpx
import pytest

from minicpm_pcd_adapters.server.app import create_app
from minicpm_pcd_adapters.server.settings import ServerSettings
from pcd_engine import Sampling
from tests.helpers import ROUTE, served

ASKED = [{"role": "user", "content": "The app crashes when I pay."}]


@pytest.fixture(scope="module")
def url(engine):
    with served(create_app(engine, ServerSettings(model_name="tiny"))) as base:
        yield base


def post(url, body, path="/v1/chat/completions"):
    return httpx.post(url + path, json={"model": "tiny", **body}, timeout=120)


def fields(answer):
    return {p: f["probabilities"] for p, f in answer["choices"][0]["pcd"]["fields"].items()}


def test_sampling_fields_are_honoured_as_the_engine_samples(url, engine):
    body = {"messages": ASKED, "max_tokens": 6, "temperature": 0.9, "seed": 7}
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3}
    answer = post(url, body | extra).json()["choices"][0]["message"]["content"]
    sampling = Sampling(temperature=0.9, seed=7, top_k=5, min_p=0.05, repetition_penalty=1.3)
    assert answer == engine.generate(ASKED, max_tokens=6, sampling=sampling).text
    off = post(url, body | {"top_k": -1}).json()["choices"][0]["message"]["content"]  # -1: off, as vLLM
    assert off == engine.generate(ASKED, max_tokens=6, sampling=Sampling(temperature=0.9, seed=7)).text
    n_probs = post(url, {"messages": ASKED, "max_tokens": 2, "n_probs": 3}).json()["choices"][0]["logprobs"]
    assert len(n_probs["content"]) == 2 and all(len(t["top_logprobs"]) == 3 for t in n_probs["content"])


def test_llama_cpp_and_sglang_schema_forms_and_one_schema_sent_twice_answer_as_json_schema(url):
    want = fields(
        post(
            url,
            {
                "messages": ASKED,
                "response_format": {"type": "json_schema", "json_schema": {"name": "Route", "schema": ROUTE}},
            },
        ).json()
    )
    forms = [
        {"response_format": {"type": "json_object", "schema": ROUTE}},  # llama.cpp
        {"response_format": {"type": "json_schema", "schema": ROUTE}},
        {"json_schema": ROUTE},  # SGLang's and llama.cpp's own parameter
        {
            "json_schema": ROUTE,
            "response_format": {"type": "json_schema", "json_schema": {"name": "Route", "schema": ROUTE}},
        },
    ]
    for form in forms:
        answer = post(url, {"messages": ASKED, **form})
        assert answer.status_code == 200, (form, answer.text)
        got = fields(answer.json())
        assert got.keys() == want.keys()
        for path in want:
            assert got[path] == pytest.approx(want[path], abs=1e-6), form
    other = {"json_schema": {**ROUTE, "required": ["topic"]}}
    twice = post(
        url,
        {
            "messages": ASKED,
            "response_format": {"type": "json_schema", "json_schema": {"name": "Route", "schema": ROUTE}},
            **other,
        },
    )
    assert twice.status_code == 400 and twice.json()["error"]["code"] == "conflicting_parameters"


def test_a_root_enum_is_a_scored_choice_and_an_empty_schema_any_json_object(url, engine):
    schema = {"title": "Topic", "type": "string", "enum": ["billing", "bug", "other"]}
    format_ = {"type": "json_schema", "json_schema": {"name": "Topic", "schema": schema}}
    answer = post(url, {"messages": ASKED, "response_format": format_}).json()
    content = answer["choices"][0]["message"]["content"]
    topic = answer["choices"][0]["pcd"]["fields"]["choice"]
    assert json.loads(content) == topic["value"] and content.startswith('"')  # a JSON string
    assert sum(topic["probabilities"].values()) == pytest.approx(1.0)
    numbers = post(url, {"messages": ASKED, "json_schema": {"enum": [1, 2, 3]}}).json()
    assert json.loads(numbers["choices"][0]["message"]["content"]) in (1, 2, 3)
    for form in (
        {"json_schema": {}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "any", "schema": {}}}},
    ):
        anything = post(url, {"messages": ASKED, "max_tokens": 24, **form}).json()
        expected = engine.generate(ASKED, max_tokens=24, json_object=True).text
        assert anything["choices"][0]["message"]["content"] == expected, form
        assert "pcd" not in anything["choices"][0]


def test_what_vllm_refuses_is_refused_naming_the_field(url):
    def refused(body):
        answer = post(url, {"messages": ASKED, **body})
        assert answer.status_code == 400, (body, answer.text)
        return answer.json()["error"]["param"]

    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    assert refused({"tool_choice": "required"}) == "tool_choice"
    assert refused({"tool_choice": {"type": "function", "function": {"name": "lookup"}}}) == "tool_choice"
    assert refused({"tools": []}) == "tools"
    assert (
        refused({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "other"}}})
        == "tool_choice"
    )
    assert refused({"structured_outputs": {}}) == "structured_outputs"
    assert post(url, {"messages": ASKED, "tool_choice": "none", "max_tokens": 2}).status_code == 200
    assert post(url, {"messages": ASKED, "tool_choice": "auto", "max_tokens": 2}).status_code == 200


def test_template_kwargs_through_the_server(url):
    body = {"messages": ASKED, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert post(url, body).status_code == 200  # the tiny template reads no switch: ignored, as vLLM


def test_health_is_503_until_started_and_after_stop_and_classify_needs_a_served_schema(engine):
    import asyncio

    app = create_app(engine, ServerSettings(model_name="tiny"))

    async def health() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # no lifespan: the server has not started
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/health")

    before = asyncio.run(health())
    assert before.status_code == 503 and before.json()["status"] == "starting"
    with served(app) as base:
        assert httpx.get(base + "/health").json()["status"] == "ok"
        refused = httpx.post(base + "/classify", json={"input": "hi"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "no_served_schema"
    after = asyncio.run(health())
    assert after.status_code == 503 and after.json()["status"] == "stopped"


def test_a_served_schema_without_a_closed_field_stops_the_server_before_it_serves(engine, tmp_path):
    from minicpm_pcd_adapters.cli.main import main

    schema = tmp_path / "note.json"
    schema.write_text(
        json.dumps({"title": "Note", "type": "object", "properties": {"note": {"type": "string"}}})
    )
    with pytest.raises(ValueError, match="first closed field"):
        create_app(engine, ServerSettings(model_name="tiny", schema=str(schema)))
    assert (
        main(["serve", "--model", "smollm2", "--schema", str(tmp_path / "missing.json")]) == 2
    )  # before loading


def test_n_choices_of_a_scored_answer_say_which_choice_they_repeat(url):
    format_ = {"type": "json_schema", "json_schema": {"name": "Route", "schema": ROUTE}}
    body = {"messages": ASKED, "response_format": format_, "n": 3, "temperature": 0.8, "seed": 1}
    choices = post(url, body).json()["choices"]
    assert "same_scores_as" not in choices[0]["pcd"]
    assert [c["pcd"]["same_scores_as"] for c in choices[1:]] == [0, 0]
    assert len({c["message"]["content"] for c in choices}) == 1  # decided whole: the same object
    prompts = {"prompt": ["Route: refund me\n", "Route: it crashes\n"], "n": 2, "guided_json": ROUTE}
    texts = post(url, prompts, "/v1/completions").json()["choices"]
    assert [c["pcd"].get("same_scores_as") for c in texts] == [None, 0, None, 2]
