"""LangChain structured output on the engine: the runnable `ChatMiniCPM.with_structured_output` returns.

The chat model is bound to the schema (`SCHEMA_KEY`), so callbacks and tracing see it once per call;
a parser turns the answer's JSON into the instance (Pydantic, including pydantic.v1) or dict.
`BatchedStructuredOutput.batch` / `abatch` answer every input with one `engine.classify_batch` first,
then run LangChain's usual per-input path (callbacks, order, `return_exceptions`) on the precomputed
answers, found through `PRECOMPUTED`.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.messages import BaseMessage
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
from pydantic import BaseModel

from minicpm_pcd_adapters.langchain.messages import input_conversation
from pcd_engine import Conversation, PCDError, PCDResult

SCHEMA_KEY = "pcd_schema"  # bound kwargs of a structured call
PRECOMPUTED: contextvars.ContextVar[dict[Any, PCDResult[Any] | PCDError] | None] = contextvars.ContextVar(
    "pcd_precomputed", default=None
)


class StructuredRequest:
    """What a structured call asks: the schema given to the engine and the method."""

    def __init__(self, schema: Any, method: str) -> None:
        self.schema = schema
        self.method = method

    def key(self, conversation: Conversation) -> tuple[Any, ...]:
        schema = json.dumps(self.schema, sort_keys=True) if isinstance(self.schema, dict) else self.schema
        return (schema, self.method, conversation.key)


class BatchedStructuredOutput(RunnableBinding):  # type: ignore[type-arg]
    """The structured runnable: behaves as its chain, but `batch` / `abatch` answer every input with
    one engine batch first; the chain's per-input path then picks up the precomputed answers."""

    chat_model: Any  # the ChatMiniCPM whose `_classify` answers a batch
    request: Any

    def batch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        token = PRECOMPUTED.set(self._precompute(inputs))
        try:
            return self.bound.batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        finally:
            PRECOMPUTED.reset(token)

    async def abatch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        answers = await asyncio.get_running_loop().run_in_executor(None, self._precompute, inputs)
        token = PRECOMPUTED.set(answers)
        try:
            return await self.bound.abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        finally:
            PRECOMPUTED.reset(token)

    def _precompute(self, inputs: Sequence[Any]) -> dict[Any, PCDResult[Any] | PCDError]:
        items = []
        for value in inputs:
            try:
                items.append(input_conversation(value))
            except (ValueError, TypeError):  # left to the per-input path, which raises it in place
                continue
        results = self.chat_model._classify(items, self.request) if items else []
        return {self.request.key(item): result for item, result in zip(items, results, strict=True)}


def engine_schema(schema: Any) -> Any:
    """What the engine gets: Pydantic v2 classes, TypedDicts and dicts as they are; pydantic.v1
    classes as their JSON schema."""
    if isinstance(schema, type) and is_basemodel_subclass(schema) and not issubclass(schema, BaseModel):
        return convert_to_json_schema(schema)
    return schema


def parse_structured(message: BaseMessage, schema: Any) -> Any:
    """The answer as the schema's instance (or dict): the engine's own validated value where the
    message carries it (`additional_kwargs["parsed"]`, as langchain-openai does), so that aliases
    and serialization aliases need no second parse; else the content's JSON."""
    error = message.response_metadata.get("pcd_error")
    if error:
        raise OutputParserException(error, llm_output=str(message.content))
    parsed = message.additional_kwargs.get("parsed")
    if isinstance(schema, type) and is_basemodel_subclass(schema) and isinstance(parsed, schema):
        return parsed
    text = str(message.content)
    try:
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            return schema.model_validate_json(text)
        if isinstance(schema, type) and is_basemodel_subclass(schema):  # pydantic.v1
            return schema.parse_raw(text)  # type: ignore[attr-defined]
        return json.loads(text)
    except Exception as parse_error:
        raise OutputParserException(str(parse_error), llm_output=text) from parse_error


def parsed_chain(llm: Runnable, schema: Any, include_raw: bool) -> Runnable:  # type: ignore[type-arg]
    """The bound model followed by the parser; with `include_raw`, `{"raw", "parsed",
    "parsing_error"}`."""
    parser = RunnableLambda(lambda message: parse_structured(message, schema), name="PCDOutputParser")
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")
