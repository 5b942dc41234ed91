"""`pcd serve` over a tiny random Llama: the real app on uvicorn (127.0.0.1, free port), driven by the
official `openai` SDK and raw HTTP. Answers must equal the in-process engine's; bad requests get
OpenAI's error body and the documented status, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from minicpm_pcd_adapters.server.app import create_app
from minicpm_pcd_adapters.server.settings import ServerSettings
from pcd_engine import Limits, PCDEngine, PCDError, TokenizationError
from tests.helpers import served

KEY = "test-key-123"
ROUTE = {
    "type": "object",
    "title": "Route",
    "description": "Where a support message goes.",
    "properties": {
        "topic": {"type": "string", "enum": ["billing", "bug", "other"], "description": "What it is about."},
        "urgent": {"type": "boolean"},
    },
    "required": ["topic", "urgent"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "Route", "schema": ROUTE, "strict": True}}
TEXTS = ["refund me", "The app crashes when I log in.", "Where is my parcel?", "charged twice", "hello"]


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(
        engine, ServerSettings(model_name="tiny", api_key=KEY, batch_window_ms=50, max_body_bytes=20_000)
    )
    with served(app) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def ask(client, text, **kwargs):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], response_format=FORMAT, **kwargs
    )


def assert_same_answer(choice, reference):
    assert json.loads(choice.message.content) == reference.value
    fields = choice.pcd["fields"]
    for path, field in reference.fields.items():
        assert fields[path]["value"] == field.value
        for value, p in field.to_json()["probabilities"].items():
            assert fields[path]["probabilities"][value] == pytest.approx(p, abs=1e-4)


def test_json_schema_answers_equal_the_in_process_engine(client, engine):
    response = ask(client, TEXTS[0])
    (choice,) = response.choices
    assert choice.finish_reason == "stop"
    assert_same_answer(choice, engine.classify(TEXTS[0], ROUTE | {"title": "Route"}))
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens == 0
    assert choice.pcd["needs_review"] is False


def test_a_system_message_is_the_instructions_and_the_tool_call_form_gives_the_same_object(client, engine):
    messages = [{"role": "system", "content": "Route it."}, {"role": "user", "content": TEXTS[1]}]
    tool = {"type": "function", "function": {"name": "Route", "description": "Route it", "parameters": ROUTE}}
    response = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "Route"}},
    )
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "Route"
    reference = engine.classify(TEXTS[1], tool["function"], instructions="Route it.")
    assert json.loads(call.function.arguments) == reference.value
    required = client.chat.completions.create(
        model="tiny", messages=messages, tools=[tool], tool_choice="required"
    )
    assert required.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


async def test_concurrent_callers_share_batches_and_get_their_own_answers(server, engine):
    references = [engine.classify(t, ROUTE) for t in TEXTS]
    before = _metric(server, "pcd_batch_size_count")
    async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0) as aclient:
        responses = await asyncio.gather(*(ask(aclient, t) for t in TEXTS * 2))
    for response, reference in zip(responses, references * 2, strict=True):
        assert_same_answer(response.choices[0], reference)
    batches = _metric(server, "pcd_batch_size_count") - before
    assert 1 <= batches < len(TEXTS) * 2  # callers were grouped: fewer batches than requests


def test_streaming_structured_and_plain_chat(client, engine):
    chunks = list(ask(client, TEXTS[2], stream=True, stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(content) == engine.classify(TEXTS[2], ROUTE).value
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens > 0
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    reference = engine.generate(messages, max_tokens=8)
    assert whole.choices[0].message.content == reference.text
    assert whole.choices[0].finish_reason == reference.finish_reason
    pieces = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == reference.text


def test_n_answers_and_models(client, server):
    response = ask(client, TEXTS[3], n=2)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].message.content == response.choices[1].message.content  # scored: same
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ("{not json", 400, None, "invalid_json"),
        ({"model": "tiny"}, 400, "messages", "invalid_value"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1.0}},
            400,
            "logit_bias",
            "unsupported_parameter",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
            "invalid_value",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "frobnicate": 1},
            400,
            "frobnicate",
            "unsupported_parameter",
        ),
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "model_not_found"),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "S", "schema": {"type": "array"}},
                },
            },
            400,
            "response_format.json_schema.schema",
            "unsupported_schema",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "a"}}],
                "tool_choice": {"type": "function", "function": {"name": "b"}},
            },
            400,
            "tool_choice",
            "invalid_value",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "   "}], "response_format": FORMAT},
            400,
            "messages",
            "invalid_input",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x" * 30_000}]},
            413,
            None,
            "request_too_large",
        ),
    ],
)
def test_bad_requests_get_openai_error_bodies_and_the_server_keeps_serving(
    server, client, body, status, param, code
):
    data = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(server + "/v1/chat/completions", content=data, headers=_auth(), timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"] and error["type"]
    assert ask(client, "still there?").choices[0].message.content  # the next request is answered


def test_unknown_routes_methods_and_media_parts_get_openai_error_bodies(server, client):
    for method, path, status, code in [
        ("POST", "/v1/completions-nope", 404, "not_found"),
        ("GET", "/v1/nowhere", 404, "not_found"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ]:
        response = httpx.request(method, server + path, headers=_auth(), timeout=30)
        assert response.status_code == status
        error = response.json()["error"]
        assert error["code"] == code and path in error["message"] and error["type"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    parts = [{"type": "text", "text": "what is this?"}, image]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}])
    error = caught.value.body
    assert error["code"] == "unsupported_content" and error["param"] == "messages.0.content.1"
    assert "text only" in error["message"] and "'image_url'" in error["message"]


def test_a_json_schema_without_a_name_is_answered_as_vllm_does(client, engine):
    unnamed = {"type": "json_schema", "json_schema": {"schema": ROUTE}}
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": TEXTS[0]}], response_format=unnamed
    )
    assert_same_answer(response.choices[0], engine.classify(TEXTS[0], ROUTE))


def test_the_api_key_guards_every_endpoint_but_health(server):
    assert httpx.get(server + "/health").json()["status"] == "ok"
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(server + path).status_code == 401
        assert httpx.get(server + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(server + path, headers=_auth()).status_code == 200
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        ask(wrong, "x")
    assert caught.value.body["code"] == "invalid_api_key"


def test_metrics_count_requests_errors_batches_and_forward_calls(server, client):
    ask(client, TEXTS[4])
    text = httpx.get(server + "/metrics", headers=_auth()).text
    for name in ("pcd_requests_total", "pcd_request_errors_total", "pcd_batch_size_bucket", "pcd_queue_depth",
                 "pcd_forward_calls_total", "pcd_request_latency_seconds_bucket"):  # fmt: skip
        assert name in text
    assert _metric(server, "pcd_forward_calls_total") > 0


async def test_a_full_queue_answers_503_with_retry_after(engine):
    app = create_app(engine, ServerSettings(model_name="tiny", batch_window_ms=400, max_queue=2))
    with served(app) as url:
        async with httpx.AsyncClient(timeout=30) as http:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "response_format": FORMAT,
            }
            responses = await asyncio.gather(
                *(http.post(url + "/v1/chat/completions", json=body) for _ in range(4))
            )
        codes = sorted(r.status_code for r in responses)
        assert codes == [200, 200, 503, 503]
        refused = next(r for r in responses if r.status_code == 503)
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "overloaded"


async def test_a_caller_that_leaves_while_queued_is_dropped_before_the_model(engine):
    app = create_app(engine, ServerSettings(model_name="tiny", batch_window_ms=600))
    with served(app) as url:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": FORMAT}
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(url + "/v1/chat/completions", json=body, timeout=0.2)
        await asyncio.sleep(1.0)
        assert _metric(url, "pcd_dropped_requests_total", key=None) == 1
        assert _metric(url, "pcd_batch_size_count", key=None) == 0  # no batch ran for it


def test_a_request_timeout_answers_504(engine):
    app = create_app(engine, ServerSettings(model_name="tiny", batch_window_ms=2000, request_timeout_s=0.3))
    with served(app) as url:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": FORMAT}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200  # the window never outlasts what the first request can wait
        app.state.batcher.window_s = 0  # now hold the model worker so the next request waits too long
        held = app.state.batcher._worker.submit(__import__("time").sleep, 1.5)
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        held.result()
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def _metric(url, name, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for line in httpx.get(url + "/metrics", headers=headers).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_plain_chat_input_errors_are_400_and_cors_is_off_by_default(tiny_model, tiny_tokenizer):
    small = PCDEngine(tiny_model, tiny_tokenizer, limits=Limits(max_prompt_tokens=40))
    with served(create_app(small, ServerSettings(model_name="tiny"))) as url:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "refund me " * 40}],
            "max_tokens": 4,
        }
        for stream in (False, True):
            response = httpx.post(url + "/v1/chat/completions", json=body | {"stream": stream}, timeout=30)
            assert response.status_code == 400
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("invalid_input", "messages")
            assert "over the limit of 40" in error["message"]
        preflight = httpx.options(
            url + "/v1/chat/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in preflight.headers


CAL_TEXTS = [f"{t} #{i}" for i, t in enumerate(TEXTS * 2)]
CAL_LABELS = [{"topic": t, "urgent": u} for t, u in [("billing", True), ("bug", True), ("other", False)] * 3]
CAL_LABELS.append({"topic": "billing", "urgent": False})


def test_a_loaded_calibration_answers_the_requests_of_its_schema(engine, tmp_path):
    cal = engine.calibrate(ROUTE | {"title": "Route"}, CAL_TEXTS, CAL_LABELS, method="head", folds=2)
    path = tmp_path / "route.json"
    cal.save(path)  # with route.safetensors beside it: heads through the server
    settings = ServerSettings(model_name="tiny", api_key=KEY, calibrations=(str(path),))
    with served(create_app(engine, settings)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        for text in TEXTS[:3]:
            (choice,) = ask(client, text).choices
            want = engine.classify(text, ROUTE | {"title": "Route"}, calibration=cal)
            assert_same_answer(choice, want)
            assert choice.pcd["calibration"] == {
                "name": "route",
                "methods": {"topic": "head", "urgent": "head"},
            }
            assert choice.pcd["fields"]["topic"]["calibration"] == "head"
        other = client.chat.completions.create(  # other instructions: another plan, no calibration
            model="tiny",
            messages=[{"role": "system", "content": "Route it."}, {"role": "user", "content": TEXTS[0]}],
            response_format=FORMAT,
        )
        assert other.choices[0].pcd["calibration"] is None
        listed = httpx.get(url + "/v1/calibrations", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert [c["id"] for c in listed["data"]] == ["route"] and listed["data"][0]["schema"] == cal.schema
        assert httpx.get(url + "/v1/calibrations").status_code == 401


def test_a_calibration_of_another_model_stops_the_server_before_it_serves(
    engine, tiny_tokenizer, tiny_folder, tmp_path
):
    import subprocess
    import sys

    from pcd_engine import CalibrationError
    from tests.helpers import tiny_llama

    other = PCDEngine(tiny_llama(len(tiny_tokenizer), seed=1), tiny_tokenizer)
    path = tmp_path / "other.json"
    other.calibrate(ROUTE, CAL_TEXTS, CAL_LABELS, method="temperature", folds=2).save(path)
    with pytest.raises(CalibrationError, match="not on the served model"):
        create_app(engine, ServerSettings(model_name="tiny", calibrations=(str(path),)))
    command = [sys.executable, "-m", "minicpm_pcd_adapters.cli", "serve", "--model", tiny_folder,
               "--device", "cpu", "--port", "1", "--calibration", str(path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "not on the served model" in done.stderr
    assert "Uvicorn running" not in done.stderr


def test_structured_answers_carry_standard_logprobs_equal_to_pcd(client, engine):
    import math

    response = ask(client, TEXTS[1], logprobs=True, top_logprobs=2)
    (choice,) = response.choices
    fields = choice.pcd["fields"]
    content = choice.logprobs.content  # the SDK's own ChatCompletionTokenLogprob objects
    assert [json.loads(entry.token) for entry in content] == [
        fields["topic"]["value"],
        fields["urgent"]["value"],
    ]
    for entry, path in zip(content, ("topic", "urgent"), strict=True):
        probabilities = fields[path]["probabilities"]
        assert math.exp(entry.logprob) == pytest.approx(
            probabilities[json.dumps(fields[path]["value"]).strip('"')]
        )
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode() == entry.token
    streamed = ask(client, TEXTS[1], logprobs=True, stream=True)
    chunks = [c for c in streamed if c.choices and c.choices[0].logprobs is not None]
    assert [e.token for e in chunks[0].choices[0].logprobs.content] == [e.token for e in content]
    assert ask(client, TEXTS[1]).choices[0].logprobs is None  # only when asked


def test_plain_chat_logprobs_equal_the_engines_in_answers_and_streams(client, engine):
    messages = [{"role": "user", "content": "Say hello."}]
    reference = engine.generate(messages, max_tokens=8, logprobs=3)
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = whole.choices[0].logprobs.content
    assert [e.token for e in content] == [t.token for t in reference.logprobs]
    assert [e.logprob for e in content] == pytest.approx([t.logprob for t in reference.logprobs], abs=1e-4)
    for entry, token in zip(content, reference.logprobs, strict=True):
        assert [(a.token, round(a.logprob, 4)) for a in entry.top_logprobs] == [
            (text, round(p, 4)) for text, p in token.top
        ]
    pieces = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, logprobs=True, stream=True
        )
    )
    streamed = [
        e for p in pieces if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [t.token for t in reference.logprobs]
    assert all(e.top_logprobs == [] for e in streamed)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    assert plain.choices[0].logprobs is None


def test_generated_open_fields_carry_their_tokens_logprobs(client, engine):
    schema = {
        "type": "object",
        "title": "Note",
        "properties": {
            "topic": {"type": "string", "enum": ["billing", "bug", "other"]},
            "summary": {"type": "string", "maxLength": 12},
        },
        "required": ["topic", "summary"],
        "additionalProperties": False,
    }
    form = {"type": "json_schema", "json_schema": {"name": "Note", "schema": schema}}
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": TEXTS[1]}],
        response_format=form,
        logprobs=True,
        top_logprobs=1,
    )
    reference = engine.classify(TEXTS[1], schema, logprobs=1)
    content = response.choices[0].logprobs.content
    assert json.loads(content[0].token) == reference.value["topic"]  # the scored field first
    generated = content[1:]
    assert [e.token for e in generated] == [t.token for t in reference.token_logprobs]
    assert [e.logprob for e in generated] == pytest.approx(
        [t.logprob for t in reference.token_logprobs], abs=1e-4
    )
    assert "".join(e.token for e in generated).startswith(' "')  # the summary's JSON text follows


TOOLS = [
    {
        "type": "function",
        "function": {"name": "route", "description": "Route a message.", "parameters": ROUTE},
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Find an order.",
            "parameters": {"type": "object", "properties": {"order": {"type": "string", "maxLength": 8}}},
        },
    },
]


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tools_the_model_chooses_between_equal_the_in_process_decision(client, engine, choice):
    messages = [{"role": "user", "content": TEXTS[1]}]
    response = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice=choice, logprobs=True, top_logprobs=3
    )
    (answer,) = response.choices
    reference = engine.tools.call(messages, TOOLS, tool_choice=choice, logprobs=3)
    pcd = answer.pcd
    allowed = {"route", "lookup"} | ({""} if choice == "auto" else set())
    assert set(pcd["probabilities"]) == allowed
    for name, p in reference.probabilities.items():
        assert pcd["probabilities"][name if name is not None else ""] == pytest.approx(p, abs=1e-4)
    assert pcd["tool"] == reference.tool
    first = answer.logprobs.content[0]  # the decision, then the arguments and generated tokens
    assert first.token == json.dumps(reference.decision.value)
    assert len(first.top_logprobs) == min(3, len(allowed))
    if reference.tool is None:
        assert answer.finish_reason in ("stop", "length") and answer.message.content == reference.text
        assert not answer.message.tool_calls
    else:
        (call,) = answer.message.tool_calls
        assert answer.finish_reason == "tool_calls" and call.id.startswith("call_")
        assert call.function.name == reference.tool
        assert json.loads(call.function.arguments) == reference.arguments
    stream = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice=choice, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == answer.finish_reason
    assert chunks[-1].choices[0].pcd["tool"] == reference.tool


def test_a_conversation_with_an_earlier_call_and_its_result_reaches_the_decision(client, engine):
    messages = [
        {"role": "user", "content": "Where is order 42?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"order": "42"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "shipped on Monday"},
    ]
    response = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=4)
    reference = engine.tools.call(messages, TOOLS, max_tokens=4)
    assert response.choices[0].pcd["probabilities"] == pytest.approx(
        {k if k is not None else "": p for k, p in reference.probabilities.items()}, abs=1e-4
    )


def test_a_schema_whose_values_cannot_be_told_apart_by_this_tokenizer_is_a_400(server, monkeypatch):
    """TokenizationError is a PCDError: the server answers it as a schema it cannot serve, not a 500."""
    import pcd_engine.plan

    real = pcd_engine.plan.build_tree

    def build_tree(encode, branch, candidates, *args, **kwargs):
        if any("zzz" in c for c in candidates):
            raise TokenizationError(f"candidate {candidates[0]!r} tokenizes as a prefix of another")
        return real(encode, branch, candidates, *args, **kwargs)

    monkeypatch.setattr(pcd_engine.plan, "build_tree", build_tree)
    schema = {
        "type": "object",
        "properties": {"kind": {"type": "string", "enum": ["zzz", "zzzz"]}},
        "required": ["kind"],
    }
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "Odd", "schema": schema}},
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    answer = httpx.post(server + "/v1/chat/completions", json=body, headers=headers)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "unsupported_schema" and "prefix of another" in error["message"]
    assert issubclass(TokenizationError, PCDError)
