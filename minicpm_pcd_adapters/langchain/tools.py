"""LangChain tool calling on the engine: what `ChatMiniCPM.bind_tools` binds and what a call answers.

`engine_tools` turns LangChain's tool forms (BaseTool, functions, Pydantic classes, TypedDicts, OpenAI
dicts) into the engine's tools, keeping a Pydantic argument class where there is one (so that a forced
call answers exactly as `with_structured_output` would). `tool_message` writes `engine.tools.call`'s
answer as an AIMessage with `tool_calls` (the engine's call id) and the decision's probabilities in
`response_metadata["pcd"]`. Messages become the engine's conversation in messages.py.

    >>> engine_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}])[0].name
    'f'
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, ToolCallChunk
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel

from pcd_engine import Tool, ToolCallResult, as_tools


def engine_tools(tools: Sequence[Any]) -> tuple[Tool, ...]:
    """The engine's tools for LangChain's tool forms (InputError for a bad one)."""
    out: list[Any] = []
    for t in tools:
        if isinstance(t, type) and issubclass(t, BaseModel):
            out.append(t)
            continue
        spec = convert_to_openai_tool(t)
        schema = getattr(t, "args_schema", None) if isinstance(t, BaseTool) else None
        if isinstance(schema, type) and issubclass(schema, BaseModel):  # keep the class: it validates
            f = spec["function"]
            out.append(Tool(f["name"], f.get("description") or "", f.get("parameters") or {}, schema))
        else:
            out.append(spec)
    return as_tools(out)


def tool_message(result: ToolCallResult, model_name: str, content: str | None = None) -> AIMessage:
    """The AIMessage of a tool decision: a tool call with an id, or the text answer (`content`
    overrides it: a structured answer to a `response_format`)."""
    calls = []
    if result.tool is not None:
        calls.append(
            {
                "name": result.tool,
                "args": result.arguments or {},
                "id": result.call_id,
                "type": "tool_call",
            }
        )
    finish = "tool_calls" if calls else result.finish_reason
    return AIMessage(
        content=content if content is not None else (result.text or ""),
        tool_calls=calls,
        usage_metadata={
            "input_tokens": result.prompt_tokens,
            "output_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        },
        response_metadata={
            "model_name": model_name,
            "finish_reason": finish,
            "pcd": result.to_json(),
        },
    )


def response_schema(response_format: Any) -> Any:
    """What the engine answers for a bound `response_format`: a Pydantic class or TypedDict as it is,
    OpenAI's `{"type": "json_schema", "json_schema": {"schema": ...}}` as its schema dict; None for
    `{"type": "json_object"}` (any JSON object)."""
    if isinstance(response_format, Mapping):
        kind = response_format.get("type")
        if kind == "json_object":
            return None
        if kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            if not isinstance(schema, Mapping):
                raise ValueError("response_format json_schema needs a 'schema'")
            return dict(schema)
        raise ValueError(f"response_format type {kind!r} is not supported (json_schema, json_object)")
    return response_format


def tool_call_chunks(message: AIMessage) -> list[ToolCallChunk]:
    """The message's calls as streamed `tool_call_chunks` (each whole, in one chunk)."""
    return [
        tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
        for i, c in enumerate(message.tool_calls)
    ]
