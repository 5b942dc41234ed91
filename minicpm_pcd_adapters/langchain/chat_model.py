"""LangChain: `ChatMiniCPM`, a chat model whose `with_structured_output(Schema)` runs the PCD engine.

Plain chat (`invoke`, `stream`, `batch` and async forms) uses `PCDEngine.generate` / `stream`.
`bind_tools` makes every call a tool decision (`engine.tools.call`, tools.py): the tool, or a
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
from pydantic import BaseModel, ConfigDict, Field

from minicpm_pcd_adapters.langchain.messages import conversation_of
from minicpm_pcd_adapters.langchain.structured import (
    PRECOMPUTED,
    SCHEMA_KEY,
    BatchedStructuredOutput,
    StructuredRequest,
    engine_schema,
    parsed_chain,
)
from minicpm_pcd_adapters.langchain.tools import (
    engine_tools,
    response_schema,
    tool_call_chunks,
    tool_message,
)
from minicpm_pcd_adapters.local_engine import SAMPLING_OPTIONS, LocalEngine
from minicpm_pcd_adapters.minicpm import MINICPM5_2B
from pcd_engine import Conversation, PCDError, PCDResult, output_type, require_closed

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


class ChatMiniCPM(LocalEngine, BaseChatModel):
    """A local chat model (MiniCPM5-2B by default) with PCD structured output.

    Configured as every adapter is (`LocalEngine`: `model`, `revision`, `gguf_file` or a loaded
    `engine`, decoding defaults, `calibration`, `tool_calibration`, `abstain_below`); MiniCPM5
    recommends temperature 1.0, top_p 0.95, min_p 0.0 for sampled chat. With `abstain_below`, the
    message's `response_metadata["pcd"]` says which fields abstained (`abstained_fields`,
    `needs_review`).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    model: str = Field(default=MINICPM5_2B.hub_id, alias="model_name")
    stop: list[str] | None = Field(default=None, alias="stop_sequences")

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
        conversation = conversation_of(messages)
        listed = [t.openai() for t in engine_tools(tools)] if tools else ()
        return len(self.load().prompt.render_conversation(conversation.system, conversation, listed))

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
        result = self.load().generate(conversation_of(messages), **options)
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
        for piece in self.load().stream(conversation_of(messages), **options):
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
            "sampling": self.sampling(kwargs),
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
        conversation = conversation_of(messages)
        if kwargs.get("tools"):
            tools, choice = engine_tools(kwargs["tools"]), kwargs.get("tool_choice")
            result = self.decide_tools(
                conversation, tools, choice, options["max_tokens"], options["sampling"]
            )
            if result.tool is not None or answer_format is None:
                return tool_message(result, self.model)
        if schema is not None:  # the text answer is the object
            return self._structured(messages, {SCHEMA_KEY: schema})
        generation = self.load().generate(conversation, json_object=True, **options)
        return AIMessage(  # {"type": "json_object"}: any JSON object
            content=generation.text,
            usage_metadata=_usage(generation.prompt_tokens, generation.completion_tokens),
            response_metadata={"model_name": self.model, "finish_reason": generation.finish_reason},
        )

    def _structured(self, messages: Sequence[BaseMessage], kwargs: Mapping[str, Any]) -> AIMessage:
        request = StructuredRequest(kwargs[SCHEMA_KEY], kwargs.get("pcd_method", "json_schema"))
        conversation = conversation_of(messages)
        precomputed = PRECOMPUTED.get()  # set only inside a structured batch
        found = precomputed.get(request.key(conversation)) if precomputed else None
        if found is None:
            found = self._classify([conversation], request)[0]
        return self._message(found)

    def _classify(
        self, items: Sequence[Conversation], request: StructuredRequest
    ) -> list[PCDResult[Any] | PCDError]:
        """Answer many conversations with one engine batch (one plan per system text)."""
        return self.load().classify_batch(
            items,
            request.schema,
            allow_generation=request.method != "pcd",
            return_exceptions=True,
            **self.structured_options(),
        )

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
            additional_kwargs={"parsed": result.value},  # the validated value: no second parse
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


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=prompt_tokens,
        output_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


__all__ = ["ChatMiniCPM"]
