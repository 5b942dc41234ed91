"""What a Chat Completions request asks of the engine: its body (`protocol.ChatCompletionRequest`)
checked into a call. No web framework and no model here; `answers.py` writes the answers.

`parse_request(body, limits)` reads the messages into the engine's `Conversation` once
(`conversation_of`) and returns one of:
- `ClassifyCall`: a `json_schema` response format or a choice: the engine classifies the conversation
  with that schema;
- `ToolDecisionCall`: tools to call (`engine.tools.call`): the model chooses between them ("auto", or
  "required" between several), or must call one (a named tool, or "required" with one tool);
- `GenerateCall`: plain chat, or `json_object` (grammar-constrained JSON).

Anything it cannot honour raises `APIError` (HTTP 400 with OpenAI's error body: message, type, param,
code) before any model work. The per-field scores go in an extension object on each choice,
`choice["pcd"]`, which OpenAI clients keep as an extra attribute (`choice.pcd` in the `openai` SDK).

    >>> call = parse_request(
    ...     {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, RequestLimits()
    ... )
    >>> type(call).__name__, call.conversation.user_text
    ('GenerateCall', 'Hi')
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minicpm_pcd_adapters.server.constraints import (
    Constraint,
    choice_schema,
    read_constraint,
    schema_answer,
)
from minicpm_pcd_adapters.server.errors import APIError, read_body
from minicpm_pcd_adapters.server.protocol import (
    ChatCompletionRequest,
    MediaPart,
    Message,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
)
from minicpm_pcd_adapters.server.template import ChatTemplate, Switches
from pcd_engine import Call, Conversation, Grammar, InputError, RawPrompt, Sampling, Turn


@dataclass(frozen=True)
class RequestLimits:
    max_text_chars: int = 100_000  # all message contents together
    max_n: int = 8
    max_prompts: int = 256  # prompts in one /v1/completions request
    max_completion_tokens: int = 4096  # the most a plain chat request may ask for


@dataclass(frozen=True)
class ClassifyCall:
    """Classify `conversation` with `schema` (a JSON-schema dict)."""

    model: str
    schema: dict[str, Any]
    conversation: Conversation | None  # None: /v1/completions, whose `prompts` are classified
    sampling: Sampling  # for generated (open) fields
    n: int = 1
    abstain_below: float | None = None
    stream: bool = False
    include_usage: bool = False
    schema_param: str = "response_format.json_schema.schema"  # where errors in the schema point
    calibration: str | None = None  # the name of the loaded calibration that matched, if any
    logprobs: int | None = None  # answer with `choice.logprobs`, k alternatives each; None: not asked
    answer: str = "json"  # "choice": the chosen value alone (vLLM's `choice`); "enum": it as JSON
    prompts: tuple[RawPrompt, ...] = ()  # /v1/completions: raw prompts, classified instead of `text`
    switches: Switches = ()  # template switches the prompt is rendered with (`PCDEngine.rendered_with`)

    @property
    def layout(self) -> str:
        return self.prompts[0].layout if self.prompts else "chat"

    @property
    def system(self) -> str | None:
        """The conversation's system text: the instructions its plan is built with."""
        return self.conversation.system if self.conversation is not None else None

    def inputs(self) -> list[Any]:
        """What the engine classifies, in choice order: each prompt (or the conversation) `n` times."""
        return [p for p in self.prompts or [self.conversation] for _ in range(self.n)]

    def batch_key(self) -> tuple[Any, ...]:
        """Requests with equal keys can share one `classify_batch` (same schema, plan, options)."""
        schema = json.dumps(self.schema, sort_keys=True)
        options = (self.sampling, self.abstain_below, self.calibration, self.logprobs)
        return (schema, self.system, self.layout, self.switches, *options)


@dataclass(frozen=True)
class ToolDecisionCall:
    """Decide between `tools` (and a text answer under "auto") for `conversation`, or call the one
    tool a choice names: `engine.tools.call`."""

    model: str
    conversation: Conversation
    tools: list[dict[str, Any]]  # OpenAI `tools` entries
    tool_choice: Any  # "auto", "required", or `{"type": "function", "function": {"name": ...}}`
    sampling: Sampling  # for generated arguments and text answers
    max_tokens: int
    n: int = 1
    abstain_below: float | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    schema_param: str = "tools"  # where errors in a tool's parameters point
    switches: Switches = ()


