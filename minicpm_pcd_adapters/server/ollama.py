"""Ollama's API on `pcd serve`: `POST /api/chat`, `POST /api/generate`, `GET /api/tags`,
`POST /api/show`, `GET /api/version`, so that the `ollama` client, LangChain's `ChatOllama` and
LlamaIndex's `Ollama` run unchanged against it (`base_url` / `host` at the server).

One more converter: an Ollama request becomes the same call a chat completion would (`calls.py`):
`format` as a JSON schema is a `ClassifyCall` (closed fields scored, a root `enum` as a choice, `{}`
any JSON object), `"json"` JSON-object generation, `tools` a tool decision ("auto": Ollama has no
`tool_choice`), anything else plain chat. The call runs on the model worker as chat's does
(`CompletionEndpoints.run` / `.pieces`), and its answer is written in Ollama's shape: one JSON object,
or NDJSON lines (`stream` is true unless set to false, as in Ollama) ending with `"done": true` and
the token counts. The scored fields are in a `pcd` extension on the final object, as on chat choices;
`logprobs` / `top_logprobs` give Ollama's `logprobs` list (a scored field's entry is its value).

`options`: `temperature`, `top_p`, `top_k`, `min_p`, `repeat_penalty`, `seed`, `num_predict`, `stop`
are honoured; the rest (`num_ctx`, `num_gpu`, `mirostat`, ...) tune Ollama's runtime and are ignored.
`think: true` is refused (the server renders with thinking off), as are images, `template`, `suffix`
and `context`. Errors are Ollama's body, `{"error": "..."}`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any, Literal, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from minicpm_pcd_adapters.server.answers import usage
from minicpm_pcd_adapters.server.calls import (
    ChatTemplate,
    ClassifyCall,
    GenerateCall,
    RequestCall,
    RequestLimits,
    ToolDecisionCall,
    call_kind,
)
from minicpm_pcd_adapters.server.constraints import schema_answer
from minicpm_pcd_adapters.server.errors import APIError, read_body
from minicpm_pcd_adapters.server.jobs import drained, json_body
from minicpm_pcd_adapters.server.metrics import ServerMetrics
from minicpm_pcd_adapters.server.protocol import Choice, Tool, Usage
from minicpm_pcd_adapters.server.settings import ServerSettings
from pcd_engine import Call, Conversation, InputError, PCDEngine, RawPrompt, Sampling, Turn, __version__

# -- requests ----------------------------------------------------------------------------------------


class _Lenient(BaseModel):
    """Ollama ignores fields it does not know (clients send `keep_alive`, `num_ctx`, ...): so do we."""

    model_config = ConfigDict(extra="ignore")


class CalledFunction(_Lenient):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, not JSON text, in Ollama


class EarlierCall(_Lenient):
    id: str | None = None
    function: CalledFunction


class OllamaMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[Any] | None = None
    tool_calls: list[EarlierCall] | None = None
    tool_name: str | None = None  # a tool result: the tool that wrote it
    tool_call_id: str | None = None  # sent by some clients; Ollama ties results by order
    thinking: str | None = None


class OllamaOptions(_Lenient):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None  # 0 or less: off
    min_p: float | None = Field(default=None, ge=0, lt=1)
    repeat_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    num_predict: int | None = None  # -1 and -2 (unbounded, fill the context): the server's default
    stop: list[str] | str | None = None


Format = Literal["", "json"] | dict[str, Any] | None


class _Request(_Lenient):
    model: str = Field(min_length=1)
    format: Format = None
    options: OllamaOptions | None = None
    stream: bool = True
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class OllamaChatRequest(_Request):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[Tool] | None = None


class OllamaGenerateRequest(_Request):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    template: str | None = None
    suffix: str | None = None
    context: list[int] | None = None
    images: list[Any] | None = None


class OllamaShowRequest(_Lenient):
    model: str = ""
    name: str | None = None  # the older spelling


# -- reading a request into a call -------------------------------------------------------------------


class OllamaReader:
    """Ollama's requests read into the server's calls, checked before any model work (APIError)."""

    def __init__(self, settings: ServerSettings, limits: RequestLimits, template: ChatTemplate) -> None:
        self.model, self.limits, self.template = settings.model_name, limits, template
        self.default_max_tokens = settings.max_tokens

    def names(self) -> tuple[str, ...]:
        """The names clients may send: the served name, and with Ollama's default tag."""
        return (self.model,) if ":" in self.model else (self.model, f"{self.model}:latest")

    def check_model(self, model: str) -> None:
        if model not in self.names():
            raise APIError(404, f"model '{model}' not found", param="model", code="model_not_found")

    def chat(self, body: Any) -> RequestCall:
        request = read_body(OllamaChatRequest, body)
        self.check_model(request.model)
        self._common(request)
        conversation = self._conversation(request.messages)
        if request.tools:
            if request.format:
                message = "give either tools or format, not both"
                raise APIError(400, message, param="format", code="conflicting_parameters")
            tools = [t.model_dump(exclude_none=True) for t in request.tools]
            sampling, max_tokens, _ = self._options(request.options)
            logprobs = _logprobs(request)
            return ToolDecisionCall(
                self.model, conversation, tools, "auto", sampling, max_tokens, stream=request.stream,
                logprobs=logprobs,
            )  # fmt: skip
        return self._formatted(request, conversation, ())

    def generate(self, body: Any) -> RequestCall | None:
        """The call of a generate request; None for an empty prompt (Ollama's "load the model")."""
        request = read_body(OllamaGenerateRequest, body)
        self.check_model(request.model)
        self._common(request)
        refused = {"template": request.template, "suffix": request.suffix, "context": request.context}
        for name, value in refused.items():
            if value:
                message = (
                    f"{name} is not supported by this server: the prompt is rendered by the model's template"
                )
                raise APIError(400, message, param=name, code="unsupported_parameter")
        if request.images:
            raise APIError(400, "this server reads text only: images cannot be answered", param="images")
        if not request.prompt:
            return None
        if len(request.prompt) + len(request.system or "") > self.limits.max_text_chars:
            message = f"the prompt is over this server's limit of {self.limits.max_text_chars} characters"
            raise APIError(400, message, param="prompt", code="string_above_max_length")
        if request.raw:
            return self._formatted(request, None, (request.prompt,))
        conversation = Conversation((Turn("user", request.prompt),), request.system or None)
        return self._formatted(request, conversation, ())

    def _common(self, request: _Request) -> None:
        if request.think not in (None, False, "false", "none"):
            message = "think is not supported by this server: it renders every prompt with thinking off"
            raise APIError(400, message, param="think", code="unsupported_parameter")

    def _formatted(
        self, request: _Request, conversation: Conversation | None, prompts: tuple[str, ...]
    ) -> RequestCall:
        """Plain chat, JSON-object generation (`"json"`, or an empty schema) or a scored schema."""
        sampling, max_tokens, stop = self._options(request.options)
        logprobs = _logprobs(request)
        stream = request.stream
        if isinstance(request.format, dict):
            scored = schema_answer(request.format)
            if scored is not None:
                schema, answer = scored
                raw = tuple(RawPrompt(p, "json") for p in prompts)
                return ClassifyCall(
                    self.model, schema, conversation, sampling, 1, None, stream, False, "format",
                    logprobs=logprobs, answer=answer, prompts=raw,
                )  # fmt: skip
        json_object = request.format == "json" or request.format == {}
        return GenerateCall(
            self.model, conversation, max_tokens, stop, sampling, json_object, 1, stream, False, logprobs,
            prompts=prompts,
        )  # fmt: skip

    def _options(self, options: OllamaOptions | None) -> tuple[Sampling, int, list[str]]:
        o = options or OllamaOptions()
        try:
            sampling = Sampling(
                temperature=o.temperature or 0.0,
                top_p=o.top_p if o.top_p is not None else 1.0,
                top_k=max(o.top_k or 0, 0),
                min_p=o.min_p or 0.0,
                repetition_penalty=o.repeat_penalty if o.repeat_penalty is not None else 1.0,
                seed=o.seed,
            )
        except InputError as error:
            raise APIError(400, str(error), param="options") from None
        asked = o.num_predict if o.num_predict is not None and o.num_predict > 0 else self.default_max_tokens
        if asked > self.limits.max_completion_tokens:
            message = f"num_predict must be at most {self.limits.max_completion_tokens} on this server"
            raise APIError(400, message, param="options.num_predict", code="invalid_value")
        stop = [o.stop] if isinstance(o.stop, str) else list(o.stop or [])
        return sampling, asked, stop

    def _conversation(self, messages: list[OllamaMessage]) -> Conversation:
        if not messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        system: list[str] = []
        turns: list[Turn] = []
        total = 0
        for index, message in enumerate(messages):
            if message.images:
                message_ = "this server reads text only: images cannot be answered"
                raise APIError(400, message_, param=f"messages.{index}.images", code="unsupported_content")
            text = message.content or ""
            total += len(text)
            if message.role == "system":
                system.append(text)
                continue
            calls = tuple(
                Call(c.function.name, c.function.arguments, c.id or "") for c in message.tool_calls or ()
            )
            turns.append(Turn(message.role, text, calls, message.tool_call_id, message.tool_name))
        if total > self.limits.max_text_chars:
            message_ = f"the messages hold {total} characters, over this server's limit"
            raise APIError(400, message_, param="messages", code="string_above_max_length")
        try:
            return Conversation(tuple(turns), "\n\n".join(system) or None)
        except InputError as error:
            raise APIError(400, str(error), param="messages") from None


