"""Tool definitions and the decision they make: which tool to call, or a text answer, is one more
closed field.

For a set of tools and a `tool_choice`, a decision schema is built once (`ToolPlan`):

    {"tool": "get_weather" | "search" | "respond_to_user",    the last: a text answer ("auto" only)
     "get_weather": {"unit": "c" | "f"},                      each tool's closed arguments, under its name
     ...}

It is scored like any schema (tool_calls.py runs it) after the conversation: the decision and the
closed arguments of the candidate tools, each argument's branch under its own tool's name. Each
tool's arguments depend on the decision (`pcd_gates`): where the engine's policy says a second call
pays, only the chosen tool's are scored, after the decision (gates.py), and the others are None.
A template with a tool protocol (`ChatPrompt.supports_tools`) renders the tool definitions in the
system turn itself (`pcd_tools`); elsewhere the schema's description lists them.

    >>> plan = build_tool_plan(as_tools([{"name": "get_weather"}]), ToolChoice("auto"), in_template=False)
    >>> plan.text_value, sorted(plan.schema.model_fields)
    ('respond_to_user', ['tool'])
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, create_model

from pcd_engine.errors import InputError, PCDError
from pcd_engine.output_types import output_type
from pcd_engine.schema import compile_schema

TOOL_CHOICES = ("auto", "required", "none")
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
DECISION_KEYS = ("tool", "tool_name", "function", "pcd_tool")  # the first no tool is named
# The decision's value for a text answer, the first that no tool is named. A word the model reads
# beside the tool names: on SmolLM2, null was chosen for 1 of 5 text answers, this for 5 of 5.
TEXT_ANSWERS = ("respond_to_user", "reply_to_user", "answer_in_text")
INSTRUCTIONS = (
    "Decide the assistant's next step in the conversation: call one of the tools{listed}{or_text}. "
    "Reply with one JSON object with the fields below, choosing each value only from the allowed ones. "
    "Fill the arguments of the tool you call; the other tools' arguments are ignored."
)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON schema;
    `model`, where the arguments are a Pydantic class, validates them (else one is built from
    `parameters`)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    model: type[BaseModel] | None = field(default=None, compare=False)

    def openai(self) -> dict[str, Any]:
        """The tool as an OpenAI `tools` entry (what chat templates with a tool protocol read)."""
        function = {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}
        return {"type": "function", "function": function}


def as_tool(spec: Any) -> Tool:
    """A Tool from a Tool, a Pydantic class (its name, docstring and fields), an OpenAI `tools`
    entry (`{"type": "function", "function": {...}}`) or a bare function definition (`{"name",
    "description", "parameters"}`); InputError otherwise."""
    if isinstance(spec, Tool):
        tool = spec
    elif isinstance(spec, type) and issubclass(spec, BaseModel):
        parameters = spec.model_json_schema()
        parameters.pop("title", None)
        description = str(parameters.pop("description", "") or "")
        tool = Tool(spec.__name__, description, parameters, spec)
    else:
        if not isinstance(spec, Mapping):
            raise InputError(f"a tool must be a dict or a Tool, got {type(spec).__name__}")
        if spec.get("type", "function") != "function":
            raise InputError(f"tools of type {spec.get('type')!r} are not supported; only 'function'")
        function = spec.get("function", spec)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InputError("a tool needs a 'name' (in 'function' for OpenAI tools entries)")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        tool = Tool(function["name"], str(function.get("description") or ""), parameters)
    if not NAME.match(tool.name):
        raise InputError(f"tool name {tool.name!r} must be 1-64 letters, digits, '_', '-', '.' or ':'")
    if not isinstance(tool.parameters, Mapping) or tool.parameters.get("type", "object") != "object":
        raise InputError(f"tool {tool.name!r}: parameters must be a JSON schema of type 'object'")
    return tool


def as_tools(specs: Sequence[Any]) -> tuple[Tool, ...]:
    if isinstance(specs, (str, bytes, Mapping)) or not isinstance(specs, Sequence):
        raise InputError("tools must be a list of tool definitions")
    tools = tuple(as_tool(s) for s in specs)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InputError(f"tool names must be unique, got {names}")
    return tools


@dataclass(frozen=True)
class ToolChoice:
    """`mode`: "auto" (a tool or a text answer), "required" (some tool), "none" (text only) or
    "named" (that tool, `name`)."""

    mode: str
    name: str | None = None

    @classmethod
    def parse(cls, value: Any, tools: Sequence[Tool]) -> ToolChoice:
        """From OpenAI's and LangChain's forms: None/"auto", "none", "required"/"any"/True, a tool's
        name, `{"type": "function", "function": {"name": ...}}` or `{"name": ...}`."""
        names = [t.name for t in tools]
        if value is None or value == "auto":
            return cls("auto" if tools else "none")
        if value in ("required", "any") or value is True:
            chosen = cls("required")
        elif value == "none" or value is False:
            return cls("none")
        elif isinstance(value, str):
            chosen = cls("named", value)
        elif isinstance(value, Mapping):
            function = value.get("function", value)
            name = function.get("name") if isinstance(function, Mapping) else None
            if not isinstance(name, str):
                raise InputError(f"tool_choice {value!r} names no function")
            chosen = cls("named", name)
        else:
            raise InputError(f"tool_choice must be 'auto', 'none', 'required' or a tool, got {value!r}")
        if not tools:
            raise InputError(f"tool_choice {value!r} asks for a tool call, but no tools were given")
        if chosen.name is not None and chosen.name not in names:
            raise InputError(f"tool_choice names {chosen.name!r}, which is not among the tools {names}")
        return chosen

    def allowed(self, tools: Sequence[Tool]) -> tuple[Tool, ...]:
        if self.mode == "none":
            return ()
        return tuple(t for t in tools if self.name is None or t.name == self.name)


@dataclass(frozen=True)
class ToolArguments:
    """A tool's argument model, split into the arguments scored in the decision pass (closed: every
    leaf under a top-level argument is a closed choice) and those generated after it."""

    tool: Tool
    model: type[BaseModel]
    closed: tuple[str, ...]  # top-level field names of `model`
    field: str | None  # the decision model's field holding them (None: nothing to score)

    def keys(self) -> dict[str, str]:
        """Field name -> JSON key of the closed arguments."""
        fields = self.model.model_fields
        return {n: a if isinstance(a := fields[n].alias, str) else n for n in self.closed}


class ToolDecision(BaseModel):
    """Base of the decision models: they carry their tools for templates with a tool protocol, and
    which decision each tool's arguments depend on (`pcd_gates`: field -> (decision path, value)):
    the engine scores a tool's arguments only where that tool is chosen (gates.py), and leaves the
    other tools' at their default, None."""

    pcd_tools: ClassVar[tuple[dict[str, Any], ...]] = ()
    pcd_gates: ClassVar[dict[str, tuple[str, str]]] = {}