@dataclass(frozen=True)
class GenerateCall:
    model: str
    conversation: Conversation | None  # None: /v1/completions, whose `prompts` are continued
    max_tokens: int
    stop: list[str]
    sampling: Sampling
    json_object: bool = False
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # the engine's `logprobs=`: alternatives per token, None when off
    grammar: Grammar | None = None  # a regex or grammar constraint (xgrammar)
    grammar_param: str | None = None  # the request parameter it came from
    prompts: tuple[str, ...] = ()  # /v1/completions: raw prompts, continued instead of `messages`
    switches: Switches = ()

    def runs(self) -> list[tuple[Any, Sampling]]:
        """(engine input, sampling) per choice, in choice order: each prompt (or the conversation)
        `n` times, a given seed offset per choice so that they differ."""
        inputs: list[Any] = [RawPrompt(p) for p in self.prompts] or [self.conversation]
        return [(item, nth_sampling(self.sampling, k)) for item in inputs for k in range(self.n)]


RequestCall = ClassifyCall | ToolDecisionCall | GenerateCall  # what a request asks of the engine


def call_kind(call: RequestCall) -> str:
    """What a call is, as the request metrics label it."""
    return {ClassifyCall: "classify", ToolDecisionCall: "tools"}.get(type(call), "generate")


def nth_sampling(sampling: Sampling, index: int) -> Sampling:
    """The sampling of the index-th choice: a given seed is offset so that choices differ."""
    return sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + index)


def parse_request(
    body: Any, limits: RequestLimits, default_max_tokens: int = 512, template: ChatTemplate | None = None
) -> ClassifyCall | GenerateCall | ToolDecisionCall:
    """The call a Chat Completions body asks for; APIError (400) for anything not honoured.
    `template`: the served chat template, against which `chat_template_kwargs` are read."""
    request = read_body(ChatCompletionRequest, body)
    constraint = read_constraint(request)
    asked = requested_schema(request.response_format, constraint)
    if constraint is not None:
        _alone(constraint, request, asked)
    decided = _tool_choice(request)
    _refuse_unsupported(request, limits)
    switches = (template or ChatTemplate()).switches(request.chat_template_kwargs)
    conversation = conversation_of(request.messages, limits)
    sampling = request_sampling(request)
    n = request.n or 1
    stream = bool(request.stream)
    usage = bool(request.stream_options and request.stream_options.include_usage)
    if request.stream_options is not None and not stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    logprobs = (
        (request.top_logprobs or 0) if request.logprobs else request.n_probs
    )  # the engine's `logprobs=`
    max_tokens = request.max_completion_tokens or request.max_tokens or default_max_tokens
    abstain = request.pcd.abstain_below if request.pcd else None
    if decided is not None:
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        return ToolDecisionCall(
            request.model, conversation, tools, decided, sampling, max_tokens, n, abstain, stream, usage,
            logprobs, _tool_param(request), switches,
        )  # fmt: skip
    if constraint is not None and constraint.kind == "choice":
        return ClassifyCall(
            request.model, choice_schema(constraint.value), conversation, sampling, n, abstain, stream,
            usage, constraint.param, logprobs=logprobs, answer="choice", switches=switches,
        )  # fmt: skip
    scored = schema_answer(asked[0]) if asked is not None else None
    if asked is not None and scored is not None:
        return ClassifyCall(
            request.model, scored[0], conversation, sampling, n, abstain, stream, usage, asked[1],
            logprobs=logprobs, answer=scored[1], switches=switches,
        )  # fmt: skip
    format_ = request.response_format
    json_object = (format_ is not None and format_.type == "json_object") or asked is not None  # `{}`
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    grammar, grammar_param = (constraint.grammar(), constraint.param) if constraint else (None, None)
    if constraint is not None and constraint.kind == "json":  # `{}` as a constraint: any JSON object
        json_object, grammar = True, None
    return GenerateCall(
        request.model, conversation, max_tokens, stop, sampling, json_object, n, stream, usage, logprobs,
        grammar, grammar_param, switches=switches,
    )  # fmt: skip


