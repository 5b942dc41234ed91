"""`POST /classify` (and `/v1/classify`): vLLM's and SGLang's classification door, answered with the
schema `pcd serve --schema` was started with. One more converter to the engine's calls: each input is
one user turn, classified exactly as a chat request with that schema as its `response_format` (the same
`ClassifyCall`, so the two share batches and give the same probabilities), served calibrations applied.
vLLM's chat form (`messages`, with `chat_template_kwargs`) is one conversation, one `data` entry.

    {"model": "smollm2", "input": ["I was charged twice", "The app crashes"]}
    -> {"object": "list", "data": [{"index": 0, "label": "billing", "probs": [0.91, 0.06, 0.03],
        "num_classes": 3, "pcd": {...}}, ...], "usage": {...}}

`label` and `probs` are the first scored field's value and its probabilities in the schema's value
order; every field (and the calibration used) is in the `pcd` extension, as on a chat choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minicpm_pcd_adapters.server.answers import classified_message, classified_usage
from minicpm_pcd_adapters.server.batching import Batcher
from minicpm_pcd_adapters.server.calibrations import Calibrations
from minicpm_pcd_adapters.server.calls import ClassifyCall, RequestLimits, conversation_of
from minicpm_pcd_adapters.server.errors import APIError, read_body
from minicpm_pcd_adapters.server.jobs import engine_error, json_body, observed, queued, while_connected
from minicpm_pcd_adapters.server.metrics import ServerMetrics
from minicpm_pcd_adapters.server.protocol import (
    CalibrationUsed,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    PCDExtension,
    dump,
)
from minicpm_pcd_adapters.server.settings import ServerSettings
from minicpm_pcd_adapters.server.template import ChatTemplate, Switches
from pcd_engine import Conversation, PCDEngine, PCDError, PCDResult, Sampling


@dataclass(frozen=True)
class ServedSchema:
    """The schema `/classify` answers with, as the JSON schema a chat client would send for it, and
    the field its `label` and `probs` come from (the first scored one) with its values in order."""

    schema: dict[str, Any]
    label_field: str
    labels: tuple[Any, ...]  # JSON scalars: strings, booleans, numbers, null

    @classmethod
    def of(cls, model: Any, engine: PCDEngine) -> ServedSchema:
        """`model` (a Pydantic class) planned on `engine` now, so that a schema the engine cannot
        serve, or one with no closed field to label by, fails before the server starts."""
        schema = model.model_json_schema(by_alias=True)
        plan = engine.plan(schema)
        if not plan.decisions:
            raise ValueError(
                f"--schema {schema.get('title', model.__name__)}: /classify labels by the first closed "
                "field (Literal, Enum, bool), and this schema has none"
            )
        first = plan.decisions[0].decision
        return cls(schema, first.path, tuple(c.value for c in first.candidates))

    def data(self, index: int, result: PCDResult[Any], extension: PCDExtension) -> ClassificationData:
        field = result.fields[self.label_field]
        probs = [field.probabilities.get(value, 0.0) for value in self.labels]
        return ClassificationData(
            index=index, label=_label(field.value), probs=probs, num_classes=len(probs), pcd=extension
        )


def read_classification(
    body: Any, served: ServedSchema, model_name: str, limits: RequestLimits, template: ChatTemplate
) -> list[ClassifyCall]:
    """A `/classify` request read into one `ClassifyCall` per input, or one for its conversation
    (vLLM's chat form); APIError 400 before model work."""
    request = read_body(ClassificationRequest, body)
    if request.model is not None and request.model != model_name:
        message = f"the model {request.model!r} does not exist; this server serves {model_name!r}"
        raise APIError(404, message, param="model", code="model_not_found")
    if request.truncate_prompt_tokens not in (None, -1):
        message = "truncate_prompt_tokens is not supported: texts are classified whole"
        raise APIError(400, message, param="truncate_prompt_tokens", code="unsupported_parameter")
    abstain = request.pcd.abstain_below if request.pcd else None
    if (request.input is None) == (request.messages is None):
        raise APIError(400, "give either input or messages", param="input", code="invalid_value")
    if request.messages is not None:
        switches = template.switches(request.chat_template_kwargs)
        conversation = conversation_of(request.messages, limits)
        return [_call(served, model_name, conversation, abstain, switches)]
    if request.chat_template_kwargs is not None:
        message = "chat_template_kwargs goes with messages (vLLM's chat form)"
        raise APIError(400, message, param="chat_template_kwargs", code="invalid_value")
    texts = [request.input] if isinstance(request.input, str) else list(request.input or [])
    if not texts:
        raise APIError(400, "input must hold at least one text", param="input", code="invalid_value")
    if len(texts) > limits.max_prompts:
        message = f"input holds {len(texts)} texts, over this server's limit of {limits.max_prompts}"
        raise APIError(400, message, param="input", code="invalid_value")
    total = sum(len(t) for t in texts)
    if total > limits.max_text_chars:
        message = f"input holds {total} characters, over this server's limit of {limits.max_text_chars}"
        raise APIError(400, message, param="input", code="string_above_max_length")
    return [
        _call(served, model_name, Conversation.of([{"role": "user", "content": t}]), abstain) for t in texts
    ]


def _call(
    served: ServedSchema,
    model_name: str,
    conversation: Conversation,
    abstain: float | None,
    switches: Switches = (),
) -> ClassifyCall:
    """The call a chat request with the served schema as its `response_format` would make."""
    return ClassifyCall(
        model_name, served.schema, conversation, Sampling(), abstain_below=abstain, schema_param="--schema",
        switches=switches,
    )  # fmt: skip


def classification_body(
    served: ServedSchema,
    model: str,
    calls: list[ClassifyCall],
    results: list[PCDResult[Any]],
    calibration: CalibrationUsed | None,
) -> dict[str, Any]:
    """The response: one `data` entry per input, in order, and the usage of all of them."""
    data = []
    for index, (call, result) in enumerate(zip(calls, results, strict=True)):
        extension = classified_message(call, result, index, calibration).pcd
        assert isinstance(extension, PCDExtension)
        data.append(served.data(index, result, extension))
    response = ClassificationResponse(
        id="classify-" + secrets.token_hex(12),
        object="list",
        created=int(time.time()),
        model=model,
        data=data,
        usage=classified_usage(results),
    )
    return dump(response)


class ClassificationEndpoint:
    """`POST /classify`: the request read into calls, each submitted to the batcher as a chat request
    with the served schema would be (they share batches), answered in input order."""

    def __init__(
        self,
        served: ServedSchema | None,
        settings: ServerSettings,
        limits: RequestLimits,
        batcher: Batcher,
        metrics: ServerMetrics,
        calibrations: Calibrations,
        template: ChatTemplate,
    ) -> None:
        self.served, self.settings, self.limits, self.batcher = served, settings, limits, batcher
        self.metrics, self.calibrations, self.template = metrics, calibrations, template

    async def __call__(self, request: Request) -> Response:
        with observed(self.metrics) as seen:
            seen.kind = "classify"
            if self.served is None:
                message = (
                    "this server classifies with the schema it was started with, and it was started "
                    "without one: pcd serve --schema module:Class (or a JSON-schema file)"
                )
                raise APIError(400, message, code="no_served_schema")
            calls = read_classification(
                await json_body(request), self.served, self.settings.model_name, self.limits, self.template
            )
            calibration = await self._calibration(calls[0])  # the calls share schema, system and switches
            calls = [dataclasses.replace(c, calibration=calibration) for c in calls]
            timeout = self.settings.request_timeout_s
            submitted = asyncio.gather(*(self.batcher.submit(c.batch_key(), c, timeout) for c in calls))
            answered = await while_connected(request, queued(submitted, timeout))
            results = [answer[0] for answer in answered]  # one input per call
            for index, result in enumerate(results):
                if isinstance(result, PCDError):
                    raise engine_error(result, f"input.{index}")
            used = self.calibrations.describe(calls[0].calibration)
            body = classification_body(self.served, self.settings.model_name, calls, results, used)
            self.metrics.on_answers(self.served.schema, results)
            self.metrics.on_tokens(body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
            seen.status = 200
            return JSONResponse(body)

    async def _calibration(self, call: ClassifyCall) -> str | None:
        """The served calibration fitted for the call's plan (its system text and switches), as chat
        matches them."""
        plan = await asyncio.to_thread(self.calibrations.engine.plan, call.schema, instructions=call.system)
        return self.calibrations.match(plan, call.switches)


def _label(value: Any) -> str:
    """A value as vLLM's string label: a string as it is, anything else as JSON (`true`, `3`)."""
    return value if isinstance(value, str) else json.dumps(value)
