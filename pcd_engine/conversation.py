"""One conversation, whatever the door: system text, user / assistant / tool turns, an assistant turn's
calls (name, arguments, id) and tool results tied to their call.

Every door turns its own messages into a `Conversation` once (the server from its protocol's messages,
LangChain from `BaseMessage`s, LlamaIndex from `ChatMessage`s; `Conversation.of` reads plain
role/content dicts, OpenAI-shaped dicts and (role, content) pairs), and the engine renders it one way
(prompt.py). It is checked here, once: an `InputError` names the turn. Contents stay text: they are
encoded as data when rendered, never as control tokens.

    >>> asked = Conversation.of([
    ...     {"role": "system", "content": "Be brief."},
    ...     {"role": "user", "content": "Where is order A123?"},
    ...     {"role": "assistant", "tool_calls": [{"id": "c1", "name": "lookup", "arguments": {"id": "A1"}}]},
    ...     {"role": "tool", "tool_call_id": "c1", "content": "shipped"},
    ... ])
    >>> asked.system, [t.role for t in asked.turns], asked.turns[2].name
    ('Be brief.', ['user', 'assistant', 'tool'], 'lookup')
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pcd_engine.errors import InputError

TURN_ROLES = ("user", "assistant", "tool")
# The one map from the roles other protocols use to ours: OpenAI's `developer`, LangChain's message
# types, LlamaIndex's and Cohere's assistant names, OpenAI's legacy `function` results.
ROLE_ALIASES = {
    "developer": "system",
    "human": "user",
    "ai": "assistant",
    "chatbot": "assistant",
    "model": "assistant",
    "function": "tool",
}


def new_call_id() -> str:
    """A fresh tool-call id, OpenAI's form (`call_` and 24 hex digits): the only place ids are minted."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Call:
    """A tool call an assistant turn made: the tool's name, its arguments (a JSON object) and its id."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""  # empty: a new one is minted (new_call_id)

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", new_call_id())

    def openai(self) -> dict[str, Any]:
        """The call as an OpenAI `tool_calls` entry, arguments as an object (what templates read)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Turn:
    """One turn after the system text. `calls` only on an assistant turn; a tool turn's `call_id`
    and `name` say which call it answers."""

    role: str  # "user", "assistant" or "tool"
    content: str = ""
    calls: tuple[Call, ...] = ()
    call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True, eq=False)