def _logprobs(request: _Request) -> int | None:
    return (request.top_logprobs or 0) if request.logprobs else None


# -- writing the answer ------------------------------------------------------------------------------


class OllamaWriter:
    """One answer in Ollama's shape: `message` (chat) or `response` (generate), the final object with
    `done`, the reason, the durations (nanoseconds) and the token counts."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat, self.started = model, chat, time.perf_counter_ns()

    def piece(
        self, text: str, logprobs: list[dict[str, Any]] | None = None, calls: Any = None
    ) -> dict[str, Any]:
        out = self._head()
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if calls:
                out["message"]["tool_calls"] = calls
        else:
            out["response"] = text
        if logprobs:
            out["logprobs"] = logprobs
        out["done"] = False
        return out

    def done(
        self, reason: str, tokens: Usage | None, extension: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        out = self.piece("")
        out.update(done=True, done_reason=reason, total_duration=time.perf_counter_ns() - self.started)
        out["load_duration"] = 0
        if tokens is not None:
            out.update(prompt_eval_count=tokens.prompt_tokens, eval_count=tokens.completion_tokens)
        if extension is not None:
            out["pcd"] = extension
        return out

    def whole(self, choice: Choice, tokens: Usage) -> dict[str, Any]:
        """A non-streamed answer: the choice's text (or tool calls) and the final fields in one."""
        out = self.done(_reason(choice), tokens, _extension(choice))
        first = self.piece(choice.message.content or "", _logprobs_of(choice), _calls_of(choice))
        out["message" if self.chat else "response"] = first["message" if self.chat else "response"]
        if "logprobs" in first:
            out["logprobs"] = first["logprobs"]
        return out

    def _head(self) -> dict[str, Any]:
        created = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        return {"model": self.model, "created_at": created}


