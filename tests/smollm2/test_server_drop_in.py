"""`pcd serve` as a drop-in for vLLM, SGLang and llama.cpp servers, on SmolLM2: their constrained-
decoding parameters sent by the official openai SDK (the request code of vLLM's and SGLang's own
documented examples, replayed as written there), `/v1/completions` over raw prompts, and the errors.
A `choice` equals `engine.classify` on a one-field schema; 8 prompts in one request equal 8 calls."""

from __future__ import annotations

import enum
import json
import math
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from minicpm_pcd_adapters.server.app import create_app
from minicpm_pcd_adapters.server.constraints import choice_schema
from minicpm_pcd_adapters.server.settings import ServerSettings
from pcd_engine import RawPrompt
from tests.helpers import REVIEW_PROMPTS, served


@pytest.fixture(scope="module")
def url(engine):
    with served(create_app(engine, ServerSettings(model_name="smollm2", max_tokens=48))) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)


# -- vLLM's documented examples (docs/features/structured_outputs.md), as written there ----------


def test_vllm_documented_examples(client):
    model = client.models.list().data[0].id

    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}],
        extra_body={"structured_outputs": {"choices": ["positive", "negative"]}},
    )
    assert completion.choices[0].message.content in ("positive", "negative")

    completion = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": "Generate an example email address for Alan Turing, who works in Enigma. End in .com and new line. Example result: alan.turing@enigma.com\n",  # noqa: E501 (as documented)
            }
        ],
        extra_body={"structured_outputs": {"regex": r"\w+@\w+\.com\n"}, "stop": ["\n"]},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length" or re.fullmatch(r"\w+@\w+\.com", choice.message.content)
    assert re.match(r"\w", choice.message.content)

    class CarType(str, enum.Enum):
        sedan = "sedan"
        suv = "SUV"
        truck = "Truck"
        coupe = "Coupe"

    class CarDescription(BaseModel):
        brand: str
        model: str
        car_type: CarType

    completion = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": "Generate a JSON with the brand, model and car_type of the most iconic car from the 90's",  # noqa: E501 (as documented)
            }
        ],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "car-description", "schema": CarDescription.model_json_schema()},
        },
    )
    car = CarDescription.model_validate_json(completion.choices[0].message.content)
    assert set(completion.choices[0].pcd["fields"]["car_type"]["probabilities"]) == {c.value for c in CarType}
    assert car.car_type in CarType

    simplified_sql_grammar = """
        root ::= select_statement

        select_statement ::= "SELECT " column " from " table " where " condition

        column ::= "col_1 " | "col_2 "

        table ::= "table_1 " | "table_2 "

        condition ::= column "= " number

        number ::= "1 " | "2 "
    """
    completion = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": "Generate an SQL query to show the 'username' and 'email' from the 'users' table.",
            }
        ],
        extra_body={"structured_outputs": {"grammar": simplified_sql_grammar}},
    )
    sql = r"SELECT (col_1 |col_2 ) from (table_1 |table_2 ) where (col_1 |col_2 )= (1 |2 )"
    assert re.fullmatch(sql, completion.choices[0].message.content)


def test_vllm_guided_parameters_before_0_12(client):
    """The same four constraints under their old names, with the backend options accepted."""
    ask = {"model": "smollm2", "messages": [{"role": "user", "content": "Classify: vLLM is wonderful!"}]}
    answer = client.chat.completions.create(
        **ask, extra_body={"guided_choice": ["positive", "negative"], "guided_decoding_backend": "xgrammar"}
    )
    assert answer.choices[0].message.content in ("positive", "negative")
    answer = client.chat.completions.create(**ask, extra_body={"guided_regex": "(yes|no)", "max_tokens": 4})
    assert answer.choices[0].message.content in ("yes", "no")
    answer = client.chat.completions.create(**ask, extra_body={"guided_grammar": 'root ::= "A" | "B"'})
    assert answer.choices[0].message.content in ("A", "B")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    answer = client.chat.completions.create(
        **ask, extra_body={"guided_json": schema, "guided_whitespace_pattern": r"[\n ]*"}
    )
    assert isinstance(json.loads(answer.choices[0].message.content)["ok"], bool)


# -- SGLang's documented examples (docs/advanced_features/structured_outputs.ipynb), and llama.cpp ---


