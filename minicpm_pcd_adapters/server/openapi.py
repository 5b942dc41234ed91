"""The server's OpenAPI document: the request and response bodies `pcd serve` really reads and writes.

The routes read raw bodies (`calls.py` checks them, with OpenAI's error messages), so FastAPI cannot
see their shapes; this module writes the document served at `/openapi.json` from the models of
`protocol.py`, the same ones that check the requests and build the answers: the Chat Completions
and Completions requests, the answers with their `pcd` extension and `logprobs`, the streams,
OpenAI's error body (`errors.ErrorBody`) for every status a route can answer, and the bearer key on
every path but `/health`.
Schemathesis fuzzes the server from this document (tests/tiny/test_server_openapi.py).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from minicpm_pcd_adapters.server.calls import RequestLimits
from minicpm_pcd_adapters.server.errors import ErrorBody
from minicpm_pcd_adapters.server.protocol import (
    CalibrationList,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ClassificationRequest,
    ClassificationResponse,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    Health,
    ModelCard,
    ModelList,
    TextCompletion,
    TokenizeRequest,
    TokenizeResponse,
)
from minicpm_pcd_adapters.server.settings import ServerSettings

MODELS: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
    (ChatCompletionRequest, "validation"),
    (CompletionRequest, "validation"),
    (TextCompletion, "serialization"),
    (ChatCompletion, "serialization"),
    (ChatCompletionChunk, "serialization"),
    (ErrorBody, "serialization"),
    (Health, "serialization"),
    (ModelCard, "serialization"),
    (ModelList, "serialization"),
    (CalibrationList, "serialization"),
    (ClassificationRequest, "validation"),
    (ClassificationResponse, "serialization"),
    (TokenizeRequest, "validation"),
    (TokenizeResponse, "serialization"),
    (DetokenizeRequest, "validation"),
    (DetokenizeResponse, "serialization"),
]

ERRORS = {
    400: "the request cannot be answered: OpenAI's error body names the parameter and why",
    401: "missing or incorrect API key",
    404: "no such model",
    413: "the body is over the server's limit",
    499: "the client closed the connection before the answer",
    500: "the model's output failed validation twice, or an internal error",
    503: "the queue is full: retry after the Retry-After header",
    504: "not answered within the request timeout",
}


def _stream_event(chunk: str) -> dict[str, Any]:
    """Open API 3.1: the schema of each server-sent event whose data is a `chunk` object."""
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": _ref(chunk)["schema"]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, data]}},
    }


def openapi_document(routes: Any, settings: ServerSettings, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the app's `routes`, with the real bodies filled in."""
    document = get_openapi(
        title="minicpm-pcd",
        version=version,
        summary="OpenAI-compatible Chat Completions with per-field probabilities (PCD)",
        routes=routes,
    )
    _, top = models_json_schema(MODELS, ref_template="#/components/schemas/{model}")
    schemas = top["$defs"]
    limits = RequestLimits(max_completion_tokens=settings.max_completion_tokens)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        request = schemas[name]["properties"]
        request["model"]["enum"] = [settings.model_name]  # any other is answered 404
        for field in ("max_tokens", "max_completion_tokens"):
            if field in request:
                _bound(request[field], "integer", "maximum", limits.max_completion_tokens)
        _bound(request["n"], "integer", "maximum", limits.max_n)
        _bound(request["stop"], "array", "maxItems", 4)
    _bound(schemas["CompletionRequest"]["properties"]["prompt"], "array", "maxItems", limits.max_prompts)
    for name in ("ClassificationRequest", "TokenizeRequest", "DetokenizeRequest"):  # optional here
        model = schemas[name]["properties"]["model"]
        model["anyOf"] = [{"type": "string", "enum": [settings.model_name]}, {"type": "null"}]
    _bound(schemas["ClassificationRequest"]["properties"]["input"], "array", "maxItems", limits.max_prompts)
    schemas["TextCompletion"]["description"] += " With `stream: true`, the same objects as events."
    document.setdefault("components", {})["schemas"] = schemas
    paths = document["paths"]
    body_of = {
        "/health": "Health",
        "/v1/models": "ModelList",
        "/v1/models/{model_id}": "ModelCard",
        "/v1/calibrations": "CalibrationList",
    }
    for path, name in body_of.items():
        _answers(paths[path]["get"], {200: _json(name)}, [401] if path != "/health" else [])
    paths["/health"]["get"]["responses"]["503"] = {
        "description": "not ready: the server is starting, or its model worker has stopped",
        "content": {"application/json": _ref("Health")},
    }
    paths["/v1/models/{model_id}"]["get"]["responses"]["404"] = _error(404)
    paths["/metrics"]["get"]["responses"] = {
        "200": {
            "description": "Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        "401": _error(401),
    }
    routes_ = {
        "/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"),
        "/v1/completions": ("CompletionRequest", "TextCompletion", "TextCompletion"),
    }
    for path, (request_name, answer_name, chunk_name) in routes_.items():
        operation = paths[path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": _ref(request_name)}}
        answer = {
            "description": f"the completion; with `stream: true`, server-sent {chunk_name} events",
            "content": {
                "application/json": _ref(answer_name),
                "text/event-stream": {"schema": _stream_event(chunk_name)},
            },
        }
        _answers(operation, {200: answer}, [400, 401, 404, 413, 499, 500, 503, 504])
    posts = {
        "/classify": ("ClassificationRequest", "ClassificationResponse"),
        "/v1/classify": ("ClassificationRequest", "ClassificationResponse"),
        "/tokenize": ("TokenizeRequest", "TokenizeResponse"),
        "/detokenize": ("DetokenizeRequest", "DetokenizeResponse"),
    }
    for path, (request_name, answer_name) in posts.items():
        operation = paths[path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": _ref(request_name)}}
        statuses = [400, 401, 404, 413, 499, 500, 503, 504] if "classify" in path else [400, 401, 404, 413]
        _answers(operation, {200: _json(answer_name)}, statuses)
    if settings.api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
        paths["/health"]["get"]["security"] = []
    return document


def _bound(schema: dict[str, Any], kind: str, keyword: str, value: int) -> None:
    """Set `keyword` on the member of an optional property's `anyOf` that has type `kind`."""
    for member in schema.get("anyOf", [schema]):
        if member.get("type") == kind:
            member[keyword] = value


def _answers(operation: dict[str, Any], ok: dict[int, Any], errors: list[int]) -> None:
    operation["responses"] = {str(status): body for status, body in ok.items()}
    operation["responses"].update({str(status): _error(status) for status in errors})


def _json(name: str) -> dict[str, Any]:
    return {"description": name, "content": {"application/json": _ref(name)}}


def _error(status: int) -> dict[str, Any]:
    return {"description": ERRORS[status], "content": {"application/json": _ref("ErrorBody")}}


def _ref(name: str) -> dict[str, Any]:
    return {"schema": {"$ref": f"#/components/schemas/{name}"}}
