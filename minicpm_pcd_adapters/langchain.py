"""LangChain: `ChatMiniCPM`, a chat model whose `with_structured_output(Schema)` runs the PCD engine.

Plain chat (`invoke`, `stream`, `batch` and async forms) uses `PCDEngine.generate` / `stream`. A
structured call binds the schema to the model (`bind(ls_structured_output_format=..., pcd_schema=...)`),
so callbacks and tracing see it once per call; `_generate` then runs `engine.classify`: closed fields
scored, open fields generated. The answer is an AIMessage whose content is the object's JSON and whose
`response_metadata["pcd"]` holds every field's probabilities; a parser turns it into the instance
(Pydantic, including pydantic.v1) or dict. `batch` / `abatch` of a structured runnable answer all
inputs with one `engine.classify_batch` first, then run LangChain's usual per-input path (callbacks,
order, `return_exceptions`) on the precomputed answers.

>>> llm = ChatMiniCPM()  # MiniCPM5-2B at the pinned revision, loaded on first use  # doctest: +SKIP
>>> llm.with_structured_output(Ticket).invoke("I was charged twice")  # doctest: +SKIP
Ticket(topic='billing', ...)
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    ToolMessage,
    UsageMetadata,
    convert_to_messages,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import (
    Runnable,
    RunnableBinding,
    RunnableConfig,
    RunnableLambda,
    RunnableMap,
    RunnablePassthrough,
)
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from minicpm_pcd_adapters.messages import SAMPLING_OPTIONS, sampling_for, structured_request
from minicpm_pcd_adapters.minicpm import MINICPM5_2B, EngineSlot
from pcd_engine import Calibration, PCDEngine, PCDError, PCDResult, output_type, require_closed

METHODS = ("json_schema", "function_calling", "json_mode", "pcd")
SCHEMA_KEY = "pcd_schema"  # bound kwargs of a structured call
_PRECOMPUTED: contextvars.ContextVar[dict[Any, PCDResult[Any] | PCDError] | None] = contextvars.ContextVar(
    "pcd_precomputed", default=None
)
_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


class ChatMiniCPM(BaseChatModel):
    """A local chat model (MiniCPM5-2B by default) with PCD structured output.

    `model` is a hub id (pinned `revision`), a local folder or a GGUF file (`gguf_file`); or pass
    `engine`, an already loaded `PCDEngine`, so that several chat models share one model. Decoding is
    greedy unless `temperature` > 0 (MiniCPM5 recommends temperature 1.0, top_p 0.95, min_p 0.0 for
    sampled chat). `calibration` (from `engine.calibrate`, fitted with the same schema and system
    message) and `abstain_below` apply to structured answers; the message's `response_metadata["pcd"]`
    then says which fields abstained (`abstained_fields`, `needs_review`).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    model: str = Field(default=MINICPM5_2B.hub_id, alias="model_name")
    revision: str | None = None
    gguf_file: str | None = None
    engine: PCDEngine | None = Field(default=None, exclude=True)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)  # PCDEngine options when loading
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    calibration: Calibration | None = Field(default=None, exclude=True)  # for the structured schema
    abstain_below: float | None = None  # structured fields below this confidence: needs_review

    _slot: EngineSlot = PrivateAttr(default_factory=EngineSlot)

    @property
    def _llm_type(self) -> str:
        return "minicpm-pcd"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "revision": self.revision, "gguf_file": self.gguf_file}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            **{  # type: ignore[typeddict-item]
                "ls_provider": "minicpm_pcd",
                "ls_model_name": kwargs.get("model", self.model),
                "ls_model_type": "chat",
                "ls_temperature": kwargs.get("temperature", self.temperature),
                "ls_max_tokens": kwargs.get("max_tokens", self.max_tokens),
            }
        )
        stops = stop or kwargs.get("stop") or self.stop
        if stops:
            params["ls_stop"] = stops
        return params

    def load(self) -> PCDEngine:
        """The engine, loaded on first use (thread-safe)."""
        if self.engine is None:
            self.engine = self._slot.load(
                self.model, revision=self.revision, gguf_file=self.gguf_file, options=self.engine_kwargs
            )
        return self.engine

    # -- plain chat and structured calls -------------------------------------------------------

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if SCHEMA_KEY in kwargs:
            return ChatResult(generations=[ChatGeneration(message=self._structured(messages, kwargs))])
        options = self._call_options(stop, kwargs)
        result = self.load().generate(_chat_messages(messages), **options)
        message = AIMessage(
            content=result.text,
            usage_metadata=_usage(result.prompt_tokens, result.completion_tokens),
            response_metadata={"model_name": self.model, "finish_reason": result.finish_reason},
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        if SCHEMA_KEY in kwargs:  # the object is known only when it is complete: one chunk
            whole = self._structured(messages, kwargs)
            yield ChatGenerationChunk(message=AIMessageChunk(**_fields(whole), chunk_position="last"))
            return
        options = self._call_options(stop, kwargs)
        for piece in self.load().stream(_chat_messages(messages), **options):
            if piece.finish_reason is None:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece.text))
                if run_manager is not None:
                    run_manager.on_llm_new_token(piece.text, chunk=chunk)
                yield chunk
            else:
                yield ChatGenerationChunk(
                    message=AIMessageChunk(
                        content=piece.text,
                        usage_metadata=_usage(piece.prompt_tokens or 0, piece.completion_tokens or 0),
                        response_metadata={"model_name": self.model, "finish_reason": piece.finish_reason},
                        chunk_position="last",
                    )
                )

    def _call_options(self, stop: list[str] | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        unknown = set(kwargs) - SAMPLING_OPTIONS - {"max_tokens", "model"}
        if unknown:
            raise ValueError(f"ChatMiniCPM got unsupported call arguments: {sorted(unknown)}")
        if kwargs.get("model", self.model) != self.model:
            raise ValueError(
                f"this ChatMiniCPM serves {self.model!r}; it cannot switch to {kwargs['model']!r}"
            )
        return {
            "max_tokens": kwargs.get("max_tokens", self.max_tokens),
            "stop": stop if stop is not None else self.stop,
            "sampling": sampling_for(self, kwargs),
        }

    def _structured(self, messages: Sequence[BaseMessage], kwargs: Mapping[str, Any]) -> AIMessage:
        request = _Request(kwargs[SCHEMA_KEY], kwargs.get("pcd_method", "json_schema"))
        instructions, text = _request_text(messages)
        precomputed = _PRECOMPUTED.get()  # set only inside a structured batch
        found = precomputed.get(request.key(instructions, text)) if precomputed else None
        if found is None:
            found = self._classify([(instructions, text)], request)[0]
        return self._message(found)

    def _classify(
        self, items: Sequence[tuple[str | None, str]], request: _Request
    ) -> list[PCDResult[Any] | PCDError]:
        """Answer many (instructions, text) requests with one engine batch per distinct instructions."""
        engine = self.load()
        out: list[PCDResult[Any] | PCDError | None] = [None] * len(items)
        for instructions in dict.fromkeys(i for i, _ in items):
            indices = [n for n, (i, _) in enumerate(items) if i == instructions]
            results = engine.classify_batch(
                [items[n][1] for n in indices],
                request.schema,
                instructions=instructions,
                allow_generation=request.method != "pcd",
                sampling=sampling_for(self, {}),
                calibration=self.calibration,
                abstain_below=self.abstain_below,
                return_exceptions=True,
            )
            for n, result in zip(indices, results, strict=True):
                out[n] = result
        return [r for r in out if r is not None]

    def _message(self, result: PCDResult[Any] | PCDError) -> AIMessage:
        if isinstance(result, PCDError):  # a failed answer reaches the parser as a parsing error
            raw = getattr(result, "raw", "")
            return AIMessage(
                content=raw,
                response_metadata={
                    "model_name": self.model,
                    "finish_reason": "error",
                    "pcd_error": str(result),
                },
            )
        answer = result.to_json()  # the object's JSON value and every field's scores, built once
        d = result.diagnostics
        return AIMessage(
            content=json.dumps(answer["value"], ensure_ascii=False),
            usage_metadata=_usage(d.prompt_tokens, d.generated_tokens),
            response_metadata={
                "model_name": self.model,
                "finish_reason": "stop",
                "pcd": {
                    "fields": answer["fields"],
                    "forward_calls": d.forward_calls,
                    "cached_tokens": d.cached_tokens,
                    "attempts": d.attempts,
                    "abstained_fields": result.abstained_fields,
                    "needs_review": result.needs_review,
                },
            },
        )

    # -- structured output ---------------------------------------------------------------------

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["json_schema", "function_calling", "json_mode", "pcd"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """A runnable that answers with `schema` (Pydantic class -> instance; TypedDict or JSON-schema
        dict -> dict) through the PCD engine: closed fields scored, open fields generated. Every
        `method` LangChain passes is accepted and routed to the engine; `method="pcd"` refuses open
        fields (UnsupportedSchemaError before any model work). `include_raw=True` gives
        `{"raw", "parsed", "parsing_error"}`; the raw message's `response_metadata["pcd"]["fields"]`
        holds every field's probabilities."""
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        engine_schema = _engine_schema(schema)
        target = output_type(engine_schema)  # schema errors here, before any model work
        if method == "pcd":
            require_closed(target.model, self.engine.limits if self.engine else None)
        llm = self.bind(
            ls_structured_output_format={"kwargs": {"method": method, "strict": strict}, "schema": schema},
            **{SCHEMA_KEY: engine_schema, "pcd_method": method},
        )
        parser = RunnableLambda(lambda message: _parse(message, schema), name="PCDOutputParser")
        if include_raw:
            parsed = RunnablePassthrough.assign(
                parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
            )
            fallback = RunnablePassthrough.assign(parsed=lambda _: None)
            chain: Runnable = RunnableMap(raw=llm) | parsed.with_fallbacks(
                [fallback], exception_key="parsing_error"
            )
        else:
            chain = llm | parser
        return _BatchedStructuredOutput(bound=chain, chat_model=self, request=_Request(engine_schema, method))


class _Request:
    """What a structured call asks: the schema given to the engine and the method."""

    def __init__(self, schema: Any, method: str) -> None:
        self.schema = schema
        self.method = method

    def key(self, instructions: str | None, text: str) -> tuple[Any, ...]:
        schema = json.dumps(self.schema, sort_keys=True) if isinstance(self.schema, dict) else self.schema
        return (schema, self.method, instructions, text)


class _BatchedStructuredOutput(RunnableBinding):  # type: ignore[type-arg]
    """The structured runnable: behaves as its chain, but `batch` / `abatch` answer every input with
    one engine batch first; the chain's per-input path then picks up the precomputed answers."""

    chat_model: ChatMiniCPM
    request: Any

    def batch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        token = _PRECOMPUTED.set(self._precompute(inputs))
        try:
            return self.bound.batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        finally:
            _PRECOMPUTED.reset(token)

    async def abatch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        answers = await asyncio.get_running_loop().run_in_executor(None, self._precompute, inputs)
        token = _PRECOMPUTED.set(answers)
        try:
            return await self.bound.abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        finally:
            _PRECOMPUTED.reset(token)

    def _precompute(self, inputs: Sequence[Any]) -> dict[Any, PCDResult[Any] | PCDError]:
        items = []
        for value in inputs:
            try:
                items.append(_request_text(_input_messages(value)))
            except (ValueError, TypeError):  # left to the per-input path, which raises it in place
                continue
        results = self.chat_model._classify(items, self.request) if items else []
        return {self.request.key(*item): result for item, result in zip(items, results, strict=True)}


def _input_messages(value: LanguageModelInput) -> list[BaseMessage]:
    """The messages of a chat model's input (a prompt value, a string, or a list of messages)."""
    if isinstance(value, PromptValue):
        return value.to_messages()
    if isinstance(value, str):
        return [HumanMessage(content=value)]
    if isinstance(value, Sequence):
        return convert_to_messages(value)
    raise ValueError(
        f"Invalid input type {type(value)}. Must be a PromptValue, str, or list of BaseMessages."
    )


def _engine_schema(schema: Any) -> Any:
    """What the engine gets: Pydantic v2 classes, TypedDicts and dicts as they are; pydantic.v1
    classes as their JSON schema."""
    if isinstance(schema, type) and is_basemodel_subclass(schema) and not issubclass(schema, BaseModel):
        return convert_to_json_schema(schema)
    return schema


def _parse(message: BaseMessage, schema: Any) -> Any:
    error = message.response_metadata.get("pcd_error")
    if error:
        raise OutputParserException(error, llm_output=str(message.content))
    text = str(message.content)
    try:
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            return schema.model_validate_json(text)
        if isinstance(schema, type) and is_basemodel_subclass(schema):  # pydantic.v1
            return schema.parse_raw(text)  # type: ignore[attr-defined]
        return json.loads(text)
    except Exception as parse_error:
        raise OutputParserException(str(parse_error), llm_output=text) from parse_error


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatMiniCPM takes text only; got a {kind!r} content block")
    return "".join(parts)


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    if isinstance(message, ToolMessage):
        return "tool"
    return _ROLES.get(message.type, "user")


def _chat_messages(messages: Sequence[BaseMessage]) -> list[tuple[str, str]]:
    return [(_role(m), _text(m)) for m in messages]


def _request_text(messages: Sequence[BaseMessage]) -> tuple[str | None, str]:
    return structured_request(_chat_messages(messages))


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=prompt_tokens,
        output_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _fields(message: AIMessage) -> dict[str, Any]:
    return {
        "content": message.content,
        "usage_metadata": message.usage_metadata,
        "response_metadata": message.response_metadata,
    }


__all__ = ["ChatMiniCPM"]
