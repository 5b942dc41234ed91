"""Ollama's requests (`/api/chat`, `/api/generate`, `/api/show`) read into the server's calls, as
`calls.py` reads chat completions: the same `ClassifyCall`, `ToolDecisionCall` or `GenerateCall`,
checked before any model work (APIError, written as Ollama's `{"error": ...}` body).

`format` as a JSON schema is a `ClassifyCall` (closed fields scored, a root `enum` as a choice, `{}` any
JSON object), `"json"` JSON-object generation, `tools` a tool decision ("auto": Ollama has no
`tool_choice`), anything else plain chat. `options`: `temperature`, `top_p`, `top_k`, `min_p`,
`repeat_penalty`, `seed`, `num_predict`, `stop` are honoured; the rest tune Ollama's runtime and are
ignored. `think` sets the template's `enable_thinking` (refused, as Ollama does, by a model whose
template has no such switch); images, `template`, `suffix` and `context` are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minicpm_pcd_adapters.server.calls import (
    ClassifyCall,
    GenerateCall,
    RequestCall,
    RequestLimits,
    ToolDecisionCall,
    sampling_of,
)
from minicpm_pcd_adapters.server.constraints import schema_answer
from minicpm_pcd_adapters.server.errors import APIError, read_body
from minicpm_pcd_adapters.server.protocol import Tool
from minicpm_pcd_adapters.server.settings import ServerSettings
from minicpm_pcd_adapters.server.template import ChatTemplate, Switches
from pcd_engine import Call, Conversation, InputError, RawPrompt, Sampling, Turn

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
        self.model, self.limits, self.default_max_tokens = settings.model_name, limits, settings.max_tokens
        self.template = template

    def names(self) -> tuple[str, ...]:
        """The names clients may send: the served name, and with Ollama's default tag."""
        return (self.model,) if ":" in self.model else (self.model, f"{self.model}:latest")

    def check_model(self, model: str) -> None:
        if model not in self.names():
            raise APIError(404, f"model '{model}' not found", param="model", code="model_not_found")

    def chat(self, body: Any) -> RequestCall:
        request = read_body(OllamaChatRequest, body)
        self.check_model(request.model)
        switches = self._switches(request)
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
                logprobs=logprobs, switches=switches,
            )  # fmt: skip
        return self._formatted(request, conversation, (), switches)

    def generate(self, body: Any) -> RequestCall | None:
        """The call of a generate request; None for an empty prompt (Ollama's "load the model")."""
        request = read_body(OllamaGenerateRequest, body)
        self.check_model(request.model)
        switches = self._switches(request)
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
            return self._formatted(request, None, (request.prompt,), switches)
        conversation = Conversation((Turn("user", request.prompt),), request.system or None)
        return self._formatted(request, conversation, (), switches)

    def _switches(self, request: _Request) -> Switches:
        """`think` as the template's `enable_thinking` (`"high"` and the other levels: on)."""
        if request.think is None:
            return ()
        on = request.think not in (False, "false", "none")
        if on and not self.template.reads("enable_thinking"):
            raise APIError(400, f'"{self.model}" does not support thinking', param="think")
        return self.template.switches({"enable_thinking": on}, param="think")

    def _formatted(
        self,
        request: _Request,
        conversation: Conversation | None,
        prompts: tuple[str, ...],
        switches: Switches,
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
                    logprobs=logprobs, answer=answer, prompts=raw, switches=switches,
                )  # fmt: skip
        json_object = request.format == "json" or request.format == {}
        return GenerateCall(
            self.model, conversation, max_tokens, stop, sampling, json_object, 1, stream, False, logprobs,
            prompts=prompts, switches=switches,
        )  # fmt: skip

    def _options(self, options: OllamaOptions | None) -> tuple[Sampling, int, list[str]]:
        o = options or OllamaOptions()
        try:
            sampling = sampling_of(o.temperature, o.top_p, o.top_k, o.min_p, o.repeat_penalty, o.seed)
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
