"""LlamaIndex's chat messages -> the engine's `Conversation`, once per call (the only place their
roles and blocks are read): system messages become the system text, an assistant's `ToolCallBlock`s
(or OpenAI-style `additional_kwargs["tool_calls"]`) its calls, a `tool` message a tool result tied
to its call by `additional_kwargs["tool_call_id"]`.

    >>> from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
    >>> called = ToolCallBlock(tool_call_id="c1", tool_name="lookup", tool_kwargs={"id": "A1"})
    >>> asked = conversation_of([
    ...     ChatMessage(role="user", content="Where is A1?"),
    ...     ChatMessage(role="assistant", blocks=[called]),
    ...     ChatMessage(role="tool", content="shipped", additional_kwargs={"tool_call_id": "c1"}),
    ... ])
    >>> [t.role for t in asked.turns], asked.turns[2].name
    (['user', 'assistant', 'tool'], 'lookup')
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock

from pcd_engine import ROLE_ALIASES, Call, Conversation, InputError, Turn


def conversation_of(messages: Sequence[ChatMessage]) -> Conversation:
    """The engine's conversation for these messages (InputError naming a bad turn)."""
    system: list[str] = []
    turns: list[Turn] = []
    for index, message in enumerate(messages):
        role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
        role = ROLE_ALIASES.get(role, role)
        text = message.content or ""
        extra = message.additional_kwargs
        if role == "system":
            system.append(text)
        elif role == "tool":
            call_id = extra.get("tool_call_id")
            turns.append(Turn("tool", text, call_id=call_id if isinstance(call_id, str) else None))
        elif role == "assistant":
            turns.append(Turn("assistant", text, _calls(message, index)))
        else:
            turns.append(Turn(role, text))
    return Conversation(tuple(turns), "\n\n".join(system) or None)


def _calls(message: ChatMessage, index: int) -> tuple[Call, ...]:
    blocks = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    if blocks:
        return tuple(
            Call(b.tool_name, _arguments(b.tool_kwargs, index), b.tool_call_id or "") for b in blocks
        )
    out = []
    for call in message.additional_kwargs.get("tool_calls") or []:  # OpenAI-style, dicts or objects
        entry = call.model_dump() if hasattr(call, "model_dump") else call
        function = entry.get("function", entry) if isinstance(entry, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InputError(f"message #{index}: a tool call needs a name")
        out.append(
            Call(function["name"], _arguments(function.get("arguments"), index), entry.get("id") or "")
        )
    return tuple(out)


def _arguments(value: Any, index: int) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as error:
            raise InputError(f"message #{index}: tool call arguments are not JSON: {error}") from None
    if not isinstance(value, Mapping):
        raise InputError(f"message #{index}: tool call arguments must be an object")
    return dict(value)
