"""LangChain's messages -> the engine's `Conversation`, once per call (the only place LangChain's
message types are read): system messages become the system text, an AIMessage's `tool_calls` the
turn's calls (their ids kept), a ToolMessage a tool result tied to its call by `tool_call_id`.

    >>> from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    >>> asked = conversation_of([
    ...     HumanMessage("Where is A1?"),
    ...     AIMessage("", tool_calls=[{"name": "lookup", "args": {"id": "A1"}, "id": "c1"}]),
    ...     ToolMessage("shipped", tool_call_id="c1"),
    ... ])
    >>> [t.role for t in asked.turns], asked.turns[2].name
    (['user', 'assistant', 'tool'], 'lookup')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    ToolMessage,
    convert_to_messages,
)
from langchain_core.prompt_values import PromptValue

from pcd_engine import ROLE_ALIASES, Call, Conversation, Turn

IGNORED_BLOCKS = ("tool_use", "tool_call", "function_call", "reasoning", "thinking")  # said elsewhere


def conversation_of(messages: Sequence[BaseMessage]) -> Conversation:
    """The engine's conversation for these messages (InputError naming a bad turn)."""
    system: list[str] = []
    turns: list[Turn] = []
    for message in messages:
        role = message.role if isinstance(message, ChatMessage) else message.type
        role = ROLE_ALIASES.get(role, role)
        text = message_text(message)
        if role == "system":
            system.append(text)
        elif isinstance(message, ToolMessage):
            failed = message.status == "error" and not text.startswith("Error")
            turns.append(Turn("tool", "Error: " + text if failed else text, call_id=message.tool_call_id))
        elif isinstance(message, AIMessage) and message.tool_calls:
            calls = tuple(Call(c["name"], dict(c["args"]), c["id"] or "") for c in message.tool_calls)
            turns.append(Turn("assistant", text, calls))
        else:
            turns.append(Turn(role, text))
    return Conversation(tuple(turns), "\n\n".join(system) or None)


def message_text(message: BaseMessage) -> str:
    """A message's text; blocks that restate its tool calls are skipped, other media refused."""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") in IGNORED_BLOCKS:
            continue
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatMiniCPM takes text only; got a {kind!r} content block")
    return "".join(parts)


def input_messages(value: LanguageModelInput) -> list[BaseMessage]:
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


def input_conversation(value: Any) -> Conversation:
    """The conversation of a chat model's input."""
    return conversation_of(input_messages(value))