def requested_schema(
    format_: ResponseFormat | None, constraint: Constraint | None
) -> tuple[dict[str, Any], str] | None:
    """The JSON schema a request asks for and the parameter it came from: `response_format`'s
    (OpenAI's `json_schema.schema`, or llama.cpp's and SGLang's `schema` beside the type), or a
    constraint's (`json_schema`, `guided_json`, ...). The same schema sent both ways is one request;
    two different ones are a 400."""
    from_format = None
    if format_ is not None and format_.type != "text":
        if format_.schema_ is not None:
            from_format = (_titled(format_.schema_, format_), "response_format.schema")
        elif format_.type == "json_schema":
            from_format = (format_schema(format_), "response_format.json_schema.schema")
    from_constraint = None
    if constraint is not None and constraint.kind == "json":
        from_constraint = (constraint.value, constraint.param)
    if (
        from_format is not None
        and from_constraint is not None
        and _untitled(from_format[0], format_) != from_constraint[0]
    ):
        message = f"conflicting constraints: response_format and {from_constraint[1]}; give one"
        raise APIError(400, message, param=from_constraint[1], code="conflicting_parameters")
    return from_format or from_constraint


def _alone(
    constraint: Constraint, request: ChatCompletionRequest, asked: tuple[dict[str, Any], str] | None
) -> None:
    """A 400 naming both when a constraint comes with a response format or tools to call (a schema
    constraint equal to the response format's schema is one request: `requested_schema`)."""
    format_ = request.response_format
    if format_ is not None and format_.type != "text":
        if constraint.kind == "json" and asked is not None and asked[1] != constraint.param:
            return  # the same schema both ways (requested_schema refused two different ones)
        other = "response_format"
    elif request.tools and request.tool_choice != "none":
        other = "tools"
    else:
        return
    message = f"conflicting constraints: {other} and {constraint.param}; give one"
    raise APIError(400, message, param=constraint.param, code="conflicting_parameters")


def _refuse_unsupported(request: ChatCompletionRequest, limits: RequestLimits) -> None:
    if request.top_logprobs and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    refuse_beyond_limits(request, limits, param, request.max_completion_tokens or request.max_tokens or 0)


def refuse_beyond_limits(request: Any, limits: RequestLimits, tokens_param: str, asked: int) -> None:
    """What chat and completions refuse alike: `logit_bias` and penalties (not supported), and more
    tokens (`asked`, from `tokens_param`), choices or stop strings than this server allows."""
    for name in ("logit_bias", "presence_penalty", "frequency_penalty"):
        if getattr(request, name):  # None, 0 and {} mean "not used"
            message = f"{name} is not supported by this server"
            raise APIError(400, message, param=name, code="unsupported_parameter")
    if asked > limits.max_completion_tokens:
        message = f"{tokens_param} must be at most {limits.max_completion_tokens} on this server, got {asked}"
        raise APIError(400, message, param=tokens_param, code="invalid_value")
    if (request.n or 1) > limits.max_n:
        raise APIError(
            400, f"n must be at most {limits.max_n}, got {request.n}", param="n", code="invalid_value"
        )
    if isinstance(request.stop, list) and len(request.stop) > 4:
        raise APIError(400, "stop takes at most 4 sequences", param="stop", code="invalid_value")


def conversation_of(messages: Sequence[Message], limits: RequestLimits) -> Conversation:
    """A request's messages (chat, /tokenize) as the engine's conversation: text parts joined (media
    refused), an assistant's `tool_calls` with their ids, a tool result tied to its call by
    `tool_call_id`; 400 for a bad one, naming the message."""
    system: list[str] = []
    turns: list[Turn] = []
    total = 0
    for index, message in enumerate(messages):
        content = message.content
        for number, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, MediaPart):
                raise APIError(
                    400,
                    f"this server reads text only: a {part.type!r} content part cannot be answered",
                    param=f"messages.{index}.content.{number}",
                    code="unsupported_content",
                )
        text = (
            "".join(p.text for p in content if isinstance(p, TextPart))
            if isinstance(content, list)
            else (content or "")
        )
        total += len(text)
        if message.role in ("system", "developer"):
            system.append(text)
            continue
        try:
            calls = tuple(
                Call(c.function.name, _arguments(c.function.arguments), c.id or "")
                for c in message.tool_calls or ()
            )
        except InputError as error:
            raise APIError(400, str(error), param=f"messages.{index}.tool_calls") from None
        turns.append(Turn(message.role, text, calls, message.tool_call_id))
    if total > limits.max_text_chars:
        raise APIError(
            400,
            f"the messages hold {total} characters, over this server's limit of {limits.max_text_chars}",
            param="messages",
            code="string_above_max_length",
        )
    try:
        return Conversation(tuple(turns), "\n\n".join(system) or None)
    except InputError as error:
        raise APIError(400, str(error), param="messages") from None


