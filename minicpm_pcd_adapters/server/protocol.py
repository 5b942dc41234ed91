"""The HTTP protocol of `pcd serve`, in one place (as vLLM's `protocol.py`): the Pydantic models of
every body its OpenAI-compatible routes read and write. Requests: chat and text completions (the other
servers' constraint fields from `constraints.py`), `/classify`, `/tokenize`, `/detokenize`. Answers:
completions and chunks with the `pcd` extension and standard `logprobs`, classifications, tokens,
`Health`, the model and calibration lists; the error body is `errors.ErrorBody`. The server builds
every answer from these models (`dump`) and `/openapi.json` publishes them (`openapi.py`), so the
document cannot drift from what is sent; answer models refuse unknown fields. (Ollama's: `ollama_calls.py`.)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minicpm_pcd_adapters.server.constraints import ConstrainedDecoding

# -- requests ----------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # JSON types as the schema says: no coercion


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class MediaPart(BaseModel):
    """An image, audio or file part: part of the API, refused by this text-only server with a 400
    that says so (not a shape error)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["image_url", "input_audio", "file"]


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str  # JSON text, as OpenAI writes it


class EarlierCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # type

    id: str | None = None
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # name, refusal: no text we use

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | MediaPart] | None = None
    tool_calls: list[EarlierCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers


class JsonSchema(_Strict):
    name: str | None = Field(default=None, min_length=1, max_length=64)  # optional, as vLLM takes it
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama.cpp's and SGLang's form


class Function(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class PCDOptions(_Strict):
    """The request extension `"pcd": {...}` (`extra_body` in the openai SDK)."""

    abstain_below: float | None = Field(default=None, gt=0, lt=1)


class ChatCompletionRequest(ConstrainedDecoding):
    model: str
    messages: list[Message] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=1, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(default=None, ge=0, lt=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 and 0: off, as vLLM and llama.cpp read them
    n_probs: int | None = Field(default=None, ge=0, le=20)  # llama.cpp: alternatives per token
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    pcd: PCDOptions | None = None


DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions


class CompletionRequest(ConstrainedDecoding):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]  # token ids: refused with a clear 400
    suffix: str | None = None
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=1, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = False
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(default=None, ge=0, lt=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 and 0: off, as vLLM and llama.cpp read them
    n_probs: int | None = Field(default=None, ge=0, le=20)  # llama.cpp: alternatives per token
    seed: int | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None  # vLLM takes it on completions too
    pcd: PCDOptions | None = None


class ClassificationRequest(_Strict):
    """`POST /classify` (and `/v1/classify`), vLLM's and SGLang's: texts (`input`) or vLLM's chat form
    (one conversation in `messages`), classified with the schema of `pcd serve --schema`."""

    model: str | None = None  # optional, as vLLM takes it; when given, the served model's id
    input: str | list[str] | None = None
    messages: list[Message] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None
    priority: int | None = None  # accepted, ignored: one queue
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # refused when set: never truncated
    pcd: PCDOptions | None = None


class TokenizeRequest(_Strict):
    """`POST /tokenize`, vLLM's two forms: a `prompt` (as data, after the BOS if `add_special_tokens`),
    or chat `messages` rendered as every chat request is (the assistant's start included)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # only true: every chat request is rendered up to the answer
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# -- answers -----------------------------------------------------------------------------------------


FinishReason = Literal["stop", "length", "tool_calls"]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


def dump(answer: BaseModel) -> dict[str, Any]:
    """The JSON body of an answer: the fields it was given (None included), none it was not."""
    return answer.model_dump(mode="json", by_alias=True, exclude_unset=True)


class Health(_Answer):
    """`GET /health`: 200 "ok" while the model worker takes work; 503 "starting" or "stopped" if not."""

    status: Literal["ok", "starting", "stopped"]
    model: str
    queue_depth: int


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None  # the most prompt tokens the engine takes (Limits.max_prompt_tokens)


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Answer):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Answer):
    prompt: str


class CalibrationCard(_Answer):
    id: str
    object: Literal["calibration"]
    schema_: str = Field(alias="schema", description="the fingerprint of the plan it was fitted for")
    model: str
    methods: dict[str, str]


class CalibrationList(_Answer):
    object: Literal["list"]
    data: list[CalibrationCard]


class TopLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class Logprobs(_Answer):
    """Per scored field its value, then the generated tokens (docs/server.md#standard-logprobs)."""

    content: list[TokenLogprob] | None
    refusal: None = None


class FunctionCall(_Answer):
    name: str
    arguments: str


class ToolCall(_Answer):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None


class FieldAnswer(_Answer):
    """One field of the `pcd` extension: scored fields carry the rest, generated ones only the value."""

    value: Any
    source: Literal["scored", "generated"]
    probabilities: dict[str, float] | None = None
    margin: float | None = None
    rule: str | None = None
    rescored: bool | None = None
    calibration: str | None = None
    abstained: bool | None = None


class CalibrationUsed(_Answer):
    name: str
    methods: dict[str, str]


class PCDExtension(_Answer):
    """`choice.pcd` of a structured answer (docs/server.md#the-pcd-extension)."""

    fields: dict[str, FieldAnswer]
    needs_review: bool
    abstained_fields: list[str]
    forward_calls: int
    cached_tokens: int
    calibration: CalibrationUsed | None
    same_scores_as: int | None = None  # n > 1: the choice whose scored fields this one repeats


class ToolDecisionExtension(_Answer):
    """`choice.pcd` of a tool decision: the tool called (null: a text answer), every allowed tool's
    probability ("" for the text answer), the decision and the chosen tool's arguments as fields."""

    tool: str | None
    call_id: str | None = None  # the call's id, as in `message.tool_calls` (null: a text answer)
    probabilities: dict[str, float]
    decision: FieldAnswer | None
    arguments: dict[str, FieldAnswer]
    needs_review: bool
    abstained_fields: list[str]
    forward_calls: int | None = None
    cached_tokens: int | None = None


class Choice(_Answer):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: Logprobs | None
    pcd: PCDExtension | ToolDecisionExtension | None = None  # structured answers and tool decisions


class PromptTokensDetails(_Answer):
    cached_tokens: int


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(_Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: None = None


class StreamedToolCall(ToolCall):
    index: int


class Delta(_Answer):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[StreamedToolCall] | None = None


class ChunkChoice(_Answer):
    index: int
    delta: Delta
    finish_reason: FinishReason | None
    logprobs: Logprobs | None
    pcd: PCDExtension | ToolDecisionExtension | None = None  # on the chunk with its finish_reason


class ChatCompletionChunk(_Answer):
    """One server-sent event's data (`stream: true`); the stream ends with `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # on the last chunk, with stream_options.include_usage
    system_fingerprint: None = None


class ClassificationData(_Answer):
    """One text's answer: the first scored field's value (`label`) and its probabilities in the
    schema's value order (`probs`); every field in the `pcd` extension."""

    index: int
    label: str  # the value as a JSON object key: strings as they are, others as JSON (true, 3)
    probs: list[float]
    num_classes: int
    pcd: PCDExtension


class ClassificationResponse(_Answer):
    """`POST /classify`: one entry per input, in order."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassificationData]
    usage: Usage


class TextLogprobs(_Answer):
    """`logprobs` of a text completion: per token, its text, log-probability, alternatives, offset."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TextChoice(_Answer):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: TextLogprobs | None
    pcd: PCDExtension | None = None  # a choice or a JSON schema answered after the prompt


class TextCompletion(_Answer):
    """`POST /v1/completions`: one choice per prompt (`n` each), in order."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    system_fingerprint: None = None
