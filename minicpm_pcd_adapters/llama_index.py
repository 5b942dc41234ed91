"""LlamaIndex: `MiniCPMLLM` (a FunctionCallingLLM) and `MiniCPMPCDProgram` (a Pydantic program) on the
PCD engine.

Chat and completion calls use `PCDEngine.generate` / `stream`. Function calling (`chat_with_tools` and
its async and streaming forms, `predict_and_call`, `FunctionCallingProgram`, `FunctionAgent`) runs
`engine.tools.call`: the tool, or a text answer, scored with the candidate tools' closed arguments
(llama_index_tools.py). A prompt that ends with a PydanticOutputParser's schema
(`LLMTextCompletionProgram`) is answered by `engine.classify` on that schema. Every structured path of
LlamaIndex
(`llm.structured_predict`, `astructured_predict`, `stream_structured_predict`, `as_structured_llm`,
response synthesizers with `output_cls`, programs) reaches `MiniCPMPCDProgram`, which formats the
prompt with LlamaIndex's own templates and answers with `engine.classify`: closed fields scored, open
fields generated. The program keeps the last `PCDResult` (`last_result`) for per-field probabilities.

    >>> llm = MiniCPMLLM()  # MiniCPM5-2B at the pinned revision, loaded on first use  # doctest: +SKIP
    >>> llm.structured_predict(Ticket, PromptTemplate("{text}"), text="charged twice")  # doctest: +SKIP
    Ticket(topic='billing', ...)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import (
    achat_to_completion_decorator,
    astream_chat_to_completion_decorator,
    chat_to_completion_decorator,
    stream_chat_to_completion_decorator,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import LLM
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
from llama_index.core.settings import Settings
from llama_index.core.tools import ToolSelection
from llama_index.core.types import BasePydanticProgram, Model

from minicpm_pcd_adapters.llama_index_tools import (
    engine_messages,
    engine_tools,
    parser_schema,
    tool_response,
    tool_selections,
)
from minicpm_pcd_adapters.messages import decide_tools, sampling_for, structured_request
from minicpm_pcd_adapters.minicpm import MINICPM5_2B, EngineSlot
from pcd_engine import Calibration, PCDEngine, PCDResult, Sampling, require_closed

dispatcher = get_dispatcher(__name__)


class MiniCPMLLM(FunctionCallingLLM):
    """A local chat LLM (MiniCPM5-2B by default) whose structured output and tool calls run the PCD
    engine.

    `model` is a hub id (pinned `revision`), a local folder or a GGUF file (`gguf_file`); or pass
    `engine`, an already loaded `PCDEngine`. Decoding is greedy unless `temperature` > 0. One tool
    call per turn: the engine decides one tool, whatever `allow_parallel_tool_calls` says.
    """

    model: str = Field(default=MINICPM5_2B.hub_id, description="Hub id, local folder or model name.")
    revision: str | None = Field(default=None)
    gguf_file: str | None = Field(default=None)
    engine: PCDEngine | None = Field(default=None, exclude=True)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    context_window: int = Field(default=4096, description="Prompt tokens the engine accepts.")
    max_tokens: int = Field(default=512, description="Tokens generated per chat/completion call.")
    temperature: float = Field(default=0.0)
    top_p: float = Field(default=1.0)
    min_p: float = Field(default=0.0)
    repetition_penalty: float = Field(default=1.0)
    seed: int | None = Field(default=None, description="Seed for sampled decoding (temperature > 0).")
    calibration: Calibration | None = Field(
        default=None, exclude=True, description="Calibration (engine.calibrate) for structured answers."
    )
    abstain_below: float | None = Field(
        default=None, description="Structured fields below this confidence are marked abstained."
    )
    tool_calibration: Calibration | None = Field(
        default=None, exclude=True, description="Calibration (engine.tools.calibrate) of tool decisions."
    )

    _slot: EngineSlot = PrivateAttr(default_factory=EngineSlot)

    @classmethod
    def class_name(cls) -> str:
        return "MiniCPMLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window,
            num_output=self.max_tokens,
            model_name=self.model,
            is_chat_model=True,
            is_function_calling_model=True,
        )

    def load(self) -> PCDEngine:
        """The engine, loaded on first use (thread-safe)."""
        if self.engine is None:
            self.engine = self._slot.load(
                self.model, revision=self.revision, gguf_file=self.gguf_file, options=self.engine_kwargs
            )
        return self.engine

    def sampling(self, **overrides: Any) -> Sampling:
        return sampling_for(self, overrides)

    # -- chat and completion -----------------------------------------------------------------

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {
            "max_tokens": kwargs.get("max_tokens", self.max_tokens),
            "stop": kwargs.get("stop"),
            "sampling": self.sampling(**kwargs),
        }

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        if kwargs.get("tools"):
            return self._tool_call(messages, kwargs)
        found = parser_schema(messages)
        if found is not None:  # LLMTextCompletionProgram: the parser's schema, answered by the engine
            asked, schema = found
            instructions, text = structured_request(_pairs(asked))
            answer = self.load().classify(text, schema, instructions=instructions, **self._structured(kwargs))
            content = json.dumps(answer.value, ensure_ascii=False)
            return ChatResponse(
                message=ChatMessage(role=MessageRole.ASSISTANT, content=content),
                raw={"pcd": answer.to_json()},
                additional_kwargs={"pcd": answer.to_json()},
            )
        result = self.load().generate(_pairs(messages), **self._options(kwargs))
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text),
            raw={"finish_reason": result.finish_reason},
            additional_kwargs=_usage(result.prompt_tokens, result.completion_tokens),
        )

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        if kwargs.get("tools"):  # a decision is known whole: one response
            whole = self._tool_call(messages, kwargs)
            whole.delta = whole.message.content or ""
            return (response for response in [whole])
        pieces = self.load().stream(_pairs(messages), **self._options(kwargs))

        def gen() -> ChatResponseGen:
            text = ""
            for piece in pieces:
                text += piece.text
                extra = (
                    {}
                    if piece.finish_reason is None
                    else _usage(piece.prompt_tokens, piece.completion_tokens)
                )
                yield ChatResponse(
                    message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                    delta=piece.text,
                    additional_kwargs=extra,
                )

        return gen()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return chat_to_completion_decorator(self.chat)(prompt, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return stream_chat_to_completion_decorator(self.stream_chat)(prompt, **kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self.chat, messages, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await achat_to_completion_decorator(self.achat)(prompt, **kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return _in_thread(self.stream_chat(messages, **kwargs))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return await astream_chat_to_completion_decorator(self.astream_chat)(prompt, **kwargs)

    # -- function calling --------------------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The chat call of `chat_with_tools`: the history, the user's message, the tools and the
        choice ("required" when `tool_required`)."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(
                ChatMessage(role=MessageRole.USER, content=user_msg)
                if isinstance(user_msg, str)
                else user_msg
            )
        choice = "required" if tool_required and tool_choice is None else tool_choice
        return {"messages": messages, "tools": list(tools), "tool_choice": choice, **kwargs}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        calls = tool_selections(response)
        if not calls and error_on_no_tool_call:
            raise ValueError(f"Expected at least one tool call, but got {len(calls)} tool calls.")
        return calls

    def _tool_call(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        options = self._options({k: v for k, v in kwargs.items() if k not in ("tools", "tool_choice")})
        tools = engine_tools(kwargs["tools"])
        result = decide_tools(self, engine_messages(messages), tools, kwargs.get("tool_choice"), options)
        return tool_response(result)

    def _structured(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {
            "sampling": self.sampling(**kwargs),
            "calibration": self.calibration,
            "abstain_below": self.abstain_below,
        }

    # -- structured output: every path goes through MiniCPMPCDProgram ------------------------

    @dispatcher.span
    def structured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        program = self._predict_program(output_cls, prompt, prompt_args)
        return _predicted(program(llm_kwargs=llm_kwargs, **prompt_args))

    @dispatcher.span
    async def astructured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        program = self._predict_program(output_cls, prompt, prompt_args)
        return _predicted(await program.acall(llm_kwargs=llm_kwargs, **prompt_args))

    def _predict_program(
        self, output_cls: type[Model], prompt: PromptTemplate, prompt_args: dict[str, Any]
    ) -> MiniCPMPCDProgram[Model]:
        """The program answering a structured-predict call, once its start event is sent."""
        dispatcher.event(
            LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
        )
        return MiniCPMPCDProgram(output_cls, prompt, self)

    def _structured_stream_call(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Generator[Model, None, None]:
        return MiniCPMPCDProgram(output_cls, prompt, self).stream_call(llm_kwargs=llm_kwargs, **prompt_args)

    async def _structured_astream_call(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> AsyncGenerator[Model, None]:
        program = MiniCPMPCDProgram(output_cls, prompt, self)
        return await program.astream_call(llm_kwargs=llm_kwargs, **prompt_args)


class MiniCPMPCDProgram(BasePydanticProgram[Model]):
    """A Pydantic program answered by the PCD engine: closed fields scored, open fields generated.

    `program(**prompt_args)` returns the validated object; `program.classify(**prompt_args)` the whole
    `PCDResult` (per-field probabilities, diagnostics); `last_result` keeps the latest one.
    `allow_generation=False` refuses open fields (UnsupportedSchemaError before any model work).
    """

    def __init__(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm: MiniCPMLLM,
        allow_generation: bool | None = None,
        verbose: bool = False,
    ) -> None:
        if not isinstance(llm, MiniCPMLLM):
            raise TypeError(f"MiniCPMPCDProgram needs a MiniCPMLLM, got {type(llm).__name__}")
        if allow_generation is False:  # refuse open fields now, before any model work
            require_closed(output_cls, llm.engine.limits if llm.engine is not None else None)
        self._output_cls = output_cls
        self._prompt = prompt
        self._llm = llm
        self._allow_generation = allow_generation
        self._verbose = verbose
        self.last_result: PCDResult[Model] | None = None

    @classmethod
    def from_defaults(
        cls,
        output_cls: type[Model],
        prompt_template_str: str | None = None,
        prompt: BasePromptTemplate | None = None,
        llm: LLM | None = None,
        allow_generation: bool | None = None,
        verbose: bool = False,
        **kwargs: Any,
    ) -> MiniCPMPCDProgram[Model]:
        if (prompt is None) == (prompt_template_str is None):
            raise ValueError("Must provide either prompt or prompt_template_str.")
        configured = Settings._llm  # not Settings.llm: that would build LlamaIndex's OpenAI default
        chosen = llm or (configured if isinstance(configured, MiniCPMLLM) else MiniCPMLLM())
        template = prompt if prompt is not None else PromptTemplate(str(prompt_template_str))
        return cls(output_cls, template, chosen, allow_generation, verbose)  # type: ignore[arg-type]

    @property
    def output_cls(self) -> type[Model]:
        return self._output_cls

    @property
    def prompt(self) -> BasePromptTemplate:
        return self._prompt

    @prompt.setter
    def prompt(self, prompt: BasePromptTemplate) -> None:
        self._prompt = prompt

    def classify(self, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> PCDResult[Model]:
        """Format the prompt with LlamaIndex's template and answer it; the whole PCDResult."""
        messages = self._llm._extend_messages(self._prompt.format_messages(llm=self._llm, **prompt_args))
        instructions, text = structured_request(_pairs(messages))
        result = self._llm.load().classify(
            text,
            self._output_cls,
            instructions=instructions,
            allow_generation=self._allow_generation,
            **self._llm._structured(llm_kwargs or {}),
        )
        self.last_result = result
        if self._verbose:
            print(f"> PCD answer: {result.to_json()}")
        return result

    @dispatcher.span
    def __call__(self, llm_kwargs: dict[str, Any] | None = None, *args: Any, **kwargs: Any) -> Model:
        return self.classify(llm_kwargs, **kwargs).value

    @dispatcher.span
    async def acall(self, llm_kwargs: dict[str, Any] | None = None, *args: Any, **kwargs: Any) -> Model:
        return (await asyncio.to_thread(self.classify, llm_kwargs, **kwargs)).value

    def stream_call(
        self, llm_kwargs: dict[str, Any] | None = None, *args: Any, **kwargs: Any
    ) -> Generator[Model, None, None]:
        """Yields the final object (an object exists only once every field is decided)."""
        yield self(llm_kwargs, **kwargs)

    async def astream_call(
        self, llm_kwargs: dict[str, Any] | None = None, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Model, None]:
        async def gen() -> AsyncGenerator[Model, None]:
            yield await self.acall(llm_kwargs, **kwargs)

        return gen()


def _predicted(value: Model) -> Model:
    """A structured-predict call's answer, once its end event is sent."""
    dispatcher.event(LLMStructuredPredictEndEvent(output=value))
    return value


def _pairs(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    out = []
    for message in messages:
        role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
        role = {"chatbot": "assistant", "model": "assistant", "developer": "system"}.get(role, role)
        out.append((role, message.content or ""))
    return out


def _usage(prompt_tokens: int | None, completion_tokens: int | None) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}


def _in_thread(items: Generator[Any, None, None]) -> AsyncGenerator[Any, None]:
    """An async generator over a blocking generator, each step run in a worker thread."""

    async def gen() -> AsyncGenerator[Any, None]:
        done = object()
        while True:
            item = await asyncio.to_thread(next, items, done)
            if item is done:
                return
            yield item

    return gen()


__all__ = ["MiniCPMLLM", "MiniCPMPCDProgram"]