def _arguments(text: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as error:
        raise InputError(f"tool call arguments are not JSON: {error}") from None
    if not isinstance(arguments, dict):
        raise InputError("tool call arguments must be a JSON object")
    return arguments


def _tool_choice(request: ChatCompletionRequest) -> Any:
    """The `tool_choice` the engine's tool caller gets ("auto", "required" or a named function), or
    None for no tools or "none" (plain chat, or a response format)."""
    tools, choice = request.tools or [], request.tool_choice
    if request.tools is not None and not tools:
        raise APIError(400, "tools must hold at least one tool; leave it out for none", param="tools")
    if not tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
        message = "tool_choice 'required' or a named tool needs tools: give the tools to call"
        raise APIError(400, message, param="tool_choice", code="invalid_value")
    if not tools or choice == "none":
        return None
    if request.response_format is not None and request.response_format.type != "text":
        raise APIError(400, "use either tools or response_format, not both", param="response_format")
    if isinstance(choice, NamedToolChoice):
        if all(t.function.name != choice.function.name for t in tools):
            raise APIError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not in tools",
                param="tool_choice",
                code="invalid_value",
            )
        return {"type": "function", "function": {"name": choice.function.name}}
    return "auto" if choice is None else str(choice)


def _tool_param(request: ChatCompletionRequest) -> str:
    """Where an error in the called tool's parameters points: the named (or only) tool's."""
    tools, choice = request.tools or [], request.tool_choice
    if isinstance(choice, NamedToolChoice):
        index = next(i for i, t in enumerate(tools) if t.function.name == choice.function.name)
        return f"tools.{index}.function.parameters"
    return "tools.0.function.parameters" if len(tools) == 1 else "tools"


def request_sampling(request: Any) -> Sampling:
    """The sampling of a chat or text completion request (`sampling_of` its fields)."""
    return sampling_of(
        request.temperature,
        request.top_p,
        request.top_k,
        request.min_p,
        request.repetition_penalty,
        request.seed,
    )


def sampling_of(
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    repetition_penalty: float | None,
    seed: int | None,
) -> Sampling:
    """A request's sampling fields (any protocol's) as the engine's `Sampling`: each left out is the
    engine's default, and a `top_k` of 0 or less is off (vLLM's -1, Ollama's 0)."""
    return Sampling(
        temperature=temperature or 0.0,
        top_p=top_p if top_p is not None else 1.0,
        top_k=max(top_k or 0, 0),
        min_p=min_p or 0.0,
        repetition_penalty=repetition_penalty if repetition_penalty is not None else 1.0,
        seed=seed,
    )


def format_schema(format_: ResponseFormat) -> dict[str, Any]:
    """The schema of a `json_schema` response format, its name and description as the schema's
    title and description where it has none (chat and completions alike)."""
    if format_.schema_ is not None:
        return _titled(format_.schema_, format_)
    if format_.json_schema is None:
        raise APIError(
            400, "response_format json_schema needs its json_schema object", param="response_format"
        )
    return _titled(format_.json_schema.schema_, format_)


def _titled(schema: dict[str, Any], format_: ResponseFormat) -> dict[str, Any]:
    schema = dict(schema)
    if schema and format_.json_schema is not None and format_.json_schema.name:
        schema.setdefault("title", format_.json_schema.name)
    if schema and format_.json_schema is not None and format_.json_schema.description:
        schema.setdefault("description", format_.json_schema.description)
    return schema


def _untitled(schema: dict[str, Any], format_: ResponseFormat | None) -> dict[str, Any]:
    """A response format's schema as sent (without the title and description its name gave)."""
    if format_ is None or format_.json_schema is None:
        return schema
    sent = format_.schema_ if format_.schema_ is not None else format_.json_schema.schema_
    return dict(sent)