@dataclass(frozen=True)
class ToolPlan:
    """What a (tools, tool_choice) pair needs, built once: the decision schema and each allowed
    tool's arguments."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    key: str  # the decision's JSON key
    schema: type[BaseModel] | None  # None under tool_choice "none"
    arguments: dict[str, ToolArguments]
    instructions: str = ""  # the decision's system instructions
    text_value: str | None = None  # the decision's value for a text answer (None: not allowed)

    @property
    def forced(self) -> str | None:
        """The one tool a call must name ("required" with one tool, or a named choice)."""
        if self.choice.mode == "named" or (self.choice.mode == "required" and len(self.arguments) == 1):
            return next(iter(self.arguments))
        return None

    def label(self, label: Any, index: int = 0) -> dict[str, Any]:
        """A decision label in the schema's JSON form from a tool's name, None (a text answer) or
        `{"tool": name_or_None, "arguments": {...}}` (its closed arguments are kept)."""
        arguments: Mapping[str, Any] = {}
        if isinstance(label, Mapping):
            label, arguments = label.get("tool"), label.get("arguments") or {}
        if label is None and self.text_value is not None:
            label = self.text_value
        if label not in self.arguments and label != self.text_value:
            raise InputError(f"label #{index}: {label!r} is neither an allowed tool nor a text answer")
        out: dict[str, Any] = {self.key: label}
        found = self.arguments.get(label)
        if found is not None and found.field is not None:
            keys = found.keys().values()
            out[label] = {k: v for k, v in arguments.items() if k in keys}
        return out

    def tool_of(self, value: str) -> str | None:
        """The tool a decision value names (None: the text answer)."""
        return None if value == self.text_value else value


def build_tool_plan(tools: Sequence[Tool], choice: ToolChoice, in_template: bool) -> ToolPlan:
    taken = {t.name for t in tools}
    key = next(k for k in DECISION_KEYS if k not in taken)
    allowed = choice.allowed(tools)
    arguments = {t.name: _arguments(t, n) for n, t in enumerate(allowed)}
    if not allowed:
        return ToolPlan(tuple(tools), choice, key, None, arguments)
    text = next(v for v in TEXT_ANSWERS if v not in taken) if choice.mode == "auto" else None
    values: Any = Literal.__getitem__((*(t.name for t in allowed), *([text] if text else [])))  # type: ignore[attr-defined]
    said = f", or {text!r} to answer the user in text" if text else ""
    fields: dict[str, Any] = {"tool": (values, Field(alias=key, description=f"The tool to call{said}."))}
    for a in arguments.values():
        if a.field is not None:
            source = a.model.model_fields
            closed = {n: (source[n].annotation, source[n]) for n in a.closed}
            nested = create_model(f"Arguments{a.field}", **closed)  # type: ignore[call-overload]
            fields[a.field] = (nested, Field(None, alias=a.tool.name, description=None))
    listed = "" if in_template else " listed below"
    or_text = f', or answer the user in text ("{key}": "{text}")' if text else ""
    doc = None if in_template else "Tools:\n" + "\n".join(_tool_line(t) for t in allowed)
    schema = create_model("ToolCall", __base__=ToolDecision, __doc__=doc, **fields)
    schema.pcd_tools = tuple(t.openai() for t in allowed)
    schema.pcd_gates = {a.field: ("tool", a.tool.name) for a in arguments.values() if a.field is not None}
    instructions = INSTRUCTIONS.format(listed=listed, or_text=or_text)
    return ToolPlan(tuple(tools), choice, key, schema, arguments, instructions, text)


def _arguments(tool: Tool, index: int) -> ToolArguments:
    try:
        definition = {"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)}
        model = tool.model or output_type(definition).model  # titled by the tool's name
        if not model.model_fields:  # a tool without arguments
            return ToolArguments(tool, model, (), None)
        compiled = compile_schema(model, allow_open=True)
    except PCDError as error:
        raise InputError(f"tool {tool.name!r}: its parameters cannot be used: {error}") from error
    opened = {f.path.split(".")[0] for f in compiled.open_fields}
    scored = {f.path.split(".")[0] for f in compiled.fields}
    closed = tuple(n for n in model.model_fields if n in scored and n not in opened)
    return ToolArguments(tool, model, closed, f"tool_{index}" if closed else None)


def _tool_line(tool: Tool) -> str:
    line = f"- {tool.name}" + (f": {tool.description.strip()}" if tool.description.strip() else "")
    properties = tool.parameters.get("properties") or {}
    if properties:
        line += " Arguments: " + json.dumps(properties, ensure_ascii=False)
    return line


def pinned_arguments(a: ToolArguments, closed: Mapping[str, Any]) -> type[BaseModel]:
    """The tool's argument model with the scored arguments fixed to their values (single-value
    fields are not scored again): what the open arguments are generated under."""
    fields: dict[str, Any] = {}
    for name, value in closed.items():
        info = a.model.model_fields[name]
        fixed: Any = Literal.__getitem__(value)  # type: ignore[attr-defined]
        fields[name] = (fixed, Field(value, alias=info.alias, description=info.description))
    return create_model(f"Call{a.field}", __base__=a.model, __doc__=None, **fields)  # type: ignore[call-overload]


__all__ = [
    "TOOL_CHOICES",
    "Tool",
    "ToolArguments",
    "ToolChoice",
    "ToolPlan",
    "as_tool",
    "as_tools",
    "build_tool_plan",
]