def _reason(choice: Choice) -> str:
    return "length" if choice.finish_reason == "length" else "stop"


def _extension(choice: Choice) -> dict[str, Any] | None:
    if choice.pcd is None:
        return None
    return choice.pcd.model_dump(mode="json", by_alias=True, exclude_unset=True)


def _calls_of(choice: Choice) -> list[dict[str, Any]] | None:
    calls = choice.message.tool_calls or []
    return [
        {"id": c.id, "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
        for c in calls
    ] or None


def _logprobs_of(choice: Choice) -> list[dict[str, Any]] | None:
    if choice.logprobs is None or choice.logprobs.content is None:
        return None
    return [
        _logprob(e.token, e.logprob, [_logprob(t.token, t.logprob) for t in e.top_logprobs])
        for e in choice.logprobs.content
    ]


def _logprob(token: str, logprob: float, top: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"token": token, "logprob": logprob}
    if top is not None:
        out["top_logprobs"] = top
    return out


# -- the endpoints -----------------------------------------------------------------------------------


class CallRunner(Protocol):
    """What the Ollama door needs of the server's chat endpoints (`app.CompletionEndpoints`)."""

    async def run(self, call: RequestCall, request: Request) -> tuple[list[Choice], Usage]: ...
    async def pieces(self, call: GenerateCall) -> Any: ...


class OllamaEndpoints:
    """The Ollama routes: each request read by `OllamaReader`, run by the chat endpoints, written by
    `OllamaWriter`."""

    def __init__(
        self,
        runner: CallRunner,
        reader: OllamaReader,
        engine: PCDEngine,
        metrics: ServerMetrics,
        created: int,
    ) -> None:
        self.runner, self.reader, self.engine, self.metrics = runner, reader, engine, metrics
        self.modified = datetime.fromtimestamp(created, timezone.utc).isoformat().replace("+00:00", "Z")

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, self.reader.chat, chat=True)

    async def generate(self, request: Request) -> Response:
        return await self._answer(request, self.reader.generate, chat=False)

    async def _answer(
        self, request: Request, read: Callable[[Any], RequestCall | None], chat: bool
    ) -> Response:
        started, kind, status = time.perf_counter(), "other", 500
        try:
            call = read(await json_body(request))
            writer = OllamaWriter(self.reader.model, chat)
            if call is None:  # an empty prompt: Ollama loads the model and answers at once
                status = 200
                return JSONResponse(writer.done("load", None) | {"response": ""})
            kind = call_kind(call)
            if isinstance(call, GenerateCall) and call.stream:
                first, pieces, leave = await self.runner.pieces(call)
                status = 200
                return _ndjson(self._streamed(writer, first, pieces, leave))
            answers, tokens = await self.runner.run(call, request)
            (choice,) = answers
            status = 200
            if not call.stream:
                return JSONResponse(writer.whole(choice, tokens))
            lines = [
                writer.piece(choice.message.content or "", _logprobs_of(choice), _calls_of(choice)),
                writer.done(_reason(choice), tokens, _extension(choice)),
            ]
            return _ndjson(_replayed(lines))
        except APIError as error:
            status = error.status
            raise
        finally:
            self.metrics.requests.labels(kind, str(status)).inc()
            self.metrics.latency.labels(kind).observe(time.perf_counter() - started)

    async def _streamed(
        self, writer: OllamaWriter, first: Any, pieces: Any, leave: Any
    ) -> AsyncIterator[dict[str, Any]]:
        prompt_tokens = completion_tokens = 0
        try:
            async for _, piece in drained(first, pieces, leave):
                logprobs = [
                    _logprob(t.token, t.logprob, [_logprob(x, p) for x, p in t.top])
                    for t in piece.logprobs or ()
                ]
                if piece.text or logprobs:
                    yield writer.piece(piece.text, logprobs)
                if piece.finish_reason is not None:
                    prompt_tokens, completion_tokens = piece.prompt_tokens or 0, piece.completion_tokens or 0
                    reason = "length" if piece.finish_reason == "length" else "stop"
                    tokens = usage(prompt_tokens, completion_tokens)
                    yield writer.done(reason, tokens)
        finally:
            self.metrics.on_tokens(prompt_tokens, completion_tokens)

    async def tags(self) -> dict[str, Any]:
        return {"models": [self._card(name) for name in self.reader.names()[-1:]]}

    async def show(self, request: Request) -> dict[str, Any]:
        asked = read_body(OllamaShowRequest, await json_body(request))
        self.reader.check_model(asked.model or asked.name or "")
        config = getattr(self.engine.model, "config", None)
        family = str(getattr(config, "model_type", "unknown"))
        template = str(getattr(self.engine.tokenizer, "chat_template", None) or "")
        return {
            "modelfile": f"# served by minicpm-pcd {__version__}",
            "parameters": "",
            "template": template,
            "details": self._details(family),
            "model_info": {
                "general.architecture": family,
                f"{family}.context_length": self.engine.limits.max_prompt_tokens,
            },
            "capabilities": ["completion", "tools"],
            "modified_at": self.modified,
        }

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    def _card(self, name: str) -> dict[str, Any]:
        config = getattr(self.engine.model, "config", None)
        return {
            "name": name,
            "model": name,
            "modified_at": self.modified,
            "size": sum(p.numel() * p.element_size() for p in self.engine.model.parameters()),
            "digest": "",
            "details": self._details(str(getattr(config, "model_type", "unknown"))),
        }

    def _details(self, family: str) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "safetensors",
            "family": family,
            "families": [family],
            "parameter_size": f"{sum(p.numel() for p in self.engine.model.parameters()) / 1e6:.0f}M",
            "quantization_level": self.engine.precision,
        }


async def _replayed(lines: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for line in lines:
        yield line


def _ndjson(lines: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def text() -> AsyncIterator[str]:
        async for line in lines:
            yield json.dumps(line, ensure_ascii=False) + "\n"

    return StreamingResponse(text(), media_type="application/x-ndjson")
