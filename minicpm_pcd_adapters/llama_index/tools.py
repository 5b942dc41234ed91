"""LlamaIndex function calling on the engine: what `MiniCPMLLM.chat_with_tools` sends and answers.

`engine_tools` turns LlamaIndex tools into the engine's (a tool's `fn_schema` class validates its
arguments); `tool_response` writes `engine.tools.call`'s answer as a ChatResponse whose message holds
a `ToolCallBlock` per call and whose `raw["pcd"]` and `additional_kwargs["pcd"]` hold the decision's
probabilities. `parser_schema` finds the JSON schema a `PydanticOutputParser` appended to a prompt
(what `LLMTextCompletionProgram` sends), so that the engine answers it.

    >>> parser_schema([ChatMessage(role="user", content="hi")]) is None
    True
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.output_parsers.pydantic import PYDANTIC_FORMAT_TMPL
from llama_index.core.tools import ToolSelection
from pydantic import BaseModel

from pcd_engine import Tool, ToolCallResult, as_tools

_BEFORE, _AFTER = PYDANTIC_FORMAT_TMPL.split("{schema}")


def engine_tools(tools: Sequence[Any]) -> tuple[Tool, ...]:
    """The engine's tools for LlamaIndex tools (their metadata's OpenAI form and `fn_schema`)."""
    out = []
    for t in tools:
        spec = t.metadata.to_openai_tool()["function"]
        schema = t.metadata.fn_schema
        model = schema if isinstance(schema, type) and issubclass(schema, BaseModel) else None
        out.append(Tool(spec["name"], spec.get("description") or "", spec.get("parameters") or {}, model))
    return as_tools(out)


def tool_response(result: ToolCallResult) -> ChatResponse:
    """The ChatResponse of a tool decision: a ToolCallBlock (with an id) or the text answer."""
    blocks: list[Any] = [TextBlock(text=result.text)] if result.text else []
    if result.tool is not None:
        arguments = result.arguments or {}
        blocks.append(
            ToolCallBlock(tool_call_id=result.call_id, tool_name=result.tool, tool_kwargs=arguments)
        )
    pcd = result.to_json()
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks),
        raw={"finish_reason": result.finish_reason, "pcd": pcd},
        additional_kwargs={
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "pcd": pcd,
        },
    )


def tool_selections(response: ChatResponse) -> list[ToolSelection]:
    """The calls in a response's message, as LlamaIndex selects tools."""
    return [
        ToolSelection(
            tool_id=b.tool_call_id or "",
            tool_name=b.tool_name,
            tool_kwargs=b.tool_kwargs if isinstance(b.tool_kwargs, dict) else json.loads(b.tool_kwargs),
        )
        for b in response.message.blocks
        if isinstance(b, ToolCallBlock)
    ]


def parser_schema(messages: Sequence[ChatMessage]) -> tuple[list[ChatMessage], dict[str, Any]] | None:
    """(the messages without them, the schema) where the last message ends with a
    PydanticOutputParser's format instructions; None otherwise."""
    if not messages:
        return None
    text = messages[-1].content or ""
    start = text.rfind(_BEFORE)
    if start < 0 or not text.endswith(_AFTER):
        return None
    escaped = text[start + len(_BEFORE) : len(text) - len(_AFTER)]
    try:
        schema = json.loads(escaped.replace("{{", "{").replace("}}", "}"))
    except json.JSONDecodeError:
        return None
    kept = ChatMessage(role=messages[-1].role, content=text[:start].rstrip())
    return [*messages[:-1], kept], schema