def test_sglang_documented_examples(client):
    class CapitalInfo(BaseModel):
        name: str = Field(..., pattern=r"^\w+$", description="Name of the capital city")
        population: int = Field(..., description="Population of the capital city")

    response = client.chat.completions.create(
        model="smollm2",
        messages=[
            {
                "role": "user",
                "content": "Please generate the information of the capital of France in the JSON format.",
            },
        ],
        temperature=0,
        max_tokens=128,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "foo", "schema": CapitalInfo.model_json_schema()},
        },
    )
    CapitalInfo.model_validate_json(response.choices[0].message.content)

    ebnf_grammar = """
root ::= city | description
city ::= "London" | "Paris" | "Berlin" | "Rome"
description ::= city " is " status
status ::= "the capital of " country
country ::= "England" | "France" | "Germany" | "Italy"
"""
    response = client.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "system", "content": "You are a helpful geography bot."},
            {"role": "user", "content": "Give me the information of the capital of France."},
        ],
        temperature=0,
        max_tokens=32,
        extra_body={"ebnf": ebnf_grammar},
    )
    city = "(London|Paris|Berlin|Rome)"
    assert re.fullmatch(
        f"{city}( is the capital of (England|France|Germany|Italy))?", response.choices[0].message.content
    )

    response = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=128,
        extra_body={"regex": "(Paris|London)"},
    )
    assert response.choices[0].message.content in ("Paris", "London")


def test_sglang_and_llama_cpp_json_schema_and_gbnf(client, engine):
    schema = {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative"]}, "urgent": {"type": "boolean"}},
        "required": ["sentiment", "urgent"],
    }
    text = "My order never came and nobody answers!"
    want = engine.classify(text, schema)
    for body in ({"json_schema": schema}, {"json_schema": json.dumps(schema)}):  # SGLang, llama.cpp
        answer = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": text}], extra_body=body
        )
        assert json.loads(answer.choices[0].message.content) == want.value
        got = answer.choices[0].pcd["fields"]["sentiment"]["probabilities"]
        assert got == pytest.approx(want.fields["sentiment"].probabilities, abs=1e-4)
    gbnf = 'root ::= answer\nanswer ::= "yes" | "no"\nws ::= [ \\t\\n]*\n'  # llama.cpp's GBNF
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Is it late?"}], extra_body={"grammar": gbnf}
    )
    assert answer.choices[0].message.content in ("yes", "no")


# -- choice == classify; completions over raw prompts -------------------------------------------


@pytest.mark.parametrize("param", ["structured_outputs", "guided_choice"])
def test_a_choice_carries_the_probabilities_of_in_process_classify(client, engine, param):
    choices = ["billing", "technical problem", "shipping"]
    text = "The app crashes whenever I open my invoices."
    body = {"structured_outputs": {"choice": choices}} if param == "structured_outputs" else {param: choices}
    answer = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": text}],
        logprobs=True,
        top_logprobs=3,
        extra_body=body,
    )
    want = engine.classify(text, choice_schema(choices))
    choice = answer.choices[0]
    assert choice.message.content == want.value["choice"]
    probabilities = want.fields["choice"].probabilities
    assert choice.pcd["fields"]["choice"]["probabilities"] == pytest.approx(probabilities, abs=1e-6)
    (entry,) = choice.logprobs.content  # one entry: the chosen string, the others as alternatives
    assert entry.token == want.value["choice"]
    assert entry.logprob == pytest.approx(math.log(probabilities[entry.token]), abs=1e-6)
    assert {t.token: math.exp(t.logprob) for t in entry.top_logprobs} == pytest.approx(
        probabilities, abs=1e-6
    )


def test_eight_prompts_in_one_completions_request_equal_eight_single_calls(client, engine):
    choices = [" positive", " negative"]
    listed = client.completions.create(
        model="smollm2", prompt=REVIEW_PROMPTS, extra_body={"guided_choice": choices}, logprobs=2
    )
    singles = [
        client.completions.create(
            model="smollm2", prompt=p, extra_body={"guided_choice": choices}, logprobs=2
        )
        for p in REVIEW_PROMPTS
    ]
    want = engine.classify_batch([RawPrompt(p, "value") for p in REVIEW_PROMPTS], choice_schema(choices))
    assert [c.index for c in listed.choices] == list(range(8))
    for got, single, reference in zip(listed.choices, singles, want, strict=True):
        (one,) = single.choices
        assert got.text == one.text == reference.value["choice"]
        probabilities = reference.fields["choice"].probabilities
        assert got.pcd["fields"]["choice"]["probabilities"] == pytest.approx(probabilities, abs=1e-4)
        assert one.pcd["fields"]["choice"]["probabilities"] == pytest.approx(probabilities, abs=1e-4)
        assert got.logprobs.tokens == [got.text] and got.logprobs.text_offset == [0]
        assert got.logprobs.top_logprobs[0] == pytest.approx(
            {c: math.log(p) for c, p in probabilities.items()}
        )
    assert {c.text for c in listed.choices} == set(choices)

    generated = client.completions.create(model="smollm2", prompt=REVIEW_PROMPTS, max_tokens=6)
    for got, prompt in zip(generated.choices, REVIEW_PROMPTS, strict=True):
        assert got.text == engine.generate(RawPrompt(prompt), max_tokens=6).text
    assert generated.usage.prompt_tokens == sum(len(engine.prompt.raw((), p)) for p in REVIEW_PROMPTS)


