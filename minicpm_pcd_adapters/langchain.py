"""LangChain: `ChatMiniCPM`, a chat model whose `with_structured_output(Schema)` runs the PCD engine.

Plain chat (`invoke`, `stream`, `batch` and async forms) uses `PCDEngine.generate` / `stream`.
`bind_tools` makes every call a tool decision (`engine.tools.call`, langchain_tools.py): the tool, or a
text answer, scored with the candidate tools' closed arguments, so `create_agent` runs on the engine. A
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

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput, ModelProfile
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    UsageMetadata,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import (
    Runnable,
)
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from minicpm_pcd_adapters.langchain_structured import (
    PRECOMPUTED,
    SCHEMA_KEY,
    BatchedStructuredOutput,
    StructuredRequest,
    engine_schema,
    parsed_chain,
    request_text,
)
from minicpm_pcd_adapters.langchain_tools import (
    engine_messages,
    engine_tools,
    message_role,
    message_text,
    response_schema,
    tool_call_chunks,
    tool_message,
)
from minicpm_pcd_adapters.messages import SAMPLING_OPTIONS, decide_tools, sampling_for
from minicpm_pcd_adapters.minicpm import MINICPM5_2B, EngineSlot
from pcd_engine import Calibration, PCDEngine, PCDError, PCDResult, output_type, require_closed

METHODS = ("json_schema", "function_calling", "json_mode", "pcd")
TOOL_OPTIONS = frozenset(  # what bind_tools, create_agent and with_structured_output bind
    {
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "strict",
        "ls_structured_output_format",
    }
)


class ChatMiniCPM(BaseChatModel):
    """A local chat model (MiniCPM5-2B by default) with PCD structured output.

    `model` is a hub id (pinned `revision`), a local folder or a GGUF file (`gguf_file`); or pass
    `engine`, an already loaded `PCDEngine`, so that several chat models share one model. Decoding is
    greedy unless `temperature` > 0 (MiniCPM5 recommends temperature 1.0, top_p 0.95, min_p 0.0 for
    sampled chat). `calibration` (from `engine.calibrate`, fitted with the same schema and system
    message) and `abstain_below` apply to structured answers; the message's `response_metadata["pcd"]`
    then says which fields abstained (`abstained_fields`, `needs_review`). `tool_calibration` (fitted
    on `engine.tools.schema(tools, tool_choice)`) and `abstain_below` apply to tool decisions.
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
    tool_calibration: Calibration | None = Field(default=None, exclude=True)  # for bound tools

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

    def _resolve_model_profile(self) -> ModelProfile | None:
        """What `create_agent` reads to pick its structured-output strategy."""
        return ModelProfile(
            max_input_tokens=self.engine.limits.max_prompt_tokens if self.engine else 4096,
            max_output_tokens=self.max_tokens,
            text_inputs=True,
            image_inputs=False,
            audio_inputs=False,
            pdf_inputs=False,
            video_inputs=False,
            text_outputs=True,
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=False,  # a call arrives whole, in one chunk
            structured_output=True,
        )

    def get_token_ids(self, text: str) -> list[int]:
        """The model's own tokenizer (text encoded as data, no special tokens), no network."""
        return list(self.load().prompt.encode_text(text))

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[Any] | None = None
    ) -> int:
        """The prompt tokens of these messages as the chat template renders them (and the tools,
        where the template has a tool protocol)."""
        rendered = [d["content"] for d in engine_messages(messages)]
        pairs = [(message_role(m), text) for m, text in zip(messages, rendered, strict=True)]
        listed = [t.openai() for t in engine_tools(tools)] if tools else ()
        return len(self.load().prompt.render_messages(pairs, tools=listed))

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Any],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (BaseTool, functions, Pydantic classes, TypedDicts, OpenAI dicts): each call is
        then a tool decision scored by the engine, its probabilities in `response_metadata["pcd"]`.
        `tool_choice`: None/"auto" (a tool or a text answer), "any"/"required"/True, "none", a
        tool's name or `{"type": "function", "function": {"name": ...}}`. One call per turn: the
        engine decides one tool, so `parallel_tool_calls` is accepted and never gives more. A
        `response_format` bound here (create_agent's ProviderStrategy) is answered as JSON content
        by the engine when the decision is a text answer."""
        for each in tools:  # a bad tool fails here; names are checked unique when a call is made
            engine_tools([each])
        bound: dict[str, Any] = {"tools": tuple(tools), "tool_choice": tool_choice, **kwargs}
        if parallel_tool_calls is not None:
            bound["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(**bound)

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
        if _is_bound(kwargs):
            return ChatResult(generations=[ChatGeneration(message=self._bound(messages, stop, kwargs))])
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
        if _is_bound(kwargs):  # a call or an object is known when complete: one chunk
            whole = self._bound(messages, stop, kwargs)
            last = AIMessageChunk(
                content=whole.content,
                usage_metadata=whole.usage_metadata,
                response_metadata=whole.response_metadata,
                tool_call_chunks=tool_call_chunks(whole),
                chunk_position="last",
            )
            yield ChatGenerationChunk(message=last)
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
        """max_tokens, stop and sampling of a call; the tool options of an empty binding (no
        tools, no answer format) are dropped."""
        kwargs = {k: v for k, v in kwargs.items() if k not in TOOL_OPTIONS}
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

    def _bound(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: Mapping[str, Any]
    ) -> AIMessage:
        """A call with bound tools or a bound answer format: a tool decision, a structured answer
        (`with_structured_output`, or a `response_format`), or a JSON object."""
        if SCHEMA_KEY in kwargs:
            return self._structured(messages, kwargs)
        options = self._call_options(stop, kwargs)
        answer_format = kwargs.get("response_format")
        schema = response_schema(answer_format) if answer_format is not None else None
        if kwargs.get("tools"):
            tools = engine_tools(kwargs["tools"])
            result = decide_tools(self, engine_messages(messages), tools, kwargs.get("tool_choice"), options)
            if result.tool is not None or answer_format is None:
                return tool_message(result, self.model)
        if schema is not None:  # the text answer is the object
            return self._structured(messages, {SCHEMA_KEY: schema})
        generation = self.load().generate(_chat_messages(messages), json_object=True, **options)
        return AIMessage(  # {"type": "json_object"}: any JSON object
            content=generation.text,
            usage_metadata=_usage(generation.prompt_tokens, generation.completion_tokens),
            response_metadata={"model_name": self.model, "finish_reason": generation.finish_reason},
        )

    def _structured(self, messages: Sequence[BaseMessage], kwargs: Mapping[str, Any]) -> AIMessage:
        request = StructuredRequest(kwargs[SCHEMA_KEY], kwargs.get("pcd_method", "json_schema"))
        instructions, text = request_text(messages)
        precomputed = PRECOMPUTED.get()  # set only inside a structured batch
        found = precomputed.get(request.key(instructions, text)) if precomputed else None
        if found is None:
            found = self._classify([(instructions, text)], request)[0]
        return self._message(found)

    def _classify(
        self, items: Sequence[tuple[str | None, str]], request: StructuredRequest
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
        target = engine_schema(schema)
        checked = output_type(target)  # schema errors here, before any model work
        if method == "pcd":
            require_closed(checked.model, self.engine.limits if self.engine else None)
        llm = self.bind(
            ls_structured_output_format={"kwargs": {"method": method, "strict": strict}, "schema": schema},
            **{SCHEMA_KEY: target, "pcd_method": method},
        )
        chain = parsed_chain(llm, schema, include_raw)
        return BatchedStructuredOutput(
            bound=chain, chat_model=self, request=StructuredRequest(target, method)
        )


def _is_bound(kwargs: Mapping[str, Any]) -> bool:
    """Whether a call has tools, an answer format or a structured schema bound to it."""
    return bool(kwargs.get("tools")) or kwargs.get("response_format") is not None or SCHEMA_KEY in kwargs


def _chat_messages(messages: Sequence[BaseMessage]) -> list[tuple[str, str]]:
    return [(message_role(m), message_text(m)) for m in messages]


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=prompt_tokens,
        output_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


__all__ = ["ChatMiniCPM"]
