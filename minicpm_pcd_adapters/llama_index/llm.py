"""LlamaIndex: `MiniCPMLLM`, a FunctionCallingLLM on the PCD engine.

Chat and completion calls use `PCDEngine.generate` / `stream`. Function calling (`chat_with_tools` and
its async and streaming forms, `predict_and_call`, `FunctionCallingProgram`, `FunctionAgent`) runs
`engine.tools.call`: the tool, or a text answer, scored with the candidate tools' closed arguments
(tools.py). A prompt that ends with a PydanticOutputParser's schema
(`LLMTextCompletionProgram`) is answered by `engine.classify` on that schema. Every structured path of
LlamaIndex
(`llm.structured_predict`, `astructured_predict`, `stream_structured_predict`, `as_structured_llm`,
response synthesizers with `output_cls`, programs) reaches `MiniCPMPCDProgram`, which formats the
prompt with LlamaIndex's own templates and answers with `engine.classify`: closed fields scored, open
fields generated (program.py). Messages become the engine's conversation in messages.py.

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
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import ToolSelection
from llama_index.core.types import Model

from minicpm_pcd_adapters.llama_index.messages import conversation_of
from minicpm_pcd_adapters.llama_index.program import MiniCPMPCDProgram, dispatcher, predicted
from minicpm_pcd_adapters.llama_index.tools import (
    engine_tools,
    parser_schema,
    tool_response,
    tool_selections,
)
from minicpm_pcd_adapters.local_engine import LocalEngine


class MiniCPMLLM(LocalEngine, FunctionCallingLLM):
    """A local chat LLM (MiniCPM5-2B by default) whose structured output and tool calls run the PCD
    engine, configured as every adapter is (`LocalEngine`). One tool call per turn: the engine
    decides one tool, whatever `allow_parallel_tool_calls` says.
    """

    context_window: int = Field(default=4096, description="Prompt tokens the engine accepts.")

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

    # -- chat and completion -----------------------------------------------------------------

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {
            "max_tokens": kwargs.get("max_tokens", self.max_tokens),
            "stop": kwargs.get("stop"),
            "sampling": self.sampling(kwargs),
        }

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        if kwargs.get("tools"):
            return self._tool_call(messages, kwargs)
        found = parser_schema(messages)
        if found is not None:  # LLMTextCompletionProgram: the parser's schema, answered by the engine
            asked, schema = found
            answer = self.load().classify(conversation_of(asked), schema, **self.structured_options(kwargs))
            content = json.dumps(answer.value, ensure_ascii=False)
            return ChatResponse(
                message=ChatMessage(role=MessageRole.ASSISTANT, content=content),
                raw={"pcd": answer.to_json()},
                additional_kwargs={"pcd": answer.to_json()},
            )
        result = self.load().generate(conversation_of(messages), **self._options(kwargs))
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
        pieces = self.load().stream(conversation_of(messages), **self._options(kwargs))

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
        tools, choice = engine_tools(kwargs["tools"]), kwargs.get("tool_choice")
        conversation = conversation_of(messages)
        tokens, sampling = options["max_tokens"], options["sampling"]
        result = self.decide_tools(conversation, tools, choice, tokens, sampling)
        return tool_response(result)

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
        return predicted(program(llm_kwargs=llm_kwargs, **prompt_args))

    @dispatcher.span
    async def astructured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        program = self._predict_program(output_cls, prompt, prompt_args)
        return predicted(await program.acall(llm_kwargs=llm_kwargs, **prompt_args))

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


MiniCPMPCDProgram.default_llm = MiniCPMLLM

__all__ = ["MiniCPMLLM"]