class Conversation:
    """A checked conversation: the system text (all system messages, joined) and the other turns.

    A plain string is one user turn (`Conversation.of("text")`); `text` is the documented fallback
    rendering where a chat template cannot render the turns as turns (prompt.py)."""

    turns: tuple[Turn, ...]
    system: str | None = None

    def __post_init__(self) -> None:
        check_turns(self.turns, self.system)
        object.__setattr__(self, "turns", tie_results(self.turns))

    @classmethod
    def of(cls, messages: Any) -> Conversation:
        """A Conversation from a str (one user message), a Conversation, or a list of messages: dicts
        with `role` and `content` (a str, None or OpenAI text parts), an assistant's `tool_calls`
        (`{"id", "function": {"name", "arguments"}}` or `{"id", "name", "arguments"}`, arguments an
        object or its JSON), a tool result's `tool_call_id` (or `name`); or (role, content) pairs.
        InputError names the first bad message."""
        if isinstance(messages, Conversation):
            return messages
        if isinstance(messages, str):
            return cls((Turn("user", messages),))
        if isinstance(messages, (bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
            raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...} items")
        system: list[str] = []
        turns: list[Turn] = []
        for index, message in enumerate(messages):
            role, turn = _read_message(message, index)
            if role == "system":
                system.append(turn.content)
            else:
                turns.append(turn)
        return cls(tuple(turns), "\n\n".join(system) or None)

    @property
    def user_text(self) -> str | None:
        """The text of a conversation that is one user turn (rendered exactly as a plain string)."""
        if len(self.turns) == 1 and self.turns[0].role == "user":
            return self.turns[0].content
        return None

    @property
    def text(self) -> str:
        """The fallback rendering as one text: one user message as it is, a longer conversation as
        "Role: content" paragraphs (`plain_turns`)."""
        if self.user_text is not None:
            return self.user_text
        return "\n\n".join(f"{role.title()}: {content}" for role, content in self.plain_turns())

    def plain_turns(self, result_role: str = "tool") -> list[tuple[str, str]]:
        """(role, content) pairs for a template without a tool protocol: an assistant's calls are
        left out (its words, if any, stay), each tool result is a turn of `result_role` holding the
        result as it is ("user": in `result_text`'s words). Chosen on the dev data
        (benchmarks/agents.py): on SmolLM2, no text answer wrote the call again, and half used the
        result, against every one writing the call again when calls were rendered as JSON."""
        out = []
        for turn in self.turns:
            if turn.role == "tool":
                out.append((result_role, turn.content if result_role == "tool" else result_text(turn)))
            elif turn.content or not turn.calls:
                out.append((turn.role, turn.content))
        return out

    @cached_property
    def key(self) -> str:
        """The whole conversation as one JSON string: equal conversations, equal keys."""
        turns = [
            [t.role, t.content, [[c.name, c.arguments, c.id] for c in t.calls], t.call_id] for t in self.turns
        ]
        return json.dumps([self.system, turns], sort_keys=True, ensure_ascii=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Conversation) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"Conversation({len(self.turns)} turns, system={self.system!r:.40})"


# A tool's result as a user turn, for a template without a tool protocol that rejects the `tool` role.
RESULT_WORDING = "The tool {name} returned:\n{content}"


def result_text(turn: Turn) -> str:
    """A tool's result in words (a user turn, where the template has no `tool` role)."""
    return RESULT_WORDING.format(name=turn.name or "tool", content=turn.content)


def check_turns(turns: Sequence[Turn], system: str | None) -> None:
    if system is not None and not isinstance(system, str):
        raise InputError(f"a Conversation's system text must be a str, got {type(system).__name__}")
    if not isinstance(turns, tuple) or not turns:
        raise InputError("a Conversation needs at least one user, assistant or tool turn")
    for index, turn in enumerate(turns):
        if not isinstance(turn, Turn):
            raise InputError(f"turn #{index} must be a Turn, got {type(turn).__name__}")
    if all(t.role == "assistant" for t in turns):
        raise InputError("a Conversation needs a user message or a tool result, not only assistant turns")
    for index, turn in enumerate(turns):
        if turn.role not in TURN_ROLES:
            raise InputError(f"turn #{index}: role {turn.role!r} is not one of {TURN_ROLES}")
        if not isinstance(turn.content, str):
            raise InputError(f"turn #{index}: content must be a str, got {type(turn.content).__name__}")
        if turn.calls and turn.role != "assistant":
            raise InputError(f"turn #{index}: only an assistant turn makes tool calls")


def tie_results(turns: Iterable[Turn]) -> tuple[Turn, ...]:
    """The turns with each tool result tied to its call: by `call_id`, or else the earliest call
    not yet answered (its id and name filled in). InputError for a result that answers no call."""
    out: list[Turn] = []
    open_calls: dict[str, Call] = {}
    for index, turn in enumerate(turns):
        if turn.role == "assistant":
            open_calls.update((c.id, c) for c in turn.calls)
        elif turn.role == "tool":
            call = open_calls.pop(turn.call_id, None) if turn.call_id is not None else None
            if call is None and turn.call_id is None and open_calls:
                call = open_calls.pop(next(iter(open_calls)))
            if call is None:
                said = f" {turn.call_id!r}" if turn.call_id is not None else ""
                raise InputError(
                    f"turn #{index}: a tool result answers the call{said}, but no earlier assistant "
                    "turn made it (put the assistant's tool_calls before their results)"
                )
            turn = Turn("tool", turn.content, (), call.id, turn.name or call.name)
        out.append(turn)
    return tuple(out)


def _read_message(message: Any, index: int) -> tuple[str, Turn]:
    calls: tuple[Call, ...] = ()
    if isinstance(message, tuple) and len(message) == 2:
        role, content, call_id, name = message[0], message[1], None, None
    elif isinstance(message, Mapping):
        role, content = message.get("role"), message.get("content")
        calls = tuple(_read_call(c, index) for c in message.get("tool_calls") or ())
        call_id, name = message.get("tool_call_id"), message.get("name")
    else:
        raise InputError(
            f"message #{index} must be a dict with 'role' and 'content' or a (role, content) pair"
        )
    if not isinstance(role, str):
        raise InputError(f"message #{index}: role must be a str, got {role!r:.40}")
    role = ROLE_ALIASES.get(role, role)
    if role not in ("system", *TURN_ROLES):
        raise InputError(f"message #{index}: role {role!r} is not system, user, assistant or tool")
    content = _read_content(content, index, role, bool(calls))
    if call_id is not None and not isinstance(call_id, str):
        raise InputError(f"message #{index}: tool_call_id must be a str")
    if role != "tool":
        call_id, name = None, None
    elif not isinstance(name, str):
        name = None
    return role, Turn(role, content, calls if role == "assistant" else (), call_id, name)


def _read_content(content: Any, index: int, role: str, has_calls: bool) -> str:
    if content is None and (has_calls or role == "assistant"):
        return ""
    if isinstance(content, list):  # OpenAI text parts
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif (
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InputError(f"message #{index}: only text content is read, got a {kind!r} part")
        return "".join(parts)
    if not isinstance(content, str):
        raise InputError(f"message #{index}: content must be a str, got {type(content).__name__}")
    return content


def _read_call(call: Any, index: int) -> Call:
    """An earlier call: `{"id", "name", "arguments"}` or OpenAI's `{"id", "function": {"name",
    "arguments": "<json>"}}`; a call without an id gets one."""
    function = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InputError(f"message #{index}: a tool call needs a name")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise InputError(f"message #{index}: tool call arguments are not JSON: {error}") from None
    if not isinstance(arguments, Mapping):
        raise InputError(f"message #{index}: tool call arguments must be an object")
    call_id = call.get("id") if isinstance(call, Mapping) else None
    if call_id is not None and not isinstance(call_id, str):
        raise InputError(f"message #{index}: a tool call's id must be a str")
    return Call(function["name"], dict(arguments), call_id or "")


def system_texts(inputs: Iterable[Any]) -> list[str | None]:
    """Each input's system text (None for a plain string or a raw prompt)."""
    return [item.system if isinstance(item, Conversation) else None for item in inputs]


def joined(*texts: str | None) -> str | None:
    """System texts one after the other (a conversation's own, then the call's instructions)."""
    return "\n\n".join(t for t in texts if t) or None


__all__ = ["Call", "Conversation", "Turn", "new_call_id"]
