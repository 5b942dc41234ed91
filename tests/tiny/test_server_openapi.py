"""Schemathesis fuzzes `pcd serve` (uvicorn on 127.0.0.1, the tiny model) from the app's own
`/openapi.json`: no request gets a 500, every status is one the document lists, every body (2xx and
errors alike) conforms to the documented schema (OpenAI's error shape for errors), and the API key is
enforced on every path but /health. Bounded: a fixed number of examples per operation."""

from __future__ import annotations

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode, checks

from minicpm_pcd_adapters.server.app import create_app
from minicpm_pcd_adapters.server.settings import ServerSettings
from pcd_engine import Limits, PCDEngine
from tests.helpers import served

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTE = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "enum": ["billing", "bug", "other"]},
        "note": {"type": "string", "maxLength": 8},
        "urgent": {"type": "boolean"},
    },
    "required": ["topic", "note", "urgent"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "Route", "schema": ROUTE}}
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.ignored_auth,
]


@pytest.fixture(scope="module")
def url(tiny_model, tiny_tokenizer, tmp_path_factory):
    engine = PCDEngine(tiny_model, tiny_tokenizer, limits=Limits(max_generated_tokens=24))
    schema = tmp_path_factory.mktemp("served") / "route.json"  # what /classify answers with
    closed = {**ROUTE, "properties": {k: v for k, v in ROUTE["properties"].items() if k != "note"}}
    schema.write_text(json.dumps({**closed, "title": "Route", "required": ["topic", "urgent"]}))
    settings_ = ServerSettings(
        model_name="tiny",
        api_key=KEY,
        max_tokens=8,
        max_completion_tokens=16,
        max_text_chars=2000,
        schema=str(schema),
    )
    with served(create_app(engine, settings_)) as base:
        yield base


@pytest.fixture(scope="module")
def api(url):
    return schemathesis.openapi.from_url(url + "/openapi.json", headers=AUTH)


OPERATIONS = [
    "GET /health",
    "GET /metrics",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "GET /v1/calibrations",
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /classify",
    "POST /v1/classify",
    "POST /tokenize",
    "POST /detokenize",
]


def test_the_fuzzed_operations_are_all_the_documented_ones(api):
    assert sorted(result.ok().label for result in api.get_all_operations()) == sorted(OPERATIONS)


def structured(case):
    """The case with a schema to answer: its own options (n, stream, logprobs, abstain_below ...)
    then reach the scoring path instead of plain chat."""
    if isinstance(case.body, dict):
        case.body = {k: v for k, v in case.body.items() if k not in ("tools", "tool_choice")}
        case.body["response_format"] = FORMAT
    return case


def decided(case):
    """The case with tools the model chooses between (its own fuzzed tools where it has some):
    its options then reach the tool decision path."""
    if isinstance(case.body, dict):
        case.body = {k: v for k, v in case.body.items() if k != "response_format"}
        case.body["tools"] = case.body.get("tools") or [
            {"type": "function", "function": {"name": "route", "parameters": ROUTE}},
            {"type": "function", "function": {"name": "lookup", "description": "Find an order."}},
        ]
        case.body["tool_choice"] = "auto"
    return case


def chosen(case):
    """The case with a vLLM choice: its own options then reach the scored one-field answer (after
    the conversation, or after every raw prompt)."""
    if isinstance(case.body, dict):
        drop = {"tools", "tool_choice", "response_format", "structured_outputs", "structural_tag"}
        drop |= {"guided_json", "guided_regex", "guided_grammar", "regex", "ebnf", "json_schema", "grammar"}
        case.body = {k: v for k, v in case.body.items() if k not in drop}
        case.body["guided_choice"] = ["billing", "bug", "other"]
    return case


POST = "POST /v1/chat/completions"
COMPLETIONS = "POST /v1/completions"
BODIES = ("POST /classify", "POST /tokenize")  # fuzzed with their own counts below


@pytest.mark.parametrize(
    ("label", "mode", "examples"),
    [(label, GenerationMode.POSITIVE, 8) for label in OPERATIONS if label not in (POST, COMPLETIONS, *BODIES)]
    + [
        (POST, GenerationMode.POSITIVE, 100),
        (POST, GenerationMode.NEGATIVE, 100),
        (POST + " structured", GenerationMode.POSITIVE, 100),
        (POST + " tools", GenerationMode.POSITIVE, 60),
        (POST + " choice", GenerationMode.POSITIVE, 40),
        (COMPLETIONS, GenerationMode.POSITIVE, 60),
        (COMPLETIONS, GenerationMode.NEGATIVE, 60),
        (COMPLETIONS + " choice", GenerationMode.POSITIVE, 40),
        ("POST /classify", GenerationMode.POSITIVE, 30),
        ("POST /classify", GenerationMode.NEGATIVE, 30),
        ("POST /tokenize", GenerationMode.POSITIVE, 30),
        ("POST /tokenize", GenerationMode.NEGATIVE, 30),
        ("POST /detokenize", GenerationMode.NEGATIVE, 20),
    ],
)
def test_the_api_answers_what_its_document_says(api, url, label, mode, examples):
    """Schemathesis' cases (Hypothesis drives them; schemathesis' pytest plugin does not run on
    pytest 9), valid bodies and invalid ones alike, each answered and checked."""
    operation = api.find_operation_by_label(
        label.split(" structured")[0].split(" tools")[0].split(" choice")[0]
    )
    cases = operation.as_strategy(generation_mode=mode)
    if label.endswith("choice"):
        cases = cases.map(chosen)
    if label.endswith("structured"):
        cases = cases.map(structured)
    if label.endswith("tools"):
        cases = cases.map(decided)
    extra = [checks.negative_data_rejection] if mode == GenerationMode.NEGATIVE else []

    @given(case=cases)
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,  # the same cases on every run (CI); vary the seed by hand to explore
    )
    def answered(case):
        case.call_and_validate(base_url=url, headers=AUTH, checks=CHECKS + extra)

    answered()


def test_the_document_describes_the_real_bodies(url):
    """Both request bodies are the models that check them; the answers carry `pcd` and `logprobs`."""
    document = requests.get(url + "/openapi.json", headers=AUTH, timeout=10).json()
    operation = document["paths"]["/v1/chat/completions"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "ChatCompletionRequest"
    )
    components = document["components"]["schemas"]
    assert components["ChatCompletionRequest"]["properties"]["model"]["enum"] == ["tiny"]
    assert "pcd" in components["Choice"]["properties"] and "logprobs" in components["Choice"]["properties"]
    assert set(operation["responses"]) >= {"200", "400", "401", "404", "413", "500", "503", "504"}
    assert requests.get(url + "/openapi.json", timeout=10).status_code == 401  # behind the key too
    assert document["paths"]["/health"]["get"]["security"] == []
    completions = document["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "CompletionRequest"
    )
    request = components["CompletionRequest"]["properties"]
    assert request["model"]["enum"] == ["tiny"]
    assert {"guided_choice", "structured_outputs", "regex", "ebnf", "grammar", "json_schema"} <= set(request)
    assert "pcd" in components["TextChoice"]["properties"]
