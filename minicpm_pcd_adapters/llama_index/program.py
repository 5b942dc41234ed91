"""LlamaIndex's Pydantic program on the engine: `MiniCPMPCDProgram` formats the prompt with
LlamaIndex's own templates and answers it with `engine.classify` (closed fields scored, open fields
generated); `last_result` keeps the latest `PCDResult` for per-field probabilities. Every structured
path of `MiniCPMLLM` (`structured_predict` and its async and streaming forms, `as_structured_llm`,
synthesizers with `output_cls`) reaches it.

    >>> program = MiniCPMPCDProgram.from_defaults(Ticket, "{text}", llm=llm)  # doctest: +SKIP
    >>> program(text="charged twice")  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Generator
from typing import Any, ClassVar

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.llm import LLMStructuredPredictEndEvent
from llama_index.core.llms.llm import LLM
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
from llama_index.core.settings import Settings
from llama_index.core.types import BasePydanticProgram, Model

from minicpm_pcd_adapters.llama_index.messages import conversation_of
from minicpm_pcd_adapters.local_engine import LocalEngine
from pcd_engine import PCDResult, require_closed

dispatcher = get_dispatcher("minicpm_pcd_adapters.llama_index")


class MiniCPMPCDProgram(BasePydanticProgram[Model]):
    """A Pydantic program answered by the PCD engine: closed fields scored, open fields generated.

    `program(**prompt_args)` returns the validated object; `program.classify(**prompt_args)` the whole
    `PCDResult` (per-field probabilities, diagnostics); `last_result` keeps the latest one.
    `allow_generation=False` refuses open fields (UnsupportedSchemaError before any model work).
    """

    # what `from_defaults` builds without an LLM: MiniCPMLLM (llm.py sets it; it imports this module)
    default_llm: ClassVar[Callable[[], Any]]

    def __init__(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm: Any,
        allow_generation: bool | None = None,
        verbose: bool = False,
    ) -> None:
        if not (isinstance(llm, LocalEngine) and isinstance(llm, LLM)):
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
        if llm is None and not isinstance(configured, LocalEngine):
            configured = cls.default_llm()
        chosen = llm or configured
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
        result = self._llm.load().classify(
            conversation_of(messages),
            self._output_cls,
            allow_generation=self._allow_generation,
            **self._llm.structured_options(llm_kwargs),
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


def predicted(value: Model) -> Model:
    """A structured-predict call's answer, once its end event is sent."""
    dispatcher.event(LLMStructuredPredictEndEvent(output=value))
    return value


__all__ = ["MiniCPMPCDProgram"]