def test_completions_json_schema_grammar_stream_and_n(client, engine):
    schema = {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative"]}},
        "required": ["sentiment"],
    }
    prompt = 'Review: "I love it"\nAnswer in JSON:'
    want = engine.classify(RawPrompt(prompt), schema)
    for body in (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        {"structured_outputs": {"json": schema}},
        {"json_schema": schema},
    ):
        answer = client.completions.create(model="smollm2", prompt=prompt, extra_body=body)
        assert json.loads(answer.choices[0].text) == want.value
    answer = client.completions.create(
        model="smollm2", prompt="The capital of France is", extra_body={"regex": " (Paris|London)"}
    )
    assert answer.choices[0].text in (" Paris", " London") and answer.choices[0].finish_reason == "stop"
    whole = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, logprobs=1)
    chunks = list(
        client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert "".join(whole.choices[0].logprobs.tokens) == whole.choices[0].text
    assert all(c.object == "text_completion" for c in chunks)
    sampled = client.completions.create(
        model="smollm2", prompt=["A", "B"], n=2, max_tokens=4, temperature=1.0, seed=1
    )
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]


# -- errors: OpenAI's body, a 400 naming the parameters -------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "named"),
    [
        ("chat", {"guided_choice": ["a", "b"], "guided_regex": "a"}, 400, ["guided_choice", "guided_regex"]),
        ("chat", {"structured_outputs": {"choice": ["a"], "regex": "a"}}, 400, ["choice", "regex"]),
        (
            "chat",
            {"regex": "a", "response_format": {"type": "json_object"}},
            400,
            ["response_format", "regex"],
        ),
        (
            "chat",
            {"guided_choice": ["a"], "tools": [{"type": "function", "function": {"name": "f"}}]},
            400,
            ["tools"],
        ),
        ("chat", {"structural_tag": {"type": "structural_tag"}}, 400, ["structural_tag"]),
        (  # SGLang's documented structural_tag response format
            "chat",
            {"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<function="]}},
            400,
            ["structural_tag is not supported"],
        ),
        ("chat", {"guided_choice": []}, 400, ["guided_choice"]),
        ("chat", {"guided_choice": ["a", "a"]}, 400, ["distinct"]),
        ("chat", {"guided_regex": "(unclosed"}, 400, ["guided_regex", "Regex parsing error"]),
        ("chat", {"guided_json": "{not json"}, 400, ["guided_json"]),
        (
            "chat",
            {
                "guided_json": {
                    "type": "object",
                    "properties": {"c": {"type": "string", "pattern": "^a+$", "maxLength": 3}},
                }
            },
            400,
            ["maxLength", "pattern"],
        ),
        ("completions", {"prompt": [1, 2, 3]}, 400, ["token ids"]),
        ("completions", {"prompt": []}, 400, ["prompt"]),
        ("completions", {"prompt": "x", "echo": True}, 400, ["echo"]),
        ("completions", {"prompt": "x", "suffix": "y"}, 400, ["suffix"]),
        ("completions", {"prompt": "x", "best_of": 3}, 400, ["best_of"]),
        ("completions", {"prompt": "", "max_tokens": 2}, 400, ["empty"]),
        (
            "completions",
            {"prompt": "x", "json_schema": {"type": "object"}, "regex": "a"},
            400,
            ["regex", "json_schema"],
        ),
    ],
)
def test_refused_requests_get_a_400_that_names_the_parameters(url, path, body, status, named):
    route = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    base = {"model": "smollm2"}
    if path == "chat":
        base["messages"] = [{"role": "user", "content": "hi"}]
    answer = httpx.post(url + route, json={**base, **body}, timeout=60)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for name in named:
        assert name in error["message"]


def test_accepted_and_ignored_parameters_and_the_published_document(url):
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "hi"}],
        "guided_choice": ["a", "b"],
        "guided_decoding_backend": "outlines",
        "guided_whitespace_pattern": " ",
    }
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    document = httpx.get(url + "/openapi.json", timeout=10).json()
    request = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {
        "prompt",
        "guided_choice",
        "structured_outputs",
        "regex",
        "ebnf",
        "json_schema",
        "grammar",
    } <= set(request)
    assert "/v1/completions" in document["paths"]


def test_pcd_s_own_option_sent_at_the_top_level_is_pointed_to_its_object():
    from minicpm_pcd_adapters.server.errors import APIError, read_body
    from minicpm_pcd_adapters.server.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "abstain_below": 0.7}
    with pytest.raises(APIError) as caught:  # what `extra_body={"abstain_below": 0.7}` sends
        read_body(ChatCompletionRequest, body)
    assert caught.value.code == "unsupported_parameter" and caught.value.param == "abstain_below"
    assert caught.value.message.endswith('belongs in the "pcd" object: {"pcd": {"abstain_below": ...}}')
    del body["abstain_below"]
    with pytest.raises(APIError) as caught:  # a parameter nothing takes gets no hint
        read_body(ChatCompletionRequest, {**body, "frobnicate": 1})
    assert caught.value.message == "unsupported parameter: frobnicate"
